"""How `async-grpo run` starts and cleans up, in pieces: the engine's process layout, the
ranks' wait for the pools, the run's files in /dev/shm."""

import ctypes
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from async_grpo.config import GenerationConfig
from async_grpo.inference.engine_args import cpu_kv_cache_args, forked_engine_core, vllm_env
from async_grpo.run import POOLS_READY_ENV, wait_for_pools
from async_grpo.shm_files import (
    RUN_ID_ENV,
    left,
    new_entry,
    remove_orphan_semaphores,
    remove_orphans,
    remove_run,
)
from async_grpo.transports.shm import SharedSlots


def test_unbound_engines_run_the_model_in_the_engine_core(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = vllm_env(GenerationConfig(threads=2), "cpu")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # vLLM binds in its worker only
    assert vllm_env(GenerationConfig(), "cpu")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_env(GenerationConfig(), "cuda")


def test_the_engine_gets_the_kv_cache_it_was_given(tiny_model_dir, monkeypatch):
    """`generation.kv_cache_gib` reaches vLLM's own config exactly, in bytes: not rounded to
    whole GiB (0.25 was 1 GiB), and not overridden by a `VLLM_CPU_KVCACHE_SPACE` that the
    user's shell set (vLLM's variable wins over its argument)."""
    from vllm import AsyncEngineArgs

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    kv = cpu_kv_cache_args(GenerationConfig(kv_cache_gib=0.25), "cpu")
    args = AsyncEngineArgs(model=str(tiny_model_dir), max_model_len=256, enforce_eager=True, **kv)
    config = args.create_engine_config()  # what the engine core gets, the platform's changes in
    assert config.cache_config.kv_cache_memory_bytes == 1 << 28
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    assert cpu_kv_cache_args(GenerationConfig(), "cuda") == {}  # GPUs: memory utilisation


def _child_view(ctx, fd: int) -> str:
    """In a child of `ctx`: whether the socket at `fd` is still open there (the number may
    be taken again: multiprocessing opens /dev/null), the child's name and the signal it
    gets when its parent ends."""
    inode = os.fstat(fd).st_ino

    def look(w):
        try:
            state = "open" if os.fstat(fd).st_ino == inode else "closed"
        except OSError:
            state = "closed"
        dies_with = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(dies_with), 0, 0, 0)  # PR_GET_PDEATHSIG
        comm = Path("/proc/self/comm").read_text().strip()
        os.write(w, f"{state} {comm} {dies_with.value}".encode())

    r, w = os.pipe()
    child = ctx.Process(target=look, args=(w,))
    child.start()
    child.join(30)
    os.close(w)
    seen = os.read(r, 200).decode()
    os.close(r)
    return seen


def test_a_cpu_engine_core_is_forked_and_closes_the_workers_sockets():
    """vLLM spawns its engine core in a Ray actor, importing vLLM again; on CPU the worker
    forks it instead (docs/engine-processes.md). The patch is on the name vLLM's process
    manager calls: if vLLM renames it, this fails rather than the fork silently ending.
    The child closes the sockets the worker had open (Ray's), takes vLLM's name and is
    SIGKILLed by the kernel when the worker ends."""
    import inspect

    import ray._raylet  # noqa: F401  (Ray's own retitle, as in an actor)
    import vllm.v1.engine.utils as engine_utils

    assert "get_mp_context()" in inspect.getsource(engine_utils.CoreEngineProcManager.__init__)
    vllms = engine_utils.get_mp_context  # spawn in a Ray actor
    with socket.socket() as ray_like:
        with forked_engine_core("cpu"):
            ctx = engine_utils.get_mp_context()
            assert ctx.get_start_method() == "fork"
            seen = _child_view(ctx, ray_like.fileno())
            assert seen == f"closed VLLM::EngineCor {int(signal.SIGKILL)}"
        assert engine_utils.get_mp_context is vllms
        # after the engine's start, the hook is idle: other forks keep their sockets
        fork = multiprocessing.get_context("fork")
        seen = _child_view(fork, ray_like.fileno())
        assert seen.startswith("open ") and seen.endswith(" 0"), seen
        with forked_engine_core("cuda"):
            assert engine_utils.get_mp_context is vllms


def test_a_rank_started_by_hand_does_not_wait(monkeypatch):
    monkeypatch.delenv(POOLS_READY_ENV, raising=False)
    t = time.monotonic()
    wait_for_pools(timeout_s=5)
    assert time.monotonic() - t < 1


def test_a_rank_of_run_waits_for_the_pools_then_goes_on(monkeypatch, tmp_path):
    ready = tmp_path / "pools_ready"
    monkeypatch.setenv(POOLS_READY_ENV, str(ready))
    threading.Timer(0.5, ready.write_text, ("3\n",)).start()
    t = time.monotonic()
    wait_for_pools(timeout_s=30)
    assert 0.4 < time.monotonic() - t < 10


def test_pools_that_never_come_up_end_the_wait_naming_them(monkeypatch, tmp_path):
    monkeypatch.setenv(POOLS_READY_ENV, str(tmp_path / "never"))
    with pytest.raises(TimeoutError, match="pools of `async-grpo run` were not up within 1s"):
        wait_for_pools(timeout_s=1)


