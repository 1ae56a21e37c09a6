"""`async-grpo run`: everything on one machine in one command, and a clean stop.

Starts (or joins, with --address) a Ray cluster, the generation / verifier / logprob pools,
then the trainer under torchrun as a child process that joins the same cluster. Output is
streamed; on exit, error or Ctrl-C everything it started is stopped: the torchrun process
group, the pool actors and the Ray head (no orphan raylets, engines or ranks).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from async_grpo.config import RunConfig

HEAD_START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalHead:
    """A private Ray head node in the foreground (`ray start --block`): ending the process
    ends exactly this cluster."""

    def __init__(self, num_cpus: int, object_store_bytes: int) -> None:
        self.port = _free_port()
        self.temp = tempfile.mkdtemp(prefix="agr", dir="/tmp")  # Unix socket paths are short
        ray_bin = str(Path(sys.executable).with_name("ray"))
        self.proc = subprocess.Popen(
            [
                ray_bin,
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--num-cpus={num_cpus}",
                f"--object-store-memory={object_store_bytes}",
                f"--temp-dir={self.temp}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"ray head did not listen on {self.address} within"
                        f" {HEAD_START_TIMEOUT_S:.0f}s"
                    ) from None
                time.sleep(0.5)

    def stop(self) -> None:
        """Kill the whole private cluster at once. A SIGTERM to `ray start --block` took ~33 s
        to wind down processes whose state dies with this run anyway; every process of the
        cluster is in this process group (tests/integration/test_run_interrupt.py)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        shutil.rmtree(self.temp, ignore_errors=True)


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
        "torch.distributed.run",
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
    config_path: str | None,
    overrides: list[str],
    address: str | None,
    resume: str | None,
    verbose: bool = False,
) -> int:
    """The one-command run; returns the trainer's exit code. Quiet unless `verbose`: the
    workers write to OUTPUT_DIR/logs/, whose path is printed if the run fails."""
    import ray

    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.inference import launch
    from async_grpo.logs import log_dir, quiet_libraries
    from async_grpo.models import resolve_model
    from async_grpo.ray_utils import connect

    model_dir = str(resolve_model(cfg.model))
    prepare_prompts(cfg.data, Path(model_dir), cfg.generation.max_model_len)  # fail early
    head: LocalHead | None = None
    workers: list[Any] = []
    trainer: subprocess.Popen | None = None
    logs = None if verbose else log_dir(cfg.output_dir)
    if logs is not None:
        quiet_libraries()
    code = 1
    try:
        if address is None:
            head = LocalHead(num_cpus=16, object_store_bytes=1 << 30)
            address = head.address
            print(f"started a local Ray head at {address}", flush=True)
        connect(address, log_to_driver=verbose)
        device = cfg.trainer.device
        workers += launch.start_verifier_workers(
            cfg.verifier, cfg.verifier.num_workers, log_dir=logs
        )
        if cfg.trainer.loss.kl_coef > 0:
            workers += launch.start_logprob_workers(
                model_dir,
                cfg.logprob,
                cfg.logprob.num_workers,
                device,
                cfg.trainer.loss.temperature,
                log_dir=logs,
            )
        workers += launch.start_generation_workers(
            model_dir, cfg.generation, cfg.generation.num_workers, device, log_dir=logs
        )
        print(
            f"pools up: {len(workers)} workers; starting {cfg.trainer.num_ranks} trainer rank(s)",
            flush=True,
        )
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(cfg.trainer.threads),
            "OMP_WAIT_POLICY": "PASSIVE",
            "RAY_AUTH_MODE": "disabled",
        }
        trainer = subprocess.Popen(
            torchrun_command(cfg, config_path, overrides, address, resume, verbose),
            env=env,
            start_new_session=True,
        )
        code = trainer.wait()
        return code
    except KeyboardInterrupt:
        print("interrupted: stopping the trainer, the pools and Ray", flush=True)
        code = 130
        return code
    finally:
        if code not in (0, 130) and logs is not None and logs.is_dir():
            print(f"the run failed; the workers' logs are in {logs}/", flush=True)
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGTERM)
            try:
                trainer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(trainer.pid, signal.SIGKILL)
                trainer.wait(timeout=30)
        if workers:
            launch.stop_workers(workers, drain_timeout_s=5)
        if ray.is_initialized():
            ray.shutdown()
        if head is not None:
            head.stop()
