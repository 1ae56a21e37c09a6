"""`verifiers` environments (`environment.kind: verifiers`) in the real ExperienceBatcher:
the real `verifiers` package loads them and runs their rollouts with its own client, over
a real socket to the batcher's endpoint, with SmolLM2's tokenizer and chat template. Only
the generation pool is scripted, so the trained ids can be checked against what it
sampled."""

from __future__ import annotations

import asyncio
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_harness import LOGPROB, PLUGINS, _runs, _step

from async_grpo.config import BatcherConfig, EnvironmentConfig, RunConfig, TrainerConfig
from async_grpo.data import Prompt
from async_grpo.inference.types import Completion

pytest.importorskip("verifiers")
CALCULATOR = "async_grpo.environments.vf_calculator"


@pytest.fixture(autouse=True)
def envs(monkeypatch):
    """The test environments importable as `verifiers` loads them, and loaded afresh."""
    monkeypatch.syspath_prepend(PLUGINS)
    yield
    sys.modules.pop("verifiers_envs_for_tests", None)


class CalculatorPool:
    """The generation pool for the calculator: a turn opened with `<calc>` calls it on
    the task's product; the next answers the tool's last number (1 on odd seeds)."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.sampled, self.asked = tokenizer, [], []

    async def call(self, n, method, ids, n2, sampling, on_retry=None, min_version=-1):
        self.asked.append((list(ids), sampling))
        context = self.tok.decode(ids)
        if context.endswith("<calc>"):
            a, b = re.findall(r"compute (\d+) \* (\d+)", context)[-1]
            text = f"{a} * {b}</calc>"
        else:
            text = "1" if sampling.seed % 2 else re.findall(r"\d+", context)[-1]
        token_ids = self.tok(text, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        self.sampled.append(token_ids)
        return [Completion(token_ids, [LOGPROB] * len(token_ids), text, "stop", 0)]


def _cfg(name: str = CALCULATOR, **args) -> RunConfig:
    return replace(
        RunConfig(model="smollm2-135m"),
        environment=EnvironmentConfig(kind="verifiers", name=name, args=args),
        batcher=BatcherConfig(questions_per_step=2, samples_per_question=3, seed=5),
        trainer=TrainerConfig(max_steps=1),
    )


def _calculator_prompts(tokenizer) -> list[Prompt]:
    from async_grpo.data.generate import calculator_rows
    from async_grpo.data.tokenize import chat_token_ids

    out = []
    for r in calculator_rows(4, 3):
        messages = [{"role": "user", "content": r["input"]}]
        ids = chat_token_ids(tokenizer, r["input"])
        out.append(Prompt(r["input"], r["answer"], list(ids), messages=messages))
    return out


def _step_with(pool, cfg, prompts, smollm2_dir, monkeypatch):
    import test_harness

    monkeypatch.setattr(test_harness, "Pool", lambda tokenizer: pool)
    return _step(cfg, pool.tok, prompts, smollm2_dir)


def test_a_multi_turn_environment_trains_the_sampled_tokens_and_masks_its_tool(
    tokenizer, smollm2_dir, monkeypatch
):
    """The shipped calculator environment: each rollout is one sample whose trained
    tokens are the pool's two replies (the first continued from the `<calc>` prefill),
    the tool's value masked context between them; the rubric's functions are logged and
    its weighted sum is the reward."""
    pool = CalculatorPool(tokenizer)
    sent, eob, _ = _step_with(
        pool, _cfg(n=4, eval_n=2), _calculator_prompts(tokenizer), smollm2_dir, monkeypatch
    )
    stats = eob.stats
    assert stats["samples/unaccounted"] == 0.0 and stats["env/errors"] == 0.0
    assert stats["turns/mean"] == 2.0 and stats["env/prefix_breaks"] == 0.0
    assert stats["reward/calls"] == 1.0 and 0.0 < stats["reward/correct"] < 1.0
    assert eob.global_samples == 6 and len(pool.sampled) == 12
    sampled = {tuple(r) for r in pool.sampled}
    opened = [ids for ids, _ in pool.asked if tokenizer.decode(ids).endswith("<calc>")]
    assert len(opened) == 6  # every first turn continued the prefill
    for s in sent:
        runs = _runs(s.completion_ids, s.completion_mask)
        assert len(runs) == 2 and all(tuple(r) in sampled for r in runs)
        lps = [lp for lp, m in zip(s.behaviour_logprobs, s.completion_mask, strict=True) if m]
        assert set(lps) == {LOGPROB}
        context = tokenizer.decode(
            [t for t, m in zip(s.completion_ids, s.completion_mask, strict=True) if not m]
        )
        a, b = re.findall(r"(\d+) \* (\d+)</calc>", tokenizer.decode(s.completion_ids))[0]
        assert str(int(a) * int(b)) in context  # the tool's value: masked
        last = tokenizer.decode(runs[-1]).strip()
        assert (s.advantage > 0) == last.startswith(str(int(a) * int(b)))


def test_a_single_turn_environment_scores_with_its_rubric(tokenizer, smollm2_dir, monkeypatch):
    """SingleTurnEnv with a system prompt and two weighted functions: the prompt carries
    the environment's system prompt, the reward is the weighted sum, each function logged."""
    from test_harness import Pool, _prompts

    pool = Pool(tokenizer)
    cfg = _cfg("verifiers_envs_for_tests", kind="single")
    sent, eob, _ = _step_with(pool, cfg, _prompts(tokenizer), smollm2_dir, monkeypatch)
    stats = eob.stats
    assert stats["env/errors"] == 0.0 and stats["turns/mean"] == 1.0
    assert {"reward/exact", "reward/short"} <= set(stats)
    assert all("Reply with a number." in tokenizer.decode(ids) for ids, _ in pool.asked)
    # "It is 408." is not exact, "It is 1." neither: only `short` scores (0.5 weighted)
    assert stats["reward/exact"] == 0.0 and stats["reward/short"] == 1.0
    assert stats["reward/mean"] == 0.5


