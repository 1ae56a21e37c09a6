"""Where the README's test command spends its CPU: the suite run as CI runs it, with every
process on the machine sampled from /proc every 0.5 s, summed by kind (the engines, the
pool workers, the trainer ranks, the `run` commands, Ray's own processes, the pytest
workers themselves, ...).

    .venv/bin/python bench/suite_cpu.py [--out suite-cpu.json] [PYTEST ARGS ...]

The suite is CPU-bound on 2 cores, so a cut is worth the CPU seconds of the processes it
removes, wherever they run; this says which kind of process to cut next (bench/run_cpu.py
then takes one whole run apart). Prints one JSON line: the wall time, the machine's busy
CPU seconds over the run (/proc/stat, the sampler's own included), the CPU seconds and
count of the suite's processes by kind, and the CPU kind; `--out` also keeps each process
above 1 CPU s. Processes that live shorter than a sample, and the CPU of what was running
before the suite started, are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from run_cpu import KINDS, _kind, _processes

REPO = Path(__file__).resolve().parents[1]

SUITE_KINDS = (  # beyond a run's (run_cpu.KINDS): what the tests start themselves
    ("environment worker", "ray::Environment"),
    ("judge or reward-model worker", "ray::JudgeWorke"),
    ("judge or reward-model worker", "ray::RewardMode"),
    ("eval command", "async_grpo.cli eval"),
    ("worker command", "async_grpo.cli worker"),
    ("other commands", "async_grpo.cli"),
    ("pytest workers", "xdist"),
    ("pytest workers", "-m pytest"),
)
SUITE = (*KINDS, *SUITE_KINDS)


def _busy_ticks() -> int:
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split()[1:9]
    )
    return user + nice + system + irq + softirq + steal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="also write each process above 1 CPU s here")
    args, pytest_args = p.parse_known_args()
    before = set(_processes())
    seen: dict[tuple[int, int], tuple[float, str, str]] = {}
    busy0, t0 = _busy_ticks(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], cwd=REPO)
    while proc.poll() is None:
        for key, (cpu, comm, line) in _processes().items():
            if key not in before:  # a process renames itself (ray::IDLE -> ray::Generation)
                seen[key] = (cpu, comm, line or seen.get(key, (0.0, "", ""))[2])
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    busy = (_busy_ticks() - busy0) / os.sysconf("SC_CLK_TCK")
    kinds: dict[str, list[float]] = {}
    for cpu, comm, line in seen.values():
        total = kinds.setdefault(_kind(comm, line, SUITE), [0.0, 0])
        total[0] += cpu
        total[1] += 1
    import torch

    result = {
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "busy_cpu_s": round(busy, 1),
        "counted_cpu_s": round(sum(v[0] for v in kinds.values()), 1),
        "cpu_s_by_kind": {
            k: {"cpu_s": round(v[0], 1), "processes": v[1]}
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])
        },
        "cpu_kind": torch.backends.cpu.get_cpu_capability(),
        "cores": len(os.sched_getaffinity(0)),
    }
    print(json.dumps(result))
    if args.out:
        heavy = sorted((v for v in seen.values() if v[0] > 1), key=lambda v: -v[0])
        rows = [
            {"cpu_s": round(c, 1), "kind": _kind(n, x, SUITE), "comm": n, "cmd": x[:300]}
            for c, n, x in heavy
        ]
        args.out.write_text(json.dumps({**result, "processes": rows}, indent=1))
    raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
