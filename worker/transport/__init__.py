"""The worker's transport: :class:`~bitps.worker.transport.client.PSClient` (registration,
heartbeats, push/pull over one data channel per shard) and the push-policy interface it calls.

It moves bytes and knows no algorithm: it imports neither torch nor ``bitps.worker.algorithms``
(``tests/test_layering.py``). Algorithms plug in through
:data:`~bitps.worker.transport.push_policy.POLICIES`.
"""
