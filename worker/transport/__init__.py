"""The worker's transport: it moves bytes.

:class:`~bitps.worker.transport.client.PSClient` (push/pull over one data channel per shard and
thread, recovery of a lost shard) and :class:`~bitps.worker.transport.control.ControlClient`
(Register, Heartbeat, Status, Leave, rule state over gRPC). What a push carries is decided above
it (``worker.training.encoder``); it imports neither torch, nor the training layer, nor
``bitps.worker.algorithms`` (``tests/test_layering.py``).
"""
