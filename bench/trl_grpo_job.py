"""TRL's GRPOTrainer on the race's prompts; run by bench/vs_trl.py inside the TRL venv.

    .venv-trl/bin/python bench/trl_grpo_job.py --spec SPEC.json --out RESULT.json

SPEC.json holds the model folder, the prompt JSONL, the step shape, the precision, the seed
and the race's target. The reward is async-grpo's own `last_number` function (pure Python,
imported from the repo), so both sides score samples identically. The learning rate is
constant (TRL's default decays it linearly to 0 over max_steps). Training stops at
max_steps or after the first step whose last `window` steps' mean reward reaches `target`;
the final policy is saved to output_dir/final. RESULT.json gets the wall time of
`trainer.train()`, the steps and samples run, each step's mean reward and elapsed time, and
the time to the target (null if not reached).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_grpo.rewards.number import last_number_reward
    from async_grpo.rewards.registry import RewardInput

    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line]
    n_prompts = spec["steps"] * spec["questions"]
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["input"]}], "answer": str(r["answer"])}
            for r in rows[:n_prompts]
        ]
    )

    def last_number(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            last_number_reward(RewardInput("", t, a)).reward
            for t, a in zip(texts, answer, strict=True)
        ]

    rewards: list[float] = []
    elapsed: list[float] = []
    reached: list[float] = []
    window, target = spec["window"], spec["target"]

    class Race(TrainerCallback):
        """Each step's reward and time; the stop once the target is reached."""

        def on_train_begin(self, _args, _state, _control, **_):
            self.t0 = time.perf_counter()

        def on_log(self, _args, _state, control, logs=None, **_):
            if not (logs and "reward" in logs):
                return
            rewards.append(float(logs["reward"]))
            elapsed.append(time.perf_counter() - self.t0)
            last = rewards[-window:]
            if len(last) == window and sum(last) / window >= target and not reached:
                reached.append(elapsed[-1])
                control.should_training_stop = True

    batch = spec["questions"] * spec["group"]
    cfg = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=spec["bf16"],
        gradient_checkpointing=False,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        max_steps=spec["steps"],
        num_generations=spec["group"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        beta=0.0,
        shuffle_dataset=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=spec["seed"],
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=[last_number],
        args=cfg,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Race()],
    )
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    final = Path(spec["output_dir"]) / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    result = {
        "seconds": seconds,
        "steps": len(rewards),
        "samples": len(rewards) * batch,
        "rewards": rewards,
        "elapsed": elapsed,
        "time_to_target_s": reached[0] if reached else None,
        "final": str(final),
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