def test_a_rubric_with_group_functions_scores_each_group_together(
    tokenizer, smollm2_dir, monkeypatch
):
    """A group reward function sees the group's finished rollouts together: the shortest
    replies of each group ("It is 1.", odd seeds) score 1.0 and train up."""
    from test_harness import Pool, _prompts

    pool = Pool(tokenizer)
    cfg = _cfg("verifiers_envs_for_tests", kind="group")
    sent, eob, _ = _step_with(pool, cfg, _prompts(tokenizer), smollm2_dir, monkeypatch)
    assert eob.stats["env/errors"] == 0.0 and {"reward/shortest", "reward/exact"} <= set(eob.stats)
    assert sent and all(
        (s.advantage > 0) == tokenizer.decode(s.completion_ids).startswith("It is 1.") for s in sent
    )


@pytest.mark.parametrize(
    "kind,reason", [("broken", "error"), ("nan", "bad_output"), ("group_breaks", "error")]
)
def test_a_misbehaving_environment_scores_0_with_its_reason(
    tokenizer, smollm2_dir, monkeypatch, kind, reason
):
    from test_harness import Pool, _prompts

    pool = Pool(tokenizer)
    cfg = _cfg("verifiers_envs_for_tests", kind=kind)
    sent, eob, _ = _step_with(pool, cfg, _prompts(tokenizer), smollm2_dir, monkeypatch)
    assert eob.stats[f"env/errors/{reason}"] == 6 and eob.stats["samples/unaccounted"] == 0.0


@pytest.mark.parametrize(
    "env,line",
    [
        ({"name": None}, "environment.name: kind verifiers needs an installed environment"),
        ({"name": "no_such_env"}, "environment.name=no_such_env: cannot import it"),
        ({"args": {"kind": "fails"}}, "load_environment(**environment.args) failed: Runtime"),
        ({"args": {"kind": "single", "n": "x"}}, "load_environment(**environment.args) failed"),
        ({"rollout": "harnesses_for_tests:two_turns"}, "environment.rollout: a verifiers"),
        ({"url": "http://127.0.0.1:1"}, "environment.name/url: a harness"),
        ({"tool_parser": "no_parser"}, "environment.tool_parser: 'no_parser' is not one of"),
    ],
)
def test_verifiers_settings_are_refused_in_one_line(env, line, tmp_path):
    """By the config's checks or, loading the environment, by the preflight (`run`
    calls both before Ray; the real command is in test_bad_input)."""
    from async_grpo.config import ConfigError
    from async_grpo.preflight import preflight
    from async_grpo.preflight.settings import validate

    e = {"kind": "verifiers", "name": "verifiers_envs_for_tests", "args": {}} | env
    cfg = replace(RunConfig(), environment=EnvironmentConfig(**e), output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape(line)) as caught:
        validate(cfg)
        preflight(cfg, "unused: refused before the model", None)
    assert "\n" not in str(caught.value)


def test_the_environments_dataset_is_the_runs_data(tmp_path, smollm2_dir):
    """`data: environment`: the environment's dataset, written as parquet where the
    trainer looks for it and read as any data file; a row's input to the environment is
    its own row (prompt, answer, info, task, id)."""
    from async_grpo.data.generate import calculator_rows
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.environments.verifiers_env import data_file, rollout_input
    from async_grpo.preflight import environment_data

    cfg = replace(_cfg(n=5, eval_n=3), data="environment", output_dir=str(tmp_path / "out"))
    expected = data_file(cfg)
    environment_data(cfg)
    assert cfg.data == expected
    table = prepare_prompts(cfg.data, smollm2_dir, 384, "chat", cfg.dataset)
    assert len(table) == 5
    first, p = calculator_rows(5, 0)[0], table[0]
    assert p.messages == [{"role": "user", "content": first["input"]}]
    assert p.answer == first["answer"]
    written = Path(expected).stat().st_mtime_ns
    resumed = replace(cfg, data="environment", environment=replace(cfg.environment, args={}))
    environment_data(resumed, resumed=True)  # another dataset now: the run's stays
    assert resumed.data == expected and Path(expected).stat().st_mtime_ns == written
    row = {"prompt": p.messages, "answer": p.answer, "metadata": dict(p.metadata)}
    got = rollout_input(row)
    assert got["example_id"] == 0 and "task" not in got
    assert got["prompt"] == p.messages and got["answer"] == first["answer"]


