"""Where a whole `async-grpo run` spends its CPU: the tests' loop run (the tiny random
model, 2 gloo ranks, KL on, one group of 6 a step, 4 steps), alone, with every process it
starts sampled from /proc every 0.3 s.

    .venv/bin/python bench/run_cpu.py [--steps 4] [--repeats 1] [--out /tmp/run-cpu] [KEY=VALUE ...]

The README's test command is CPU-bound on 2 cores (both busy from start to end), so what a
whole run costs the suite is its CPU seconds, not its wall time. Prints, per repeat, one
JSON line: the wall time, the CPU seconds of all the run's processes, those of each kind of
process (the run command, Ray's own processes, the registries, each pool's workers, the
engine-core process, torchrun and its ranks, the batcher), when each kind first appeared,
and the CPU kind; `--processes` then lists each process with its CPU seconds. `KEY=VALUE` overrides go after the loop run's own (e.g.
`trainer.num_ranks=1`, what one rank fewer saves). Processes that live shorter than a sample are not seen (a few tenths of
a second in all).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "tests" / "integration" / "plugins"  # the tests' vowel-share reward
HZ = os.sysconf("SC_CLK_TCK")

KINDS = (  # (kind, what its name (15 characters) or command line holds), first match wins
    ("engine core", "VLLM::EngineCor"),
    ("generation worker", "ray::Generation"),
    ("log-prob worker", "ray::LogprobWor"),
    ("verifier worker", "ray::VerifierWo"),
    ("batcher", "ray::Experience"),
    ("registries", "ray::LeastLoade"),
    ("torchrun", "pt_elastic"),
    ("torchrun", "async_grpo.launcher"),  # torchrun's agent; its command line holds the
    ("torchrun", "torch.distributed.run"),  # ranks' (`--verbose` runs torchrun itself)
    ("trainer ranks", "async_grpo.cli train"),
    ("run command", "async_grpo.cli run"),
)


def _kind(comm: str, cmd: str, kinds: tuple[tuple[str, str], ...] = KINDS) -> str:
    for kind, mark in kinds:
        if mark in comm or mark in cmd:
            return kind
    return "Ray's own processes" if ("ray" in comm or "ray" in cmd or "raylet" in comm) else "other"


def _processes() -> dict[tuple[int, int], tuple[float, str, str]]:
    """(pid, start tick) -> (CPU seconds, comm, command line) of every process now."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / HZ
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue  # ended while read
        out[(int(pid), int(fields[19]))] = (cpu, comm, cmd)
    return out


def _stop_with(proc: subprocess.Popen) -> None:
    """A SIGTERM or SIGHUP to the bench (`timeout`, a closed terminal) goes on to its run,
    which stops as on Ctrl-C and ends its own cluster; the bench waits up to 60 s for it."""

    def stop(signum: int, frame: object) -> None:
        proc.send_signal(signum)
        try:
            proc.wait(timeout=60)
        finally:
            raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def measure(model: Path, steps: int, out: Path, extra: list[str]) -> dict[str, object]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "async_grpo.cli", "run", str(REPO / "configs" / "quickstart.yaml")]
    cmd += [
        f"model={model}", f"output_dir={out}", f"trainer.max_steps={steps}",
        "trainer.num_ranks=2", "trainer.lr=1e-3", "trainer.loss.kl_coef=0.01",
        "batcher.questions_per_step=1", "batcher.samples_per_question=6",
        "batcher.max_off_policy_steps=0", "batcher.max_tokens_per_gpu=512",
        "generation.max_model_len=512", "generation.max_new_tokens=24",
        "generation.dtype=float32", "generation.kv_cache_gib=0.0625", "trainer.save_every=3",
        "verifier.rewards=[rewards_for_tests:vowel_share]", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{PLUGINS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    before = set(_processes())
    seen: dict[tuple[int, int], tuple[float, str, str]] = {}
    first: dict[tuple[int, int], float] = {}
    t0 = time.perf_counter()
    with (out.parent / f"{out.name}-console.txt").open("w") as console:
        proc = subprocess.Popen(cmd, env=env, stdout=console, stderr=subprocess.STDOUT)
        _stop_with(proc)
        while proc.poll() is None:
            for key, (cpu, comm, line) in _processes().items():
                if key not in before:  # an ending process reads with no command line
                    line = line or seen.get(key, (0.0, "", ""))[2]
                    seen[key] = (cpu, comm, line)
                    first.setdefault(key, time.perf_counter() - t0)
            time.sleep(0.3)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}): see {out}-console.txt")
    kinds: dict[str, float] = {}
    starts: dict[str, float] = {}
    for key, (cpu, comm, line) in seen.items():
        kind = _kind(comm, line)
        kinds[kind] = kinds.get(kind, 0.0) + cpu
        starts[kind] = min(starts.get(kind, wall), first[key])
    import torch

    return {
        "wall_s": round(wall, 1),
        "cpu_s": round(sum(kinds.values()), 1),
        "cpu_s_by_kind": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda x: -x[1])},
        "first_seen_s": {k: round(v, 1) for k, v in sorted(starts.items(), key=lambda x: x[1])},
        "steps": steps,
        "overrides": extra,
        "cpu_kind": torch.backends.cpu.get_cpu_capability(),
        "cores": len(os.sched_getaffinity(0)),
        "processes": sorted(
            (
                [round(cpu, 1), _kind(comm, line), comm, line[:120]]
                for cpu, comm, line in seen.values()
            ),
            reverse=True,
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("/tmp/run-cpu"))
    p.add_argument("--processes", action="store_true", help="then each process: CPU s, kind")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="after the loop run's own")
    args = p.parse_args()
    from async_grpo.models import make_tiny_model, prepare_smollm2

    model = args.out / "tiny-model"
    if not (model / "config.json").is_file():
        make_tiny_model(model, tokenizer_from=prepare_smollm2())
    for i in range(args.repeats):
        result = measure(model, args.steps, args.out / f"run{i}", args.overrides)
        processes = result.pop("processes")
        print(json.dumps(result), flush=True)
        if args.processes:
            for cpu, kind, comm, line in processes:
                print(f"{cpu:6.1f}  {kind:20} {comm:16} {line}")


if __name__ == "__main__":
    main()
