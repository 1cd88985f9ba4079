"""The typed errors of pipeline planning: a refused schedule, a plan that deadlocks, an unknown
schedule name, a partition that cannot be made, a parallel config that does not add up.

All are ``ValueError`` subclasses (the caller's input is wrong) and carry the values they name,
so a launcher can report them before any process starts.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ConfigError", "DeadlockError", "PartitionError", "PlanError", "UnknownScheduleError"]


class PlanError(ValueError):
    """A schedule refuses (or cannot complete) ``p`` stages with ``m`` micro-batches per step.

    ``schedule`` is the schedule's registered name, ``reason`` says why in words.
    """

    def __init__(self, reason: str, *, schedule: str, p: int, m: int) -> None:
        self.reason = reason
        self.schedule = schedule
        self.p = p
        self.m = m
        super().__init__(f"pipeline schedule {schedule!r} refuses p={p} stages with m={m} "
                         f"micro-batches per step: {reason}")


class DeadlockError(PlanError):
    """No stage can progress: ``stage`` waits forever at ``action`` (index ``index`` of its
    list), for a message its peer never sends or sends only after waiting on this stage."""

    def __init__(self, reason: str, *, schedule: str, p: int, m: int, stage: int, action: str,
                 index: int) -> None:
        self.stage = stage
        self.action = action
        self.index = index
        super().__init__(f"deadlock: stage {stage} waits forever at {action} (action {index} "
                         f"of its list); {reason}", schedule=schedule, p=p, m=m)


class UnknownScheduleError(ValueError):
    """A schedule name that is not registered; ``choices`` lists the registered ones."""

    def __init__(self, name: object, choices: Sequence[str]) -> None:
        self.name = name
        self.choices = tuple(choices)
        super().__init__(f"unknown pipeline schedule {name!r}; expected one of "
                         f"{', '.join(self.choices)}")


class PartitionError(ValueError):
    """``parts`` contiguous stages cannot be cut from ``layers`` layer costs."""

    def __init__(self, reason: str, *, layers: int, parts: int) -> None:
        self.layers = layers
        self.parts = parts
        super().__init__(f"cannot partition {layers} layers into {parts} stages: {reason}")


class ConfigError(ValueError):
    """A parallel configuration value that is inconsistent: ``field`` received ``value``;
    the message says what was expected."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"parallel config {field}={value!r}: expected {expected}")
