"""Helpers of the tests that start the CLI: its argv, a free port, its output lines."""

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "tests" / "integration" / "plugins"  # test rewards, environments, hooks
CLI = [sys.executable, "-m", "async_grpo.cli"]
# the KV cache of an engine of the tiny model (1 KiB a token in fp32): 64k tokens, where
# the configs' 1 to 2 GiB cost each engine start seconds of page faults on a loaded machine
TINY_KV_GIB = 1 / 16
TINY_KV = f"generation.kv_cache_gib={TINY_KV_GIB}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_command(command: str, address: str, env: dict, *extra: str):
    """`async-grpo status|stop --address ADDRESS ...`, run to its end, output captured."""
    import subprocess

    return subprocess.run(
        [*CLI, command, "--address", address, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_command(config: str, *overrides: str) -> list[str]:
    """`python -m async_grpo.cli run configs/<config> <overrides...>`."""
    return [
        sys.executable,
        "-m",
        "async_grpo.cli",
        "run",
        str(REPO / "configs" / config),
        *overrides,
    ]


def wait_for_line(proc, text, timeout_s=180):
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and proc.poll() is None:
        seen.append(proc.stdout.readline())
        if text in seen[-1]:
            return
    raise AssertionError(f"no line {text!r} from the worker command: {''.join(seen)[-3000:]}")


def plugin_env() -> dict[str, str]:
    """This environment with the test reward plugins (tests/integration/plugins) importable."""
    path = f"{PLUGINS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "PYTHONPATH": path}


def loop_command(model_dir: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """The whole-loop run of the integration and fault tests: 2 gloo ranks, KL on (a
    log-prob worker), one group of 6 a step, on-policy, checkpoints every 3 steps, a
    reward with variance even for a tiny random model (`extra` overrides any of it)."""
    return run_command(
        "quickstart.yaml",
        f"model={model_dir}",
        f"output_dir={out}",
        f"trainer.max_steps={steps}",
        "trainer.num_ranks=2",
        "trainer.lr=1e-3",
        "trainer.loss.kl_coef=0.01",
        "batcher.questions_per_step=1",
        "batcher.samples_per_question=6",
        "batcher.max_off_policy_steps=0",
        "batcher.max_tokens_per_gpu=512",
        "generation.max_model_len=512",
        "generation.max_new_tokens=24",
        "generation.dtype=float32",
        TINY_KV,
        "trainer.save_every=3",
        "verifier.rewards=[rewards_for_tests:vowel_share]",
        *extra,
    )


def run_loop(
    model_dir: Path,
    out: Path,
    steps: int,
    *extra: str,
    cores: dict | None = None,
    env: dict[str, str] | None = None,
    watch: Callable[[], None] | None = None,
) -> list[dict]:
    """`loop_command` run to its end (exit 0 asserted); its console kept in
    out/console.txt; returns its metrics rows. With `cores`, it is filled while the run
    trains (from its first metrics row on) with the cores each of the run's processes may
    use, read from outside (`process_cores`). `env`: more environment for the run (faults
    to inject, its id); `watch()` is called every 0.2 s while it runs."""
    import json
    import subprocess

    cmd = loop_command(model_dir, out, steps, *extra)
    console = out.parent / f"{out.name}-console.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    with console.open("w") as f:
        proc = subprocess.Popen(
            cmd, env={**plugin_env(), **(env or {})}, stdout=f, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 900
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the whole-loop run did not end in 900 s"
            if cores is not None and (out / "training_metrics.jsonl").exists():
                for role, seen in process_cores(proc.pid).items():
                    cores.setdefault(role, set()).update(seen)
            if watch is not None:
                watch()
            time.sleep(0.2)
    text = console.read_text()
    assert proc.returncode == 0, text[-6000:]
    (out / "console.txt").write_text(text)
    return [json.loads(line) for line in (out / "training_metrics.jsonl").read_text().splitlines()]


ROLES = {  # a process of a run, by its command line
    "generation": lambda cmd: cmd[0].startswith("ray::GenerationWorker"),
    "logprob": lambda cmd: cmd[0].startswith("ray::LogprobWorker"),
    # a rank: torchrun starts `python -u -m async_grpo.cli train ...` (its agent runs the
    # launcher module)
    "trainer": lambda cmd: "async_grpo.cli" in cmd and "train" in cmd and "-u" in cmd,
}


def process_cores(pid: int) -> dict[str, set[tuple[int, ...]]]:
    """For each role of `ROLES`: the core sets its live processes under `pid` may run on
    (each thread's affinity, joined per process)."""
    import psutil

    from async_grpo.placement import process_cpus

    found: dict[str, set[tuple[int, ...]]] = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = p.cmdline()
            role = next((r for r, match in ROLES.items() if cmd and match(cmd)), None)
            if role:
                found.setdefault(role, set()).add(tuple(sorted(process_cpus(p.pid))))
        except (psutil.Error, FileNotFoundError, ProcessLookupError):  # gone meanwhile
            continue
    return found


# `loop_command` overrides for a run one step off-policy: 2 groups a step, one at a time in
# the engine (its batch stays the same from run to run), drawn by a curriculum
ASYNC = (
    "batcher.questions_per_step=2",
    "batcher.max_off_policy_steps=1",
    "generation.max_concurrent_seqs=6",
    "batcher.curriculum=true",
)
