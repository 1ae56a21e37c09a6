"""Held-out evaluation as a user runs it: inside `async-grpo run` (real Ray, vLLM engine,
a judge pool as the only training reward, the verifier pool for the evaluation's rule
reward, trainer) with a user hook, and `async-grpo eval` on the real SmolLM2 and on a
checkpoint folder."""

import json
import subprocess

import pytest
from _cli import CLI, REPO, TINY_KV, plugin_env, run_command

pytestmark = pytest.mark.integration

HELD_OUT = REPO / "sample-data" / "arithmetic-heldout.jsonl"
TRAIN = REPO / "sample-data" / "countdown.jsonl"  # quickstart.yaml's data


def _inputs(path):
    return {json.loads(x)["input"] for x in path.read_text().splitlines() if x.strip()}


def _run(tiny_model_dir, out, steps, *extra, expect=0):
    cmd = run_command(
        "quickstart.yaml",
        f"model={tiny_model_dir}",
        f"output_dir={out}",
        f"trainer.max_steps={steps}",
        "trainer.lr=1e-3",
        "batcher.questions_per_step=1",
        "batcher.samples_per_question=4",
        "batcher.max_off_policy_steps=1",
        "generation.max_new_tokens=16",
        "generation.dtype=float32",
        TINY_KV,
        "verifier.rewards=[rewards_for_tests:vowel_share]",
        *extra,
    )
    try:  # ended before pytest's own 600 s, so a run that does not start says where it was
        r = subprocess.run(cmd, env=plugin_env(), capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired as e:
        said = [
            x.decode(errors="replace") if isinstance(x, bytes) else x or ""
            for x in (e.stdout, e.stderr)
        ]
        pytest.fail(f"the run did not end within 540 s; its output:\n{''.join(said)[-6000:]}")
    assert r.returncode == expect, (r.stdout + r.stderr)[-6000:]
    return r


@pytest.fixture(scope="module")
def run_with_eval(tiny_model_dir, smollm2_dir, tmp_path_factory):
    """The judge (SmolLM2, yes-token probability) is the training's only reward; the
    held-out evaluation adds a rule reward to it."""
    out = tmp_path_factory.mktemp("eval") / "run"
    events = out.parent / "events.jsonl"
    r = _run(
        tiny_model_dir,
        out,
        4,
        f"eval.data={HELD_OUT}",
        "eval.every=2",
        "eval.max_questions=6",
        "eval.samples_per_question=2",
        "eval.temperature=1.0",
        "eval.pass_k=[1,2]",
        "eval.pass_threshold=0.3",
        "sample_every=2",
        f"hooks=[{{path: 'hooks_for_tests:EventLog', args: {{path: '{events}'}}}}]",
        "verifier.rewards=[]",
        f"verifier.judge.model={smollm2_dir}",
        "verifier.judge.max_model_len=512",
        "verifier.judge.kv_cache_gib=1",
        "eval.rewards=[rewards_for_tests:vowel_share]",
    )
    (out.parent / "console.txt").write_text(r.stdout)
    rows = [json.loads(x) for x in (out / "training_metrics.jsonl").read_text().splitlines()]
    return out, rows, [json.loads(x) for x in events.read_text().splitlines()]


def test_evaluations_of_the_pushed_versions_are_metrics_rows(run_with_eval):
    out, rows, _ = run_with_eval
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/policy_version" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [0, 2, 4]  # the start, every 2, the final weights
    # the judge is the training's reward; its counters are the training's: the evaluations'
    # 36 samples are not in
    assert train[-1]["judge/scored"] == sum(r["samples/scored"] for r in train)
    for r in train:
        assert 0.0 < r["reward/judge"] < 1.0 and r["judge/unparsed"] == r["judge/timeout"] == 0
        assert r["reward/mean"] == pytest.approx(r["reward/judge"], abs=1e-6)
    for r in evals:
        assert r["eval/policy_version"] == r["step"] and r["eval/other_version_samples"] == 0
        assert r["eval/questions"] == 6 and r["eval/samples"] == 12
        assert r["eval/missing_questions"] == 0
        assert 0 <= r["eval/pass_at_1"] <= r["eval/pass_at_2"] <= 1
        assert r["eval/reward/rewards_for_tests:vowel_share/vowels"] >= 0
        assert 0.0 < r["eval/reward/judge"] < 1.0  # the evaluation asks the judge too
        assert r["eval/trainer_wait_s"] >= 0 and not any(k in r for k in ("loss", "reward/mean"))
    assert (out / "logs" / "evaluator.log").is_file()
    # the run's last line: its result, read back from these rows
    console = (out.parent / "console.txt").read_text().replace("\r", "\n").splitlines()
    summary = [x for x in console if x.strip()][-1]
    reward = sum(r["reward/mean"] for r in train) / 4
    assert summary.startswith("done: 4 steps in "), summary
    assert f"training reward {reward:.3f} (last 4 steps)" in summary, summary
    assert f"held-out pass@1 {evals[-1]['eval/pass_at_1']:.3f} at version 4" in summary
    assert f"checkpoint {out / 'checkpoints' / 'step_4'}" in summary, summary
    assert summary.endswith(f"metrics {out / 'training_metrics.jsonl'}"), summary
    logged = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in logged} == {2, 4} and all("completion" in r for r in logged)
    png = out / "eval.png"
    plot = [
        *CLI,
        "plot",
        str(out / "training_metrics.jsonl"),
        "-v",
        "eval/pass_at_1",
        "-o",
        str(png),
    ]
    subprocess.run(plot, check=True, capture_output=True, timeout=120)
    assert png.stat().st_size > 0


