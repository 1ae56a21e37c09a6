"""The generation pool's busy fraction: a worker's clock and the batcher's windows."""

import pytest

from async_grpo.batcher.stats import PoolClock
from async_grpo.inference import worker_base
from async_grpo.inference.worker_base import BusyClock


@pytest.fixture
def now(monkeypatch):
    t = [100.0]
    monkeypatch.setattr(worker_base.time, "monotonic", lambda: t[0])
    return t


def test_a_clock_counts_time_with_requests_and_not_paused(now):
    clock = BusyClock()
    now[0] += 5  # idle
    clock.enter()
    now[0] += 2
    clock.enter()  # a second request overlaps the first: counted once
    now[0] += 1
    clock.leave()
    now[0] += 1
    clock.pause(True)  # a weight update: requests frozen, nothing generated
    now[0] += 4
    clock.pause(False)
    now[0] += 1
    assert clock.read() == (5.0, 14.0)  # 2 + 1 + 1 + 1 busy, of 14 up
    clock.leave()
    now[0] += 3
    assert clock.read() == (5.0, 17.0)


def test_windows_start_at_the_first_reading_and_follow_workers_that_come_and_go():
    books = PoolClock()
    assert books.add([{"worker_id": "a", "busy_s": 10.0, "up_s": 40.0}]) == {}  # start-up
    out = books.add([{"worker_id": "a", "busy_s": 19.0, "up_s": 50.0}])
    assert out == {
        "pool/generation/busy_fraction": 0.9,
        "pool/generation/busy_fraction_run": 0.9,
    }
    # "b" joined inside the window (counted from its start); "a" died (its window is lost)
    out = books.add([{"worker_id": "b", "busy_s": 1.0, "up_s": 10.0}])
    assert out["pool/generation/busy_fraction"] == 0.1
    assert out["pool/generation/busy_fraction_run"] == pytest.approx(10 / 20)
    assert books.add([]) == {"pool/generation/busy_fraction_run": pytest.approx(0.5)}
