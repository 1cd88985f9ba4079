"""Launch and diagnose: ``bitps-launch``, the local cluster launcher (:mod:`.launcher`; its
entry point is :mod:`.__main__`, also ``python -m bitps.worker.launch``), and ``bitps-status``,
the hang doctor (:mod:`.status`), over :mod:`.waits`, the diagnosis of who waits for whom."""
