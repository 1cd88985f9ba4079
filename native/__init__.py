"""Numba kernels: server update rules (and, later, codecs and the buddy allocator).

Imports numpy and numba only. Kernels take flat numpy arrays and scalars, never allocate, and
document their byte layout and buffer ownership.
"""

from native.update_rules import (
    accumulate,
    adam_step,
    all_finite,
    momentum_step,
    sgd_step,
)

__all__ = ["accumulate", "adam_step", "all_finite", "momentum_step", "sgd_step"]
