"""`async-grpo run`: everything on one machine in one command, and a clean stop.

Starts (or joins, with --address) a Ray cluster, then the generation / verifier / logprob
pools and the trainer under torchrun side by side (a child process that joins the same
cluster and waits for the pools before it uses them). Output is streamed; on exit, error or
Ctrl-C everything it started is stopped: the torchrun process group, the pool actors, the
Ray head and the run's files in /dev/shm (weight slots, adapter folders: shm_files.py), so
no orphan raylet, engine, rank or file is left. A run that fails ends with one cause line,
the first one recorded (cause.py), and where the workers' logs are.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_grpo.cause import CAUSE_FILE_ENV
from async_grpo.cause import record as record_cause
from async_grpo.cause import recorded as recorded_cause
from async_grpo.config import RunConfig
from async_grpo.errors import EXIT_FILE_ENV
from async_grpo.local_head import LocalHead
from async_grpo.shm_files import RUN_ID_ENV, remove_orphans, remove_run

POOL_ORDER = (
    "verifier",
    "environment",
    "reward_model",
    "logprob",
    "judge",
    "generation",
)  # quickest to start first
# `async-grpo run` starts its ranks while its pools start; a rank waits for this file
POOLS_READY_ENV = "ASYNC_GRPO_POOLS_READY"
POOLS_READY_TIMEOUT_S = 1800.0  # longer than any pool's start timeout: the run gives up first


def wait_for_pools(timeout_s: float = POOLS_READY_TIMEOUT_S) -> None:
    """In a rank started by `async-grpo run`: wait until the run's pools are up (no wait
    for a rank started by hand, whose pools were started before it)."""
    ready = os.environ.get(POOLS_READY_ENV)
    if not ready:
        return
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pools of `async-grpo run` were not up within {timeout_s:.0f}s")
        time.sleep(0.2)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP: the run stops as on Ctrl-C, exit code 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_SIGNALLED: list[int] = []  # the stop signals this process received, in order


def stop_on_signal(signum: int, frame: Any) -> None:
    _SIGNALLED.append(signum)
    raise Stopped(signum)


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP stop this command as Ctrl-C does (`Stopped`). Main thread only;
    set again after `ray.init`, which installs handlers of its own."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_on_signal)


def ignore_stop_signals() -> None:
    """A command's clean-up runs undisturbed by a second Ctrl-C, SIGTERM or SIGHUP
    (SIGKILL still ends it: the watchdog then cleans up)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def stopped_by(e: KeyboardInterrupt) -> int:
    """The signal `e` stands for: a `Stopped`'s; else the last SIGTERM or SIGHUP received
    (inside a Ray wait, Ray raises a plain KeyboardInterrupt for our handler's exception);
    else SIGINT (Ctrl-C)."""
    if isinstance(e, Stopped):
        return e.signum
    return _SIGNALLED[-1] if _SIGNALLED else int(signal.SIGINT)


# Started beside the head: holds the read end of a pipe from `run`. When `run` ends in any
# way (SIGKILL included) the pipe closes, and it kills the processes `run` named with all
# their descendants (torchrun starts its ranks in sessions of their own), then their groups,
# then removes the folders `run` named (its own in /tmp, the head's) and its /dev/shm files.
WATCHDOG = """
import os, shutil, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
roots, folders = set(), []
for line in sys.stdin:
    line = line.strip()
    if line == "done":  # `run` stopped them itself: kill nothing (pids get reused)
        sys.exit(0)
    if line.startswith("folder "):
        folders.append(line.removeprefix("folder "))
    else:
        roots.add(int(line))
children = {}
for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    except (ValueError, OSError, IndexError):
        pass
doomed, todo = set(), list(roots)
while todo:
    pid = todo.pop()
    if pid not in doomed:
        doomed.add(pid)
        todo += children.get(pid, [])
for pid in doomed:
    for kill, target in ((os.kill, pid), (os.killpg, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
for folder in folders:
    shutil.rmtree(folder, ignore_errors=True)
# the run's files in /dev/shm (its folder, the semaphores of its killed processes)
from async_grpo.shm_files import remove_run
remove_run(sys.argv[1], since=float(sys.argv[2]))
"""


