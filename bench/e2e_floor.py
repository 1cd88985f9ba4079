"""The link's floor under an ``bitps-bench e2e`` run: the fastest its steps could go against
the no-traffic ceiling if nothing but its bytes on the emulated link cost time.

Each rank's step line (``bench.e2e_rank``) carries the payload bytes its pushes sent and its
pulls received in that step and whether the step was pushed serially (overlap off, or held for
its exact clip factor: ``PSModel.last_stats.overlapped`` false). The step's busiest link
direction carries ``x`` bytes (:func:`busiest_direction`); over the link's measured payload
rate ``L`` the step takes at least::

    T_c + x / L        serial: the exchange starts after backward, the next forward waits for it
    max(T_c, x / L)    overlapped: at best the exchange hides entirely under compute

with ``T_c`` the ceiling's step (its lower quartile: the machine's step-to-step noise would put
a mean above what some steps take). :func:`link_floor` is the ceiling's mean step over the mean
of those floors:
the most samples/s against the ceiling the run's own traffic and serial steps allow, whatever
the CPU does. Where it is below a goal, that goal is out of reach for the run's configuration
on this link (1-bit Adam's warm-up: full-precision traffic, held while its gradients clip).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["busiest_direction", "link_floor"]


def busiest_direction(pushes: Sequence[float], pulls: Sequence[float], *,
                      colocated: bool) -> float:
    """The most bytes one node's link carries in one direction in a step, ranks' ``pushes``
    and ``pulls`` (payload bytes, one entry per rank) spread evenly over as many shards as
    ranks. ``colocated``: a shard beside each rank on its node (a rank's traffic to its own
    shard stays on the node); else the shards on nodes of their own."""
    w = len(pushes)
    if w == 0 or len(pulls) != w:
        raise ValueError(f"one push and one pull figure per rank expected, got {len(pushes)} "
                         f"and {len(pulls)}")
    if not colocated:  # each rank's node carries all its traffic; each shard's 1/w of all
        return max(*pushes, *pulls, sum(pushes) / w, sum(pulls) / w)
    out = [push * (w - 1) / w + (sum(pulls) - pull) / w for push, pull in zip(pushes, pulls)]
    into = [pull * (w - 1) / w + (sum(pushes) - push) / w for push, pull in zip(pushes, pulls)]
    return max(*out, *into)


def link_floor(steps: Sequence[tuple[bool, float]], ceiling_step_s: float,
               link_bytes_per_s: float, *, compute_s: float | None = None) -> float:
    """The ceiling's (mean) step over the mean floor of ``steps`` (each: serial, busiest
    direction's bytes), the link at ``link_bytes_per_s``, each step's compute taken as
    ``compute_s`` (default the ceiling's step; the bench passes the ceiling's lower-quartile
    step, so that its step-to-step noise does not put the floor above what a run can do), at
    most 1; 1.0 for no steps."""
    compute_s = ceiling_step_s if compute_s is None else compute_s
    if ceiling_step_s <= 0 or compute_s <= 0 or link_bytes_per_s <= 0:
        raise ValueError(f"ceiling step, compute and link rate must be > 0, got "
                         f"{ceiling_step_s} s, {compute_s} s and {link_bytes_per_s} B/s")
    if not steps:
        return 1.0
    floors = [compute_s + x / link_bytes_per_s if serial
              else max(compute_s, x / link_bytes_per_s) for serial, x in steps]
    return min(1.0, ceiling_step_s * len(floors) / sum(floors))
