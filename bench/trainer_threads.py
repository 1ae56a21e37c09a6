"""How many CPU threads the trainer should take beside the engine: the same run per count.

    .venv/bin/python bench/trainer_threads.py [--config configs/arithmetic.yaml] [--steps 8]
                                              [--threads 2,1]

On a CPU node the trainer's ranks and the generation engines share the cores. The trainer
runs its matrix products on `trainer.threads` OpenMP threads that meet at a barrier after
every parallel region, so one thread preempted by the engine stalls the others. This
bench runs `async-grpo run CONFIG` once per `trainer.threads` value on this machine
(evaluation and sample logs off) and prints one JSON line per run, naming this CPU's
kind: wall time, the trainer's idle share and the generation pool's busy share, the
trainer's tokens/s and forward/backward seconds per step (means over the steps after the
first), and the mean reward over the first, middle and last steps.
"""

from __future__ import annotations

from pathlib import Path

from _runs import mean, summary, sweep, train_rows


def one_run(config: str, steps: int, out: Path, threads: str) -> dict:
    wall, train = train_rows(config, steps, out, f"trainer.threads={threads}")
    later = train[1:] or train  # the first step also waits for the first samples
    return {
        "trainer_threads": int(threads),
        **summary(wall, train),
        "trainer_tokens_per_s": mean(later, "tokens_per_s"),
        "forward_backward_s": mean(later, "time/forward_backward"),
    }


if __name__ == "__main__":
    sweep(__doc__, "threads", "2,1", 8, "outputs/bench-trainer-threads", one_run)
