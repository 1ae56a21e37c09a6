"""The whole loop, as a user runs it: `async-grpo run` with tiny random models on a private
local Ray cluster: 2 gloo trainer ranks, 1 vLLM generation worker, 1 logprob worker
(KL on), the verifier pool; then an exact resume.

One question per step keeps the engine's batch the same from run to run: with several
requests in flight their order changes the batch, and with it the last bits of the logits,
which can flip a seeded sample of a near-uniform random model. Exact resume is exact up to
that engine nondeterminism."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from _cli import run_command, run_loop

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _run(tiny_model_dir, out, steps, *extra):
    return run_loop(tiny_model_dir, out, steps, *extra)


CORES = sorted(os.sched_getaffinity(0))
# the engine on the first core, both trainer ranks on the last (docs/placement.md); the
# log-prob worker left on any core
PLACED = (f"generation.cpus={CORES[0]}", f"trainer.cpus={CORES[-1]}", "trainer.threads=1")
SEEN_CORES: dict = {}  # role -> the core sets its processes had while the full run trained


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """A 4-step run (checkpoints at steps 3 and 4), and step 4 again: a second run resumed
    from the first one's step-3 checkpoint into a folder of its own."""
    base = tmp_path_factory.mktemp("loop")
    extra = (*SEQUENCE_LEVEL, *PLACED)
    full = run_loop(tiny_model_dir, base / "full", 4, *extra, cores=SEEN_CORES)
    step3 = base / "full" / "checkpoints" / "step_3"
    resumed = _run(tiny_model_dir, base / "resumed", 4, *extra, "--resume", str(step3))
    return full, resumed, base


# the objective and correction that need whole sequences on a rank: GSPO's ratio, a
# sequence-level mask of the correction weight, taken against the trainer's own policy
SEQUENCE_LEVEL = (
    "trainer.loss.objective=gspo",
    "trainer.loss.proximal=current",
    "trainer.loss.correction.level=sequence",
    "trainer.loss.correction.mode=mask",
    "trainer.loss.correction.cap=3.0",
)


def test_four_steps_train_and_push(runs):
    full, _, base = runs
    assert [m["step"] for m in full] == [1, 2, 3, 4]
    for m in full:
        assert m["samples"] == 6 and m["grad_norm"] > 0 and m["zero_advantage_fraction"] == 0
        assert m["kl"] >= 0.0 and "reward/rewards_for_tests:vowel_share/vowels" in m
        assert m["staleness/max"] == 0  # max_off_policy_steps=0: on-policy
        # the sequence weights over both ranks: near 1 (fp32 engine and trainer), the max
        # reduced by max, and one weight per sequence: masked tokens come in whole samples
        assert 0.9 < m["is_weight_mean"] <= m["is_weight_max"] < 1.1
        assert m["ratio_mean"] == pytest.approx(1.0) and m["is_masked_frac"] == 0.0
        assert m["verifier/timeouts"] == 0 and m["verifier/errors"] == 0
        # on-policy: each step's window holds its own generation, and the trainer waits
        assert 0 < m["pool/generation/busy_fraction"] <= 1
        assert 0 < m["pool/generation/busy_fraction_run"] <= 1
        assert 0 < m["time/idle_fraction"] < 1
    assert [m["verifier/scored"] for m in full] == [6.0, 12.0, 18.0, 24.0]  # since start
    # the workers served each new version: pushed after steps 1-3 (the last step saves)
    assert [m.get("worker_version/min") for m in full] == [1.0, 2.0, 3.0, None]
    elapsed = [m["time/elapsed"] for m in full]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= sum(m["time/step"] for m in full)
    params = json.loads((base / "full" / "training_params.json").read_text())
    assert params["world_size"] == 2 and params["trainer"]["num_ranks"] == 2
    hf = base / "full" / "checkpoints" / "step_3" / "hf"
    assert (hf / "model.safetensors").is_file() and (hf / "tokenizer.json").is_file()


@pytest.mark.skipif(len(CORES) < 2, reason="placement needs two cores")
def test_engine_and_trainer_ran_on_disjoint_cores(runs):
    """generation.cpus and trainer.cpus, read from outside through every thread's affinity
    while the run trained: the engine's threads only on the first core, both ranks' only on
    the last, the unplaced log-prob worker on any."""
    assert SEEN_CORES["generation"] == {(CORES[0],)}, SEEN_CORES
    assert SEEN_CORES["trainer"] == {(CORES[-1],)}, SEEN_CORES
    assert SEEN_CORES["logprob"] == {tuple(CORES)}, SEEN_CORES
    *_, base = runs
    logs = "".join(p.read_text() for p in (base / "full" / "logs").glob("gen-*"))
    assert f"bound to cores {CORES[0]}" in logs


