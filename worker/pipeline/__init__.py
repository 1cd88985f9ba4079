"""Pipeline parallelism: schedules as data, an event simulator, balanced stages, dynamic
micro-batching, and the stage runtime that executes a schedule with ``torch.distributed``
point-to-point transfers and pushes each stage's own keys to the shards.

The pure parts (``actions``, ``schedules``, ``simulate``, ``partition``, ``microbatch``) import
no torch, so a plan is checked, and a refused one refused, before any process starts.
"""
