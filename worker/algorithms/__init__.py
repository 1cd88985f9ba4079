"""Worker-side algorithms, one module each: 1-bit Adam's push policies (:mod:`.onebit`), local
SGD / DiLoCo (:mod:`.local_sgd`), and the registry of trainers ``bitps-worker --algorithm``
picks from (:mod:`.trainers`: ``ps``, ``diloco``, and any a plug-in registers). Importing this
package registers the push policies and the trainers (``bitps.worker`` does so on import);
nothing here imports torch until a trainer is made."""

# imported to register: onebit its push policies, trainers ps and diloco
from bitps.worker.algorithms import onebit, trainers  # noqa: F401