class Watchdog:
    """Kills the named processes, their descendants and their groups once this process is
    gone, however it ended, then removes the named folders and the files of run `run_id`
    (started at `since`) in /dev/shm (shm_files.remove_run)."""

    def __init__(self, run_id: str, since: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, run_id, str(since)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal does not reach it
        )

    def guard(self, pgid: int) -> None:
        self.proc.stdin.write(f"{pgid}\n".encode())
        self.proc.stdin.flush()

    def remove(self, folder: str | Path) -> None:
        """`folder` goes too if this process is killed (else it removes it itself)."""
        self.proc.stdin.write(f"folder {folder}\n".encode())
        self.proc.stdin.flush()

    def private_head(self, object_store_bytes: int, log_monitor: bool) -> LocalHead:
        """A private Ray head (`run`'s, `eval`'s) whose processes and session folder this
        watchdog ends if this process is killed."""
        head = LocalHead(
            num_cpus=16, object_store_bytes=object_store_bytes, log_monitor=log_monitor
        )
        self.guard(head.proc.pid)
        self.remove(head.temp)  # the head's session: its logs and sockets
        return head

    def close(self) -> None:
        """This process is stopping the groups itself; the watchdog exits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.write(b"done\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _pools_started(starting: dict[str, Any], trainer: subprocess.Popen) -> bool:
    """Wait for each pool's workers to start; False if the trainer ended first (its exit
    code is then the run's). A pool that fails or times out raises, naming itself."""
    for pool, pending in starting.items():
        deadline = time.monotonic() + pending.timeout_s
        while not pending.done(timeout_s=1.0):
            if trainer.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pool} workers did not start within {pending.timeout_s:.0f}s")
        pending.wait(timeout_s=1.0)  # raises a worker's start error; registers the workers
    return trainer.poll() is None


def _trainer_died(
    code: int, exit_file: Path, output_dir: str, config_path: str | None, overrides: list[str]
) -> str:
    """The one line for a trainer that failed: its cause (what the failing rank said, or
    how the launcher saw it end) and, only where a checkpoint exists, how to continue."""
    from async_grpo.launcher import cause_path, first_rank_cause

    cause = cause_path(exit_file)  # the launcher's pick (not under --verbose)
    why = cause.read_text().strip() if cause.is_file() else first_rank_cause(cause)
    line = f"the trainer died (exit code {code}): {why or 'no cause recorded'}"
    if (Path(output_dir) / "checkpoints" / "latest").is_file():
        again = " ".join(["async-grpo run", config_path or "CONFIG", *overrides, "--resume"])
        line += f"; its checkpoints are kept, continue from the last one with: {again}"
    return line


def torchrun_command(
    cfg: RunConfig,
    config_path: str | None,
    overrides: list[str],
    address: str,
    resume: str | None,
    verbose: bool = False,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run" if verbose else "async_grpo.launcher",
        "--standalone",
        f"--nproc-per-node={cfg.trainer.num_ranks}",
        "-m",
        "async_grpo.cli",
        "train",
    ]
    if config_path:
        cmd.append(config_path)
    cmd += [*overrides, "--address", address]
    if resume:
        cmd += ["--resume", resume]
    if verbose:
        cmd.append("--verbose")
    return cmd


