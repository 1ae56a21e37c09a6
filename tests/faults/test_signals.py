"""Ctrl-C, SIGTERM, SIGHUP or even SIGKILL of `async-grpo run` leaves no process of the
run behind (counted by a tag every process of the run inherits): no raylet, no engine, no
rank; and no file in /dev/shm: the runs push LoRA adapters, so the generation worker serves
them from folders there beside the trainer's weight slots. The first three stop it like
Ctrl-C (exit 128 + the signal); after SIGKILL the watchdog beside the head kills the
head's and the trainer's groups and removes the run's folder in /dev/shm. SIGKILL runs by
default; SIGTERM by default stops the run whose workers die (test_pool_faults.py, one sweep
of the run's folder whatever its entries), and here with Ctrl-C and SIGHUP in `-m slow`."""

import signal
import time
from pathlib import Path

import pytest
from _faults import (
    assert_all_gone,
    assert_books,
    finish,
    rows,
    run_pids,
    start,
    tiny_run,
    wait_for_steps,
)

from async_grpo.shm_files import left

pytestmark = pytest.mark.faults


@pytest.mark.parametrize(
    "sig, code, line",
    [
        pytest.param(  # KeyboardInterrupt, caught where SIGTERM's Stopped(KeyboardInterrupt) is
            signal.SIGINT, 130, "interrupted: stopping", marks=pytest.mark.slow
        ),
        pytest.param(  # by default on the run whose workers die: test_pool_faults.py
            signal.SIGTERM, 143, "stopped by SIGTERM: stopping", marks=pytest.mark.slow
        ),
        pytest.param(  # the SIGTERM handler, another number: kept for the slow run
            signal.SIGHUP, 129, "stopped by SIGHUP: stopping", marks=pytest.mark.slow
        ),
        (signal.SIGKILL, -9, ""),
    ],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else "",
)
def test_a_signal_stops_everything(sig, code, line, tiny_model_dir, tmp_path):
    cmd = tiny_run(
        tiny_model_dir,
        tmp_path,
        "trainer.max_steps=1000",
        "trainer.save_every=0",
        "trainer.lora.rank=8",
    )
    proc, tag = start(cmd, tmp_path)
    try:
        wait_for_steps(proc, tmp_path, 1)
        assert len(run_pids(tag)) >= 6  # the run did start Ray, engines and a rank
        deadline = time.monotonic() + 60  # and served a pushed adapter from /dev/shm
        while not any(Path(e).name.startswith("adapters-") for e in left(tag)):
            assert time.monotonic() < deadline, f"no adapter folder in /dev/shm: {left(tag)}"
            time.sleep(0.2)
        t = time.monotonic()
        proc.send_signal(sig)
        out = finish(proc, tmp_path, timeout_s=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, out[-4000:]
    assert line in out
    if sig != signal.SIGKILL:  # the stop is said in one line: no launcher traceback, no
        # rank's C++ signal report
        assert "Traceback" not in out and "SIGTERM received" not in out, out[-4000:]
    assert_all_gone(tag)
    took = time.monotonic() - t
    assert took < 120, f"{sig.name}: the run took {took:.0f}s to be gone"
    assert_books(rows(tmp_path))  # the steps it finished closed their books
    print(f"{sig.name}: every process of the run gone {took:.1f}s after it")
