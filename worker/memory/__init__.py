"""Activation memory: the pooled arena with host offload
(:class:`~bitps.worker.memory.pool.ActivationPool`)."""
