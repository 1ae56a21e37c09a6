"""A LoRA run as a user runs it: `async-grpo run` with `trainer.lora` (one rank, KL to the
base, an evaluation in the run, a checkpoint), then `async-grpo eval` on its adapter
checkpoint. Its generation worker dies holding a request of step 2 (SIGKILL, as the OOM
killer sends) and is replaced: the adapter folders it served from in /dev/shm are swept,
and nothing of the run is left there at its end. (Exact resume from an adapter
checkpoint: tests/unit/test_lora.py; 2 ranks: the unit test's whole-batch gradient.)"""

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from _cli import CLI, REPO, TINY_KV, plugin_env, run_loop

from async_grpo.shm_files import RUN_ID_ENV, left, owner

pytestmark = pytest.mark.integration

HELD_OUT = REPO / "sample-data" / "arithmetic-heldout.jsonl"
LORA = (
    "trainer.num_ranks=1",
    "trainer.lora.rank=8",
    "trainer.lora.alpha=16",
    "trainer.lr=1e-2",
    "trainer.save_every=2",
    f"eval.data={HELD_OUT}",
    "eval.every=2",
    "eval.at_start=false",
    "eval.max_questions=4",
)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    (base / "faults").mkdir()
    tag = uuid.uuid4().hex
    env = {
        RUN_ID_ENV: tag,  # names the run's folder in /dev/shm
        "ASYNC_GRPO_FAULTS": "generation.generate@2",  # the worker dies in step 2
        "ASYNC_GRPO_FAULT_DIR": str(base / "faults"),
    }
    shm: list[tuple[list[str], list[str]]] = []  # the run's entries, and the dead's among them

    def look() -> None:
        entries = left(tag)
        shm.append((entries, [e for e in entries if not Path(f"/proc/{owner(e)}").exists()]))

    full = run_loop(tiny_model_dir, base / "full", 3, *LORA, env=env, watch=look)
    steps = [m for m in full if "grad_norm" in m]  # the others are the evaluation's rows
    return steps, base, full, shm, tag


def test_a_lora_run_trains_the_adapters_against_the_base(runs, tiny_model_dir):
    """Every step trains and pushes the adapter alone (a few kB, not the model's MBs); the
    KL to the base is 0 while the adapters are still the identity and positive after; no
    logprob pool is started (the trainer computes the base's log-probs itself); the
    workers serve every pushed version (the last too: the evaluation wants it); the
    evaluation ran on the adapter of version 2."""
    full, base, rows, *_ = runs
    assert [m["step"] for m in full] == [1, 2, 3]
    assert all(m["grad_norm"] > 0 and m["time/reference"] > 0 for m in full)
    assert full[0]["kl"] == pytest.approx(0.0, abs=1e-6) and full[2]["kl"] > 0
    model_bytes = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    pushed = [m["weight_push_bytes"] for m in full if "weight_push_bytes" in m]
    assert pushed and all(0 < b < model_bytes / 20 for b in pushed)
    assert [m.get("worker_version/min") for m in full] == [1.0, 2.0, 3.0]  # 3: evaluated
    assert all(m.get("worker_weight_load_failures", 0) == 0 for m in full)
    evals = [m["eval/questions"] for m in rows if "eval/questions" in m]
    assert evals and set(evals) == {4}  # versions 2 and 3 (the last)
    logs = {p.name.split("-")[0] for p in (base / "full" / "logs").glob("*.log")}
    assert logs == {"batcher.log", "evaluator.log", "gen", "ray.log", "verify"}, logs  # no "lp"
    ckpt = base / "full" / "checkpoints" / "step_2"
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "hf").exists()
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    lora = json.loads((ckpt / "trainer_state.json").read_text())["lora"]
    assert lora["rank"] == 8 and lora["alpha"] == 16.0 and len(lora["target_modules"]) == 7 * 2


def test_a_dead_workers_adapter_folders_are_swept_and_none_is_left(runs):
    """The killed worker could not remove its folder: the run removes it when it replaces
    the worker (before the replacement serves from a folder of its own), and everything of
    the run in /dev/shm when it ends. Ray's line about the death goes to logs/ray.log, the
    console says only that a worker died and was replaced."""
    full, base, _, shm, tag = runs
    assert (base / "faults" / "fault-generation.generate").exists()
    assert full[-1]["pool/generation/restarts"] == 1
    # the processes whose adapter folders were seen, in the order they appeared
    owners = [
        {owner(e) for e in entries if Path(e).name.startswith("adapters-")} for entries, _ in shm
    ]
    order = list(dict.fromkeys(pid for found in owners for pid in sorted(found)))
    assert len(order) == 2, order  # the killed worker, then its replacement
    served = next(i for i, found in enumerate(owners) if order[1] in found)
    # from then on, none of the killed worker's (the run's own end kills the replacement
    # with the head: its entries go with the rest of the run's, checked next)
    kept = [e for entries, _ in shm[served:] for e in entries if owner(e) == order[0]]
    assert not kept, f"the killed worker's entries were kept: {kept}"
    assert left(tag) == [] and not list(Path("/dev/shm").glob(f"*{tag}*"))
    console = (base / "full" / "console.txt").read_text()
    assert "pool 'generation': a worker died; started a new one (1/3 restarts)" in console
    assert "(raylet)" not in console
    assert "A worker died or was killed" in (base / "full" / "logs" / "ray.log").read_text()


def test_eval_command_on_an_adapter_checkpoint(runs, tmp_path):
    """`async-grpo eval` on a LoRA checkpoint serves its adapter on the base it names, on a
    copy of the checkpoint, from another working directory (the adapter names its base by
    an absolute path)."""
    base = runs[1]
    out, copied = tmp_path / "eval", tmp_path / "copied" / "step_2"
    shutil.copytree(base / "full" / "checkpoints" / "step_2", copied)
    cmd = [
        *CLI, "eval", "step_2", "--data", str(HELD_OUT), "-o", str(out), "--max-questions", "3",
        "--set", "verifier.rewards=[rewards_for_tests:vowel_share]", "--set", TINY_KV,
    ]  # fmt: skip
    r = subprocess.run(
        cmd, env=plugin_env(), cwd=copied.parent, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    summary = json.loads((out / "eval_summary.json").read_text())
    assert summary["metrics"]["eval/questions"] == 3