def test_a_run_removes_its_files_and_only_those(monkeypatch, tmp_path):
    """Weight slots and adapter folders of a run lie in its folder; one sweep removes them
    all, and nothing of another run or of a process outside any run."""
    monkeypatch.setenv(RUN_ID_ENV, "run1")
    mine = SharedSlots(1024, directory=str(tmp_path))
    adapters = Path(new_entry("adapters-gen-1", str(tmp_path)))
    (adapters / "v1-1").mkdir(parents=True)
    monkeypatch.setenv(RUN_ID_ENV, "run2")
    other = SharedSlots(1024, directory=str(tmp_path))
    monkeypatch.delenv(RUN_ID_ENV)
    alone = SharedSlots(1024, directory=str(tmp_path))  # a trainer started by hand
    assert Path(mine.path).parent == adapters.parent == tmp_path / "async-grpo-run-run1"
    assert Path(alone.path).name.startswith(f"async-grpo-weights-{os.getpid()}-")
    assert remove_run("run1", str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["async-grpo-run-run2", Path(alone.path).name]
    )
    other.close()
    alone.close()


def test_a_replaced_workers_files_are_swept_and_the_live_ones_kept(monkeypatch, tmp_path):
    """What the supervisor does when it replaces a dead worker: the entries of the run whose
    process is gone (here a real process, SIGKILLed as the OOM killer does) are removed."""
    make = (
        "import os, sys; from pathlib import Path; from async_grpo.shm_files import new_entry;"
        " p = Path(new_entry('adapters-gen-2', sys.argv[1])); (p / 'v3-1').mkdir(parents=True);"
        " print(p, flush=True); sys.stdin.read()"
    )
    env = {**os.environ, RUN_ID_ENV: "run3"}
    worker = subprocess.Popen(
        [sys.executable, "-c", make, str(tmp_path)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    dead = worker.stdout.readline().strip()
    monkeypatch.setenv(RUN_ID_ENV, "run3")
    live = SharedSlots(1024, directory=str(tmp_path))  # this process: alive
    assert left("run3", str(tmp_path)) == sorted([dead, live.path])
    assert remove_orphans("run3", str(tmp_path)) == []  # both alive
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)
    assert remove_orphans("run3", str(tmp_path)) == [dead]
    assert left("run3", str(tmp_path)) == [live.path]
    live.close()


def test_the_trainer_failure_line_names_the_cause_not_its_consequences(tmp_path):
    """When a rank dies, the others fail on their broken connections and torchrun stops
    the rest with SIGTERM: the line names the rank killed by another signal; failing
    that, the rank that raised first; failing that, torchrun's first failure."""
    import signal
    from types import SimpleNamespace as Failure

    from async_grpo.launcher import failure_cause

    cause = tmp_path / "trainer_exit.cause"
    (cause.parent / f"{cause.name}.rank1").write_text("100.5\tRuntimeError: Connection reset\n")
    killed = {
        0: Failure(exitcode=-signal.SIGKILL, timestamp=101),
        1: Failure(exitcode=1, timestamp=100),
    }
    assert failure_cause(killed, cause) == "trainer rank 0 ended by signal SIGKILL"
    (cause.parent / f"{cause.name}.rank0").write_text("99.0\tValueError: bad batch\n")
    raised = {
        0: Failure(exitcode=1, timestamp=100),
        1: Failure(exitcode=-signal.SIGTERM, timestamp=100),
    }
    assert failure_cause(raised, cause) == "ValueError: bad batch"
    silent = {
        1: Failure(exitcode=3, timestamp=7),
        0: Failure(exitcode=-signal.SIGTERM, timestamp=8),
    }
    assert failure_cause(silent, tmp_path / "none.cause") == "trainer rank 1 ended by exit code 3"


@pytest.mark.parametrize("eval_timeout_s", [600.0, 7200.0])
def test_the_process_group_outlasts_rank_0s_longest_named_wait(eval_timeout_s):
    """Other ranks wait in a collective while rank 0 waits for the batcher, then for an
    evaluation: their group timeout must come after both of rank 0's own (named) limits."""
    from async_grpo.evaluation.hook import COLLECT_SLACK_S
    from async_grpo.preflight.settings import load_config
    from async_grpo.trainer.batcher_link import GET_TIMEOUT_S, group_timeout

    cfg = load_config(None, [f"eval.timeout_s={eval_timeout_s}"])
    rank0 = (GET_TIMEOUT_S + 60) + (eval_timeout_s + COLLECT_SLACK_S)
    assert group_timeout(cfg).total_seconds() > rank0 + 60


def test_semaphores_of_killed_processes_are_swept_and_the_rest_kept():
    """vLLM's engine core holds multiprocessing semaphores (/dev/shm/sem.mp-*), which a
    process killed with its resource tracker cannot unlink. The sweeps remove those made
    since the run started that no live process maps: not one in use, not an older one."""
    import uuid

    hold = (
        "import sys, _multiprocessing; s = _multiprocessing.SemLock(1, 1, 1, sys.argv[1], False);"
        " print('made', flush=True); sys.stdin.read()"
    )

    def semaphore(name: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, "-c", hold, f"/{name}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline() == "made\n"
        return p

    tag = uuid.uuid4().hex[:8]
    old, live, dead = (f"mp-{kind}{tag}" for kind in ("old", "live", "dead"))
    paths = {n: f"/dev/shm/sem.{n}" for n in (old, live, dead)}
    semaphore(old).kill()  # an orphan from before the run
    time.sleep(0.05)
    since = time.time()
    holder, doomed = semaphore(live), semaphore(dead)
    try:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
        removed = remove_orphan_semaphores(since)
        assert paths[dead] in removed and not os.path.exists(paths[dead])
        assert paths[live] not in removed and os.path.exists(paths[live])
        assert paths[old] not in removed and os.path.exists(paths[old])
    finally:
        holder.kill()
        for path in paths.values():
            Path(path).unlink(missing_ok=True)