def test_console_is_quiet_and_worker_logs_are_files(runs):
    """Without --verbose the console has the start-up lines, the precision line and the
    progress bar; vLLM, transformers and the batcher write to output_dir/logs/."""
    *_, base = runs
    console = (base / "full" / "console.txt").read_text()
    lines = [x for x in console.replace("\r", "\n").splitlines() if x.strip()]
    noisy = [x for x in lines if "steps:" not in x]
    assert len(noisy) <= 12, "\n".join(noisy)
    assert not any("vLLM" in x or "WARNING" in x or "INFO" in x for x in noisy), noisy
    logs = sorted(p.name.split("-")[0] for p in (base / "full" / "logs").glob("*.log"))
    assert logs == ["batcher.log", "gen", "lp", "verify"], logs
    assert "vLLM" in "".join(p.read_text() for p in (base / "full" / "logs").glob("gen-*"))


def test_the_timeline_holds_every_part_of_every_step(runs):
    """timeline.jsonl of the 4-step run: the trainer waits, trains, pushes and saves; the
    generation worker generates under the version pushed after the step before (on-policy);
    the verifier scores each step's group; a resumed run keeps each step once."""
    from async_grpo.timeline import read_timeline

    full, resumed, base = runs
    spans = read_timeline(base / "full")
    assert sorted({s["step"] for s in spans}) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        mine = [s for s in spans if s["step"] == step]
        trainer = {s["what"] for s in mine if s["lane"] == "trainer"}
        assert {"train", "wait"} <= trainer
        assert ("push" in trainer) == (step < 4)  # none after the last step
        assert ("save" in trainer) == (step in (3, 4))
        gen = [s for s in mine if s["lane"].startswith("gen-")]
        assert gen and {s["version"] for s in gen} == {step - 1}
        assert len([s for s in mine if s["lane"] == "verifier"]) == 1  # one group a step
    assert all(s["end"] >= s["start"] for s in spans)
    assert {s["step"] for s in read_timeline(base / "resumed")} == {4}  # only what it ran


def test_resume_continues_exactly(runs):
    """The resumed run trains step 4 as the uninterrupted one did: same samples (the
    sampler's position is in the checkpoint), same loss, same learning rate."""
    full, resumed, base = runs
    assert [m["step"] for m in resumed] == [4]
    params = json.loads((base / "resumed" / "training_params.json").read_text())
    assert params["resumed_from"] == 3
    assert resumed[0]["reward/mean"] == pytest.approx(full[3]["reward/mean"], abs=1e-6)
    assert resumed[0]["loss"] == pytest.approx(full[3]["loss"], rel=1e-4, abs=1e-7)
    assert resumed[0]["lr"] == full[3]["lr"]
    assert resumed[0]["samples_seen"] == full[3]["samples_seen"]