def run_local(
    cfg: RunConfig,
    model_dir: str,
    config_path: str | None,
    overrides: list[str],
    address: str | None,
    resume: str | None,
    verbose: bool = False,
) -> int:
    """The one-command run of a config `preflight.checked_before_ray` passed (`model_dir`,
    the model's folder); returns the trainer's exit code. Quiet unless `verbose`: the
    workers write to OUTPUT_DIR/logs/, whose path is printed if the run fails."""
    import ray

    from async_grpo import pools
    from async_grpo.inference.supervisor import PoolSupervisor, RestartLimit, pool_subject
    from async_grpo.logs import log_dir, quiet_libraries, ray_errors_to_file
    from async_grpo.ray_utils import connect

    head: LocalHead | None = None
    started = time.time()  # the run's semaphores in /dev/shm are those made since
    given_id = os.environ.get(RUN_ID_ENV)
    run_id = given_id or uuid.uuid4().hex[:8]  # a test may name it
    os.environ[RUN_ID_ENV] = run_id  # the head and every actor started here inherit it
    # a `run` killed outright leaves no head, no ranks and no files in /dev/shm behind
    watchdog = Watchdog(run_id, started)
    # a dead worker's files in /dev/shm are swept when it is replaced
    sweep = functools.partial(remove_orphans, run_id, since=started)
    supervisor = PoolSupervisor(cfg.max_worker_restarts, sweep=sweep)
    workers: list[Any] = []
    trainer: subprocess.Popen | None = None
    logs = None if verbose else log_dir(cfg.output_dir)
    if logs is not None:
        quiet_libraries()
    code = 1
    exit_dir = Path(tempfile.mkdtemp(prefix="async-grpo-run-"))
    watchdog.remove(exit_dir)
    cause_file = exit_dir / "cause"  # the first cause recorded, printed at the end
    try:
        if address is None:
            # one that cannot start raises MachineError: cli prints its line once all stopped
            head = watchdog.private_head(1 << 30, log_monitor=verbose)
            address = head.address
            print(f"started a local Ray head at {address}", flush=True)
        connect(address, log_to_driver=verbose, tries=3 if head is not None else 1)
        if logs is not None:  # Ray's "(raylet) A worker died ..." lines: not on the console
            ray_errors_to_file(logs / "ray.log")
        if threading.current_thread() is threading.main_thread():  # ray.init set its own
            stop_on_signals()
        starters, counts = pool_starters(cfg, model_dir, logs)
        # the pools and the trainer start side by side: a rank loads its model while the
        # engines start, and waits for POOLS_READY before it asks the pools for anything.
        # The slowest pool starts first (the engine is the run's longest start), the waits
        # go quickest first (a pool that cannot start is named as soon as it fails)
        begun = {p: starters[p](counts[p]) for p in reversed(POOL_ORDER) if p in starters}
        starting = {pool: begun[pool] for pool in POOL_ORDER if pool in begun}
        print(
            f"starting {sum(counts.values())} pool workers and {cfg.trainer.num_ranks}"
            " trainer rank(s)",
            flush=True,
        )
        exit_file, ready_file = exit_dir / "trainer_exit", exit_dir / "pools_ready"
        trainer = subprocess.Popen(
            torchrun_command(cfg, config_path, overrides, address, resume, verbose),
            env=trainer_env(cfg, exit_file, ready_file, run_id, verbose, cause_file),
            start_new_session=True,
        )
        watchdog.guard(trainer.pid)
        workers = [w for pending in starting.values() for w in pending.workers]
        if _pools_started(starting, trainer):
            for pool, pending in starting.items():
                supervisor.watch(
                    pool,
                    pending.workers,
                    lambda s=starters[pool]: s(1).wait(),
                    pool_subject(cfg, pool),
                )
            ready_file.write_text(f"{len(workers)}\n")
        while (code := trainer.poll()) is None:
            time.sleep(1.0)
            for line in supervisor.check():  # dead pool workers are replaced
                print(line, flush=True)
        if code and exit_file.is_file():  # a rank stopped on a user error (its line recorded)
            code = int(exit_file.read_text())
        if code not in (0, 2):
            print(
                _trainer_died(code, exit_file, cfg.output_dir, config_path, overrides), flush=True
            )
        return code
    except RestartLimit as e:  # a pool cannot work: the run's cause, unless one came first
        record_cause(str(e), cause_file)
        code = 1
        return code
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (`stopped_by`)
        signum = stopped_by(e)
        if signum == signal.SIGINT:
            print("interrupted: stopping the trainer, the pools and Ray", flush=True)
        else:
            name = signal.Signals(signum).name
            print(f"stopped by {name}: stopping the trainer, the pools and Ray", flush=True)
        code = 128 + signum
        return code
    finally:
        if threading.current_thread() is threading.main_thread():
            ignore_stop_signals()
        if trainer is not None:
            stop_trainer(trainer)
        workers = supervisor.workers or workers
        # a run that ended well on its own head: ending the head ends its workers at once
        # (about 5 s sooner), and every file they leave in /dev/shm is removed below
        if workers and (head is None or code != 0):
            pools.stop_workers(workers, drain_timeout_s=5)
        if ray.is_initialized():
            ray.shutdown()
        if head is not None:
            head.stop()
        remove_run(run_id, since=started)  # weight slots, adapter folders, semaphores
        watchdog.close()
        if code not in (0, 130, 143, 129):  # the last lines, once everything has stopped
            if cause := recorded_cause(cause_file):
                print(cause, flush=True)
            if logs is not None and logs.is_dir():
                print(f"the run failed; the workers' logs are in {logs}/", flush=True)
        elif code == 0:
            from async_grpo.metrics import summary_line

            print(summary_line(cfg.output_dir, time.time() - started), flush=True)
        shutil.rmtree(exit_dir, ignore_errors=True)
        if given_id is None:
            del os.environ[RUN_ID_ENV]