def test_loading_an_environment_leaves_the_process_signal_handlers_alone():
    """`verifiers` installs SIGINT/SIGTERM handlers in every environment it builds; the
    run's own stay, and a load off the main thread (as the batcher's) works."""
    import signal
    import threading

    from async_grpo.environments.verifiers_env import load_env

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    load_env("verifiers_envs_for_tests", {"kind": "single", "n": 3})
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    errors = []
    t = threading.Thread(
        target=lambda: errors.append(load_env("verifiers_envs_for_tests", {"kind": "tool"}))
    )
    t.start()
    t.join(60)
    assert errors and errors[0].__class__.__name__ == "ToolEnv"


def test_data_environment_needs_a_verifiers_run(tmp_path):
    from async_grpo.config import ConfigError
    from async_grpo.preflight import environment_data

    cfg = replace(RunConfig(), data="environment", output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="data: 'environment' names a verifiers"):
        environment_data(cfg)


def test_a_tool_environment_trains_the_sampled_call_and_masks_the_tool_result(
    tiny_model_dir, tmp_path
):
    """vf.ToolEnv with a Python tool, through the endpoint with vLLM's hermes parser: the
    environment gets the call as `tool_calls`, runs the tool and sends its result back as
    a tool message; the rollout stays one segment whose trained tokens are the sampled
    call and answer, the tool result masked context."""
    from test_data_forms import with_template
    from test_openai_endpoint import HERMES, TOKEN, _serve
    from transformers import AutoTokenizer

    from async_grpo.environments.harness import drive
    from async_grpo.environments.verifiers_env import VerifiersRollout, load_env

    tokenizer = AutoTokenizer.from_pretrained(with_template(tiny_model_dir, tmp_path / "h", HERMES))
    call = '<tool_call>\n{"name":"add","arguments":{"a":12,"b":34}}\n</tool_call>'
    rollout = VerifiersRollout(load_env("verifiers_envs_for_tests", {"kind": "tool"}))
    row = {"prompt": [{"role": "user", "content": "12 + 34?"}], "answer": "46",
           "metadata": {}, "model": "policy"}  # fmt: skip

    async def run(ep, pool):
        rid, url = ep.open()
        scored = await asyncio.to_thread(drive, rollout, url, TOKEN, row, 30)
        return scored, ep.close(rid), pool

    scored, traj, pool = _serve(tokenizer, [call, "46"], run, tool_parser="hermes")
    assert scored.reward == 1.0 and scored.parts["exact"] == 1.0
    assert traj.prefix_breaks == 0 and len(traj.segments) == 1
    assert '"name": "add"' in tokenizer.decode(pool.asked[0][0])  # the tool, rendered
    seg = traj.segments[0]
    trained = _runs(seg.ids, seg.mask)
    sampled = tokenizer(call, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert trained[0] == sampled and len(trained) == 2
    context = tokenizer.decode([t for t, m in zip(seg.ids, seg.mask, strict=True) if not m])
    assert "<tool_response>\n46\n</tool_response>" in context


@pytest.mark.parametrize(
    "kind,reply,reward,parts",
    [
        ("xml", "<think>\nsum\n</think>\n<answer>\n46\n</answer>", 1.2,
         {"correct": 1.0, "format_reward_func": 1.0}),
        ("group_of_envs", "46", 0.5, {"half": 0.5}),
    ],
)  # fmt: skip
def test_parsers_and_groups_of_environments_run_as_they_are(
    tokenizer, tmp_path, kind, reply, reward, parts
):
    """An XMLParser's answer and format reward; an EnvGroup whose rows (written from its
    dataset as `data: environment` writes them) route to their environment by
    `info.env_id` (the last row goes to `b`, which scores 0.5)."""
    from test_openai_endpoint import TOKEN, _serve

    from async_grpo.environments.harness import drive, reward_of
    from async_grpo.environments.verifiers_env import VerifiersRollout, _data_row, load_env

    env = load_env("verifiers_envs_for_tests", {"kind": kind, "n": 2})
    rows = list(env.get_dataset())
    written = _data_row(rows[-1], len(rows) - 1, "input", "answer")
    row = {"prompt": written["input"], "answer": "46", "metadata": written["metadata"],
           "model": "policy"}  # fmt: skip

    async def run(ep, pool):
        rid, url = ep.open()
        out = await asyncio.to_thread(drive, VerifiersRollout(env), url, TOKEN, row, 30)
        return out, ep.close(rid)

    out, traj = _serve(tokenizer, [reply], run)
    got, named = reward_of(out)
    assert got == pytest.approx(reward) and parts.items() <= named.items()
    assert traj.prefix_breaks == 0 and len(traj.segments) == 1
