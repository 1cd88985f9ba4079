"""Worker-side algorithms, one module each: 1-bit Adam's push policies (:mod:`.onebit`) and
local SGD / DiLoCo (:mod:`.local_sgd`). Importing this package registers their push policies
with the transport (``bitps.worker`` does so on import)."""

from bitps.worker.algorithms import onebit  # noqa: F401  (registers its push policies)