def pool_starters(
    cfg: RunConfig, model_dir: str, logs: Path | None
) -> tuple[dict[str, Callable[[int], Any]], dict[str, int]]:
    """For each pool the run needs: what starts n of its workers, and how many it starts."""
    from async_grpo import pools

    device = cfg.trainer.device
    starters: dict[str, Callable[[int], Any]] = {
        "generation": lambda n: pools.begin_generation_workers(
            model_dir,
            cfg.generation,
            n,
            device,
            log_dir=logs,
            adapters=pools.serving_adapters(cfg),
        ),  # fmt: skip
    }
    counts = {"generation": cfg.generation.num_workers}
    if cfg.environment.harness:  # a harness scores its rollouts in the batcher
        pass
    elif cfg.environment.name is None:  # single-turn: the verifiers and reward models score
        if cfg.verifier.rewards or (cfg.eval.data and cfg.eval.rewards):  # rules score
            starters["verifier"] = lambda n: pools.begin_verifier_workers(
                cfg.verifier, n, log_dir=logs
            )
            counts["verifier"] = cfg.verifier.num_workers
        starters |= pools.model_reward_starters(cfg, logs)
        counts |= {name: getattr(cfg.verifier, name).num_workers for name in cfg.verifier.models}
    else:  # multi-turn: the environments score
        starters["environment"] = lambda n: pools.begin_environment_workers(
            cfg.environment, n, log_dir=logs
        )
        counts["environment"] = cfg.environment.num_workers
    if cfg.reference == "logprob_pool":
        starters["logprob"] = lambda n: pools.begin_logprob_workers(
            model_dir, cfg.logprob, n, device, cfg.trainer.loss.temperature, log_dir=logs
        )
        counts["logprob"] = cfg.logprob.num_workers
    return starters, counts


def trainer_env(
    cfg: RunConfig,
    exit_file: Path,
    ready_file: Path,
    run_id: str,
    verbose: bool,
    cause_file: Path | None = None,
) -> dict[str, str]:
    """The torchrun ranks' environment: where to leave their exit code and a cause line,
    when the pools are ready, the run's id (its files in /dev/shm), their threads."""
    env = {
        **os.environ,
        EXIT_FILE_ENV: str(exit_file),
        CAUSE_FILE_ENV: str(cause_file or exit_file.with_name("cause")),
        POOLS_READY_ENV: str(ready_file),
        RUN_ID_ENV: run_id,
        "OMP_NUM_THREADS": str(cfg.trainer.threads),
        "OMP_WAIT_POLICY": "PASSIVE",
        "RAY_AUTH_MODE": "disabled",
    }
    if not verbose:  # a rank stopped by SIGTERM ends quietly (Ray's handler prints a C++
        # stack report for it); a real crash still prints Python's stacks (faulthandler)
        env |= {"RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1", "PYTHONFAULTHANDLER": "1"}
    return env


def stop_trainer(trainer: subprocess.Popen) -> None:
    """SIGTERM to the ranks' process group, SIGKILL if they are not gone within 30 s."""
    if trainer.poll() is not None:
        return
    os.killpg(trainer.pid, signal.SIGTERM)
    try:
        trainer.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