def test_a_user_hook_sees_every_event_and_only_held_out_prompts(run_with_eval):
    _, _, events = run_with_eval
    names = [e["event"] for e in events]
    assert [e["step"] for e in events if e["event"] == "before_step"] == [0, 1, 2, 3]
    assert [e["version"] for e in events if e["event"] == "after_push"] == [0, 1, 2, 3, 4]
    assert [e["version"] for e in events if e["event"] == "after_eval"] == [0, 2, 4]
    assert [e["hf"] for e in events if e["event"] == "after_checkpoint"] == [True]
    assert names[-1] == "on_end"
    prompts = {s["prompt"] for e in events if e["event"] == "after_eval" for s in e["samples"]}
    assert prompts and prompts <= _inputs(HELD_OUT) and not prompts & _inputs(TRAIN)


def _eval(model, out, *extra):
    cmd = [*CLI, "eval", str(model), "--data", str(HELD_OUT), "-o", str(out), *extra]
    r = subprocess.run(cmd, env=plugin_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    summary = json.loads((out / "eval_summary.json").read_text())
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    return r.stdout, summary, samples


def test_eval_command_on_a_checkpoint_folder(run_with_eval, tmp_path):
    out, *_ = run_with_eval
    stdout, summary, samples = _eval(
        out / "checkpoints" / "step_4",
        tmp_path,
        "--max-questions",
        "5",
        "-n",
        "2",
        "--temperature",
        "1.0",
        "--set",
        "verifier.rewards=[rewards_for_tests:vowel_share]",
        "--set",
        "eval.pass_threshold=0.3",
        "--set",
        "generation.dtype=float32",
        "--set",
        TINY_KV,
    )
    assert summary["model"].endswith("step_4/hf") and summary["error"] is None
    assert len(samples) == 10 and {s["question"] for s in samples} == set(range(5))
    by_q = {q: sum(s["passed"] for s in samples if s["question"] == q) for q in range(5)}
    assert summary["metrics"]["eval/pass_at_1"] == pytest.approx(sum(by_q.values()) / 10, abs=1e-9)
    assert summary["metrics"]["eval/pass_at_2"] == pytest.approx(
        sum(c > 0 for c in by_q.values()) / 5, abs=1e-9
    )
    assert "eval/pass_at_2" in stdout


@pytest.mark.slow
def test_eval_command_on_smollm2(tmp_path):
    stdout, summary, samples = _eval(
        "smollm2-135m",
        tmp_path,
        "--max-questions",
        "8",
        "--rewards",
        "last_number",
        "--set",
        "generation.max_model_len=256",
        "--set",
        "generation.max_new_tokens=48",
    )
    m = summary["metrics"]
    assert m["eval/questions"] == 8 and len(samples) == 8 and m["eval/samples"] == 8
    assert m["eval/pass_at_1"] == sum(s["passed"] for s in samples) / 8
    assert all(s["reason"] for s in samples if not s["passed"])  # why a miss missed
    assert all(s["length"] > 0 for s in samples)
    assert "eval/pass_at_1" in stdout and summary["eval"]["temperature"] == 0.0


def test_eval_command_refuses_a_missing_model(tmp_path):
    (tmp_path / "empty").mkdir()
    r = subprocess.run(
        [*CLI, "eval", str(tmp_path / "empty"), "--data", str(HELD_OUT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "neither a model folder" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
