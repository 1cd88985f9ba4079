"""Numba kernels: server update rules (and Adam's step of a pushed code, ``coded``), the fused
update-and-publish kernels (``publish``), the
thread pool that runs them over a message's keys (``keypool``) and
gradient codecs (``casts``, ``sign1``, ``sparse``;
each module also holds the numpy reference it is tested against; ``sparse`` re-exports the
names of its split: ``sparse_format``, ``sparse_kernels``, ``sparse_reference``).

Imports numpy and numba only. Kernels take flat numpy arrays and scalars, allocate nothing
beyond a chunk's scratch (sign1's 64 float64 lanes, a pushed code's decoded chunk), and
document their byte layout and buffer ownership.
"""

from pathlib import Path

from bitps.native.cache import drop_stale

drop_stale(Path(__file__).parent)  # before any kernel module: numba may load stale kernels

from bitps.native.coded import adam_step_code  # noqa: E402 (after the cache is checked)
from bitps.native.publish import (  # noqa: E402
    onebit_direction_publish,
    onebit_direction_publish_code,
    onebit_moments_publish,
    onebit_moments_publish_code,
    onebit_sync_publish,
    onebit_sync_publish_code,
    sign1_publish_delta,
)
from bitps.native.update_rules import (  # noqa: E402
    accumulate,
    adam_direction,
    adam_direction_correct,
    adam_step,
    add_into,
    add_scaled,
    all_finite,
    delayed_nesterov_step,
    extrapolate,
    look_ahead,
    momentum_step,
    onebit_adam_apply,
    onebit_adam_apply_den,
    onebit_adam_delta,
    onebit_denominator,
    onebit_direction_delta,
    sgd_step,
    sum_squares,
)

__all__ = ["accumulate", "adam_direction", "adam_direction_correct", "adam_step",
           "adam_step_code", "add_into",
           "add_scaled", "all_finite", "delayed_nesterov_step", "extrapolate", "look_ahead",
           "momentum_step",
           "onebit_adam_apply", "onebit_adam_apply_den", "onebit_adam_delta",
           "onebit_denominator", "onebit_direction_delta",
           "onebit_direction_publish", "onebit_direction_publish_code",
           "onebit_moments_publish", "onebit_moments_publish_code", "onebit_sync_publish",
           "onebit_sync_publish_code",
           "sgd_step", "sign1_publish_delta", "sum_squares"]
