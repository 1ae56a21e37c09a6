"""Score samples in long-lived subprocesses that are SIGKILLed at a hard wall-clock timeout.

Model output is untrusted: a reward may hang, blow up memory or crash on it. Each
`SandboxPool` keeps `num_procs` Python subprocesses (`python -c` running `_child_main`,
a socketpair each, pickled messages) that score one sample at a time:

- a reply later than `timeout_s` -> the process is SIGKILLed and replaced; reward 0, "timeout";
- an exception in the reward, or the process dying mid-sample -> reward 0, "error: ...";
- a process found dead while idle (killed from outside) is replaced before use; so is one
  that dies before it takes the sample sent to it (each child says "taken" on reading a
  sample, before scoring it), and the sample goes to the replacement: a kill that lands
  just before a send is not the sample's fault. Only a death after "taken" costs it.

Why not a process per sample: starting Python and importing sympy/math-verify costs
~0.5 s, against ~0.1-0.3 ms per sample over a warm process's pipe (docs/rewards.md).
Why not multiprocessing: its spawn/forkserver children re-import the parent's
`__main__` (inside a Ray actor: Ray's worker script, and Ray with it).
Children get `RLIMIT_AS` (2 GiB) and die with the thread that started them (PDEATHSIG),
so an actor's death cannot orphan them. This is process isolation for runaway
computation, not a security boundary: nothing here executes model output.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import pickle
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from async_grpo.rewards.registry import RewardInput, RewardOutput, as_output

ScoreFn = Callable[[RewardInput], "RewardOutput | float"]
DEFAULT_MEMORY_BYTES = 2 * 1024**3
_PR_SET_PDEATHSIG = 1
_log = logging.getLogger(__name__)


class SandboxError(RuntimeError):
    """A scoring subprocess could not start or load its reward function."""


class _Worker:
    """One scoring subprocess and the parent's end of its socketpair.

    Constructed on the pool's spawner thread (PDEATHSIG ties the child to the thread that
    forked it, so that thread must outlive the child), then `wait_ready` in any thread.
    """

    def __init__(self, score_fn: ScoreFn, memory_bytes: int) -> None:
        self.conn, child = Pipe(duplex=True)
        path = [p or os.getcwd() for p in sys.path]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
        args = f"{child.fileno()}, {memory_bytes}, {os.getpid()}"
        code = f"from {__name__} import _child_main; _child_main({args})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(child.fileno(),), env=env
        )
        child.close()
        try:
            self.conn.send(score_fn)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            self.kill()
            raise SandboxError(
                f"reward function {score_fn!r} cannot be sent to a subprocess ({e}); "
                "define it at module level in an importable module"
            ) from e

    def wait_ready(self, timeout_s: float) -> _Worker:
        """Wait for the child to load the score function; raise SandboxError if it cannot."""
        try:
            if not self.conn.poll(timeout_s):
                raise SandboxError(f"scoring process did not start within {timeout_s} s")
            status, detail = self.conn.recv()
        except (EOFError, OSError) as e:
            self.kill()
            raise SandboxError(f"scoring process died while starting ({e!r})") from e
        except BaseException:
            self.kill()
            raise
        if status != "ready":
            self.kill()
            raise SandboxError(f"scoring process could not load the reward function: {detail}")
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


class SandboxPool:
    """`num_procs` scoring subprocesses for one picklable `score_fn`; thread-safe.

    `score_fn` must be importable by reference (a module-level function or an instance
    of a module-level class), since the subprocess unpickles it by importing its module.
    """

    def __init__(
        self,
        score_fn: ScoreFn,
        num_procs: int,
        timeout_s: float,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        start_timeout_s: float = 60.0,
    ) -> None:
        if num_procs < 1 or timeout_s <= 0:
            raise ValueError(f"need num_procs >= 1 and timeout_s > 0, got {num_procs}, {timeout_s}")
        self.score_fn, self.timeout_s = score_fn, timeout_s
        self.memory_bytes, self.start_timeout_s = memory_bytes, start_timeout_s
        self._counts = {"timeouts": 0, "errors": 0, "scored": 0, "restarts": 0}
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(num_procs, thread_name_prefix="sandbox")
        # The one thread that forks children; it lives until close() (see _Worker).
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="sandbox-spawner")
        launched = self._spawner.submit(
            lambda: [_Worker(score_fn, memory_bytes) for _ in range(num_procs)]
        ).result()
        self._workers: list[_Worker | None] = list(launched)
        try:
            for worker in launched:
                worker.wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self._idle: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(num_procs):
            self._idle.put(slot)

    async def score_many(
        self, samples: list[RewardInput], counted: bool = True
    ) -> list[RewardOutput]:
        """Score `samples` concurrently on the pool, in order; never raises for a sample.
        Not `counted`: left out of `scored`, `timeouts` and `errors` (an evaluation's)."""
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._executor, self.score, s, counted) for s in samples]
        return list(await asyncio.gather(*futures))

    def score(self, sample: RewardInput, counted: bool = True) -> RewardOutput:
        """Score one sample (blocking until a process is free); never raises for a sample."""
        slot = self._idle.get()
        try:
            out, outcome = self._score_on(slot, sample)
        except BaseException:
            self._spawner.submit(self._restart, slot)
            raise
        if outcome == "ok" or (outcome == "errors" and self._alive(slot)):
            self._idle.put(slot)
        else:  # the slot comes back once its replacement process is up
            self._spawner.submit(self._restart, slot)
        if counted:
            with self._lock:
                self._counts["scored"] += 1
                if outcome != "ok":
                    self._counts[outcome] += 1
        return out

    def stats(self) -> dict[str, int]:
        """Counters since start: every sample counts in `scored`; `timeouts` and `errors`
        are the ones that got 0 for those causes; `restarts` counts replaced processes."""
        with self._lock:
            return {f"verifier/{k}": v for k, v in self._counts.items()}

    def close(self) -> None:
        """Kill every scoring process; in-flight samples come back as errors."""
        self._closed = True
        for worker in list(self._workers):  # first, so in-flight samples end now
            if worker is not None:
                worker.kill()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._spawner.shutdown(wait=True, cancel_futures=True)
        for worker in self._workers:  # any replacement started meanwhile
            if worker is not None:
                worker.kill()

    def _alive(self, slot: int) -> bool:
        worker = self._workers[slot]
        return worker is not None and worker.alive()

    def _score_on(self, slot: int, sample: RewardInput) -> tuple[RewardOutput, str]:
        try:
            message = pickle.dumps(sample)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            return RewardOutput(0.0, {}, f"error: sample cannot be pickled ({e})"), "errors"
        for _ in range(2):  # a second process only if the first died before taking it
            if not self._alive(slot):  # killed from outside, or a failed restart
                if self._closed:
                    return RewardOutput(0.0, {}, "error: verifier is shut down"), "errors"
                self._spawner.submit(self._restart, slot, False).result()
                if not self._alive(slot):
                    return RewardOutput(0.0, {}, "error: scoring process failed to start"), "errors"
            worker = self._workers[slot]
            assert worker is not None
            scored = self._exchange(worker, message)
            if scored is not None:
                return scored
        return RewardOutput(0.0, {}, "error: two scoring processes died before taking it"), "errors"

    def _exchange(self, worker: _Worker, message: bytes) -> tuple[RewardOutput, str] | None:
        """Send one pickled sample and wait for its reply; None if the process died before
        it said "taken" (the sample never reached the reward)."""
        deadline = time.monotonic() + self.timeout_s
        taken = False
        try:
            worker.conn.send_bytes(message)
            while worker.conn.poll(max(0.0, deadline - time.monotonic())):
                status, payload = worker.conn.recv()
                if status == "taken":
                    taken = True
                elif status == "ok":
                    return payload, "ok"
                else:
                    return RewardOutput(0.0, {}, f"error: {payload}"), "errors"
        except (EOFError, OSError):
            code = worker.proc.wait()
            if not taken:
                return None
            return RewardOutput(0.0, {}, f"error: scoring process died ({code=})"), "errors"
        worker.kill()  # SIGKILL now, so the sample returns at its timeout
        return RewardOutput(0.0, {}, "timeout"), "timeouts"

    def _restart(self, slot: int, release: bool = True) -> None:
        """Replace the slot's process (runs on the spawner thread); `release`: then put the
        slot back in the idle queue, even if the start failed (its next sample retries)."""
        try:
            old, self._workers[slot] = self._workers[slot], None
            if old is not None:
                old.kill()
            if self._closed:
                return
            with self._lock:
                self._counts["restarts"] += 1
            try:
                self._workers[slot] = _Worker(self.score_fn, self.memory_bytes).wait_ready(
                    self.start_timeout_s
                )
            except SandboxError as e:  # the slot's next sample retries, or counts an error
                _log.warning("sandbox: restarting a scoring process failed: %s", e)
        finally:
            if release:
                self._idle.put(slot)


def _child_main(fd: int, memory_bytes: int, parent_pid: int) -> None:
    """The subprocess: load the score function, then score samples until EOF."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    conn = Connection(fd)
    try:
        score_fn = conn.recv()
    except Exception as e:  # reported to the parent, which raises SandboxError
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            sample = conn.recv()
        except EOFError:
            return
        conn.send(("taken", None))  # what dies from here on died on this sample
        try:
            reply = ("ok", as_output(score_fn(sample)))
        except Exception as e:  # counted by the parent as verifier/errors
            reply = ("error", f"{type(e).__name__}: {str(e)[:300]}")
        conn.send(reply)
