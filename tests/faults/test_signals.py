"""Ctrl-C, SIGTERM, SIGHUP or even SIGKILL of `async-grpo run` leaves no process of the
run behind (counted by a tag every process of the run inherits): no raylet, no engine, no
rank; and no file in /dev/shm: the runs push LoRA adapters, so the generation worker serves
them from folders there beside the trainer's weight slots. The first three stop it like
Ctrl-C (exit 128 + the signal); after SIGKILL the watchdog beside the head kills the
head's and the trainer's groups and removes the run's folder in /dev/shm, its own folder in
/tmp and the head's (its logs and sockets). SIGKILL runs by
default; SIGTERM by default stops the run whose workers die (test_pool_faults.py, one sweep
of the run's folder whatever its entries), and here with Ctrl-C and SIGHUP in `-m slow`."""

import signal
import time
from pathlib import Path

import pytest
from _cli import CLI, TINY_KV, wait_for_line
from _faults import (
    assert_all_gone,
    assert_books,
    finish,
    rows,
    run_folders,
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
        out, folders = _signalled(proc, sig, tag, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(folders) == 2, folders  # the head's session and the run's own, in /tmp
    assert proc.returncode == code, out[-4000:]
    assert line in out
    if sig != signal.SIGKILL:  # the stop is said in one line: no launcher traceback, no
        # rank's C++ signal report
        assert "Traceback" not in out and "SIGTERM received" not in out, out[-4000:]
    assert_all_gone(tag, folders=folders)
    took = time.monotonic() - t
    assert took < 120, f"{sig.name}: the run took {took:.0f}s to be gone"
    assert_books(rows(tmp_path))  # the steps it finished closed their books
    print(f"{sig.name}: every process of the run gone {took:.1f}s after it")


@pytest.mark.parametrize(
    "sig, code, line",
    [
        (signal.SIGTERM, 143, "stopped by SIGTERM: stopping the evaluation and Ray"),
        (signal.SIGKILL, -9, ""),
    ],
    ids=["SIGTERM", "SIGKILL"],
)
def test_a_signal_stops_an_evaluation_and_its_cluster(sig, code, line, tiny_model_dir, tmp_path):
    """`async-grpo eval` on its own private Ray head, stopped while its generation worker
    starts: SIGTERM stops it as Ctrl-C does (exit 143, one line); after SIGKILL the same
    watchdog as `run`'s ends the head's processes and removes its folder. Either way no
    process, /dev/shm file or /tmp folder of it is left (it used to leave its whole head)."""
    held_out = Path(__file__).parents[2] / "sample-data" / "arithmetic-heldout.jsonl"
    cmd = [*CLI, "eval", str(tiny_model_dir), "--data", str(held_out)]
    cmd += ["-o", str(tmp_path / "eval"), "--max-questions", "3", "--set", TINY_KV]
    proc, tag = start(cmd, tmp_path)
    try:
        wait_for_line(proc, "evaluating ", 300)
        deadline = time.monotonic() + 120
        while not any(_is_generation_worker(p) for p in run_pids(tag)):
            assert time.monotonic() < deadline, "no generation worker started within 120 s"
            time.sleep(0.2)
        out, folders = _signalled(proc, sig, tag, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(folders) == 1, folders  # the head's session
    assert proc.returncode == code, out[-4000:]
    assert line in out and "Traceback" not in out, out[-4000:]
    assert_all_gone(tag, folders=folders)


def _is_generation_worker(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith("ray::Generation")
    except OSError:
        return False


def _signalled(proc, sig, tag, out_dir):
    """The command's folders in /tmp (read while it runs), then `sig`; its console once it
    ended."""
    folders = run_folders(tag)
    proc.send_signal(sig)
    return finish(proc, out_dir, timeout_s=180), folders