def test_checkpoint_loads_in_transformers(runs, tiny_model_dir, tmp_path):
    """The HF folder holds exactly the trained weights of the resumable (DCP) state, and
    they moved away from the initial model."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    *_, base = runs
    step = base / "full/checkpoints/step_3"
    model = AutoModelForCausalLM.from_pretrained(step / "hf", dtype=torch.float32)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    dcp_to_torch_save(step / "dcp", tmp_path / "state.pt")
    trained = torch.load(tmp_path / "state.pt")["model"]
    moved = 0
    for name, p in model.named_parameters():
        assert torch.equal(p, trained[f"hf.{name}"]), name
        moved += not torch.equal(p, initial[name])
    assert moved >= len(initial) // 2
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()


@pytest.mark.slow
def test_smollm2_loop_runs(smollm2_dir, tmp_path):
    """The same loop with the real SmolLM2-135M (minutes): `pytest -m slow`."""
    cmd = run_command(
        "quickstart.yaml",
        f"output_dir={tmp_path}",
        "trainer.max_steps=2",
        "batcher.questions_per_step=2",
        "batcher.samples_per_question=4",
        "generation.max_new_tokens=64",
    )
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    metrics = [json.loads(line) for line in (tmp_path / "training_metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["samples"] == 8 and m["grad_norm"] >= 0 for m in metrics)
    assert metrics[0]["worker_version/min"] == 1.0


def test_equal_reward_groups_are_counted_not_run(tiny_model_dir, tmp_path):
    """`exact` never matches a Countdown answer: every group has equal rewards, so with no KL
    the batcher sends nothing (no forward/backward at all) and the trainer's counts still
    agree with the batcher's. Two spare groups a step cannot help (their rewards are equal
    too, or they are cancelled in the engine when the step is packed): their samples are
    counted unused and the books balance; nor can a redraw (dynamic sampling, bound 1).
    Its mean reward of 0 reaches `trainer.stop_at_reward: 0` over 2 steps: the run of 4
    steps ends after step 2, with its checkpoint and a held-out evaluation of version 2
    (not due by `eval.every`: the run's last version)."""
    rows = _run(
        tiny_model_dir,
        tmp_path / "flat",
        4,
        "trainer.stop_at_reward=0.0",
        "trainer.stop_window=2",
        "trainer.loss.kl_coef=0.0",
        "verifier.rewards=[exact]",
        "trainer.save_every=0",
        "batcher.spare_groups=2",
        "batcher.dynamic_sampling=1",
        f"eval.data={REPO / 'sample-data' / 'arithmetic-heldout.jsonl'}",
        "eval.every=3",
        "eval.at_start=false",
        "eval.max_questions=2",
    )
    metrics = [m for m in rows if "eval/policy_version" not in m]
    assert [m["eval/policy_version"] for m in rows if m not in metrics] == [2]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward/mean"] == 0.0 and m["zero_advantage_fraction"] == 1.0
        assert m["reward/trained_mean"] == 0.0
        assert m["skipped_samples"] == m["samples"] == 6
        assert m["spare_groups_used"] == 0 and m["dropped/spare_unused"] == 12
        # the one group was redrawn once (equal again): its first draw left as redrawn
        assert m["dynamic_sampling/redraws"] == 1 and m["dynamic_sampling/left_equal"] == 1
        assert m["dropped/redrawn"] == 6
        assert m["samples/unaccounted"] == 0 and m["samples/requested"] == 24
        assert m["grad_norm"] == 0.0 and m["loss"] == 0.0
        assert m["minibatches"] == 0  # a round empty on every rank is never run
    saved = sorted(p.name for p in (tmp_path / "flat" / "checkpoints").glob("step_*"))
    assert saved == ["step_2"]
    assert (
        "trainer.stop_at_reward reached at step 2"
        in (tmp_path / "flat" / "console.txt").read_text()
    )


@pytest.mark.parametrize(
    "lora",
    [
        # full fine-tuning of an episode: `-m slow` (the merged-LoRA run below walks the
        # same episodes and mask, and full pushes are in every other whole run)
        pytest.param((), marks=pytest.mark.slow),
        (
            "trainer.lora.rank=8",
            "trainer.lora.alpha=16",
            "trainer.lr=1e-2",
            "trainer.lora.push=merged",
        ),
    ],
    ids=["full", "lora-merged"],
)
def test_a_multi_turn_run_trains_on_model_tokens_only(tiny_model_dir, tmp_path, lora):
    """`run` with an environment instead of verifiers (2 ranks, KL on): episodes of two turns
    with the environment's line between them. The sampler-vs-trainer mismatch, taken over
    the loss tokens, stays at fp32 noise: an environment token among them would add its
    whole log-prob (the sampler's is 0 there). With LoRA pushed merged (`W + (alpha/r) B A`
    as full weights into engines without LoRA), step 2's turns come from the merged
    weights: a wrong merge would show in the mismatch."""
    metrics = _run(
        tiny_model_dir,
        tmp_path / "env",
        2,
        "environment.name=envs_for_tests:VowelTurns",
        "trainer.save_every=0",
        *lora,
    )
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["turns/mean"] == 2.0 and m["vowel_turns/mean"] == 2.0
        assert m["env/errors"] == 0.0 and m["grad_norm"] > 0
        assert m["mismatch_abs_mean"] < 1e-3, m["mismatch_abs_mean"]
        assert m["samples/unaccounted"] == 0.0 and m["kl"] >= 0.0
    console = (tmp_path / "env" / "console.txt").read_text()
    assert "verifier" not in console.lower()
