"""Demo and launch: the demo model and corpus (:mod:`.demo`) and ``bitps-launch``, the local
cluster launcher (:mod:`.launcher`; ``python -m bitps.worker.launch``)."""
