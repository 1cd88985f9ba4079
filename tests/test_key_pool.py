"""``native.keypool.KeyPool``: a push's keys on several threads give the same bits as on one, an
error in one key's work is raised after the others finished, and the helper threads end."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bitps.bench.kernels import CASES, _Pusher
from bitps.native.keypool import MIN_SPLIT_BYTES, KeyPool

_N = 1 << 18  # 1 MiB keys: a message of 4 is spread over the threads


@pytest.mark.parametrize("name", ["adam, async, raw -> raw", "adam, sync, raw -> raw",
                                  "adam, async, sign1 -> sign1", "1-bit Adam, sync",
                                  "1-bit Adam, async, worker moments"])
def test_two_threads_update_every_key_as_one_does(name):
    case = next(c for c in CASES if c.name == name)
    one, two = _Pusher(case, 4, _N, threads=1), _Pusher(case, 4, _N, threads=2)
    assert two.core.key_pool.threads == 2
    seen = set()
    original = two.core.updates.on_arrival, two.core.updates.aggregate

    def note(fn):
        def wrapped(*args, **kwargs):
            seen.add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return wrapped

    two.core.updates.on_arrival, two.core.updates.aggregate = map(note, original)
    for _ in range(3):
        one.push()
        two.push()
    assert len(seen) == 2  # the data loop's thread and a helper both updated keys
    assert one.core.updates_applied == two.core.updates_applied
    for key, a in one.core.slots.items():
        b = two.core.slots[key]
        assert a.version == b.version
        np.testing.assert_array_equal(a.param, b.param)
        if a.publisher is not None:
            np.testing.assert_array_equal(a.publisher.server.residual,
                                          b.publisher.server.residual)
            assert a.publisher.history[-1] == b.publisher.history[-1]


def test_small_messages_stay_on_the_calling_thread():
    pool = KeyPool(2)
    where = []
    pool.map(lambda i: where.append(threading.current_thread()), range(4), MIN_SPLIT_BYTES - 1)
    assert set(where) == {threading.current_thread()}
    pool.close()


def test_an_error_is_raised_after_every_other_key_ran():
    pool = KeyPool(3)
    done = []

    def work(i):
        if i == 4:
            raise ValueError("key 4")
        done.append(i)

    with pytest.raises(ValueError, match="key 4"):
        pool.map(work, list(range(9)), MIN_SPLIT_BYTES)
    assert sorted(done) == [0, 1, 2, 3, 5, 6, 7, 8]
    pool.close()


def test_close_ends_the_helper_threads():
    before = {t.name for t in threading.enumerate()}
    pool = KeyPool(3)
    pool.map(lambda i: None, range(6), MIN_SPLIT_BYTES)
    assert any(t.name.startswith("bitps-keys") for t in threading.enumerate())
    pool.close()
    assert {t.name for t in threading.enumerate()} <= before


def test_zero_threads_means_one_per_core():
    import os

    pool = KeyPool(0)
    assert pool.threads == len(os.sched_getaffinity(0))
    pool.close()
