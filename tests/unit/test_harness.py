"""Agent harnesses (`environment.kind: openai`) in the real ExperienceBatcher: the user's
`rollout(client, row)` runs in its own thread with the real `openai` client, over a real
socket to the batcher's endpoint, with SmolLM2's tokenizer and chat template. Only the
generation pool is scripted, so the trained ids can be checked against what it sampled."""

from __future__ import annotations

import asyncio
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from async_grpo.batcher.batcher import ExperienceBatcher
from async_grpo.batcher.types import EndOfBatch, Minibatch
from async_grpo.config import BatcherConfig, EnvironmentConfig, RunConfig, TrainerConfig
from async_grpo.data import Prompt
from async_grpo.inference.types import Completion

PLUGINS = str(Path(__file__).parents[1] / "integration" / "plugins")
LOGPROB = -0.25


@pytest.fixture(autouse=True)
def plugins(monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    yield
    sys.modules.pop("harnesses_for_tests", None)


class Pool:
    """The generation pool's client: answers the first user turn's product ("It is 408.",
    wrong on odd seeds), EOS-closed, LOGPROB a token, version 0; keeps what it sampled."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.sampled, self.asked = tokenizer, [], []

    async def call(self, n, method, ids, n2, sampling, on_retry=None, min_version=-1):
        assert (n, n2, method) == (1, 1, "generate")
        self.asked.append((list(ids), sampling))
        a, b = map(int, re.findall(r"\d+", self.tok.decode(ids))[:2])
        text = f"It is {1 if sampling.seed % 2 else a * b}."
        token_ids = self.tok(text, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        self.sampled.append(token_ids)
        return [Completion(token_ids, [LOGPROB] * len(token_ids), text, "stop", 0)]


def _cfg(rollout: str, **env) -> RunConfig:
    return replace(
        RunConfig(model="smollm2-135m"),
        environment=EnvironmentConfig(
            kind="openai", rollout=f"harnesses_for_tests:{rollout}", **env
        ),
        batcher=BatcherConfig(questions_per_step=2, samples_per_question=3, seed=5),
        trainer=TrainerConfig(max_steps=1),
    )


def _prompts(tokenizer, metadata=None) -> list[Prompt]:
    from async_grpo.data.tokenize import chat_token_ids

    out = []
    for i in range(4):
        messages = [{"role": "user", "content": f"What is {12 + i} * 34?"}]
        ids = chat_token_ids(tokenizer, messages[0]["content"])
        out.append(Prompt(messages[0]["content"], str((12 + i) * 34), list(ids),
                          dict(metadata or {}), messages=messages))  # fmt: skip
    return out


def _runs(ids, mask):
    """The stretches of `ids` where `mask` is True."""
    out, run = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            run.append(t)
        elif run:
            out, run = [*out, run], []
    return out + ([run] if run else [])


def _step(cfg, tokenizer, prompts, smollm2_dir):
    """One step of the batcher: (the samples sent, its EndOfBatch, the pool)."""
    cfg = replace(cfg, model=str(smollm2_dir))
    pool = Pool(tokenizer)

    async def main():
        b = ExperienceBatcher(cfg, prompts, num_ranks=1)
        b._clients = {"generation": pool}
        await b.start(0)
        await b.set_version(0)
        items = []
        try:
            while not isinstance(item := await b.get(0, 60), EndOfBatch):
                items.append(item)
        finally:
            await b.stop()
        return items, item

    items, eob = asyncio.run(asyncio.wait_for(main(), 120))
    sent = [s for mb in items if isinstance(mb, Minibatch) for s in mb.samples]
    return sent, eob, pool


def test_a_two_turn_harness_trains_the_sampled_tokens(tokenizer, smollm2_dir):
    """Each rollout is one sample whose trained tokens are exactly the two replies the
    pool sampled, the harness's second user turn masked; the named rewards are logged and
    the books balance."""
    sent, eob, pool = _step(_cfg("two_turns"), tokenizer, _prompts(tokenizer), smollm2_dir)
    stats = eob.stats
    assert stats["samples/unaccounted"] == 0.0 and stats["env/errors"] == 0.0
    assert stats["turns/mean"] == 2.0 and stats["env/prefix_breaks"] == 0.0
    assert {"reward/correct", "reward/short"} <= set(stats)
    assert eob.global_samples == 6 and len(pool.sampled) == 12
    sampled = {tuple(r) for r in pool.sampled}
    for s in sent:
        runs = _runs(s.completion_ids, s.completion_mask)
        assert len(runs) == 2 and all(tuple(r) in sampled for r in runs)
        lps = [lp for lp, m in zip(s.behaviour_logprobs, s.completion_mask, strict=True) if m]
        assert set(lps) == {LOGPROB}
        assert "Check it and say it again." in tokenizer.decode(s.completion_ids)
    # the second request continued from the kept ids: prompt, first reply, then the new turn
    firsts = {tuple(ids) for ids, _ in pool.asked if tokenizer.decode(ids).count("user") == 1}
    for ids, _ in pool.asked:
        if tokenizer.decode(ids).count("<|im_start|>user") == 2:
            assert any(ids[: len(f)] == list(f) for f in firsts)
    seeds = [s.seed for _, s in pool.asked]
    assert len(set(seeds)) == len(seeds)  # a seed per sample and turn


def test_a_rewritten_history_trains_as_two_samples_of_one_rollout(tokenizer, smollm2_dir):
    """A prefix break: each rollout is two samples with one advantage; the books count
    rollouts."""
    cfg = _cfg("rewrites_history")
    sent, eob, _ = _step(cfg, tokenizer, _prompts(tokenizer), smollm2_dir)
    stats = eob.stats
    assert stats["env/prefix_breaks"] == 6.0 and stats["samples/unaccounted"] == 0.0
    assert stats["samples/trained"] + stats["samples/skipped"] == 6
    assert eob.global_samples == 12
    later = [s for s in sent if "Think first." in tokenizer.decode(s.prompt_ids)]
    assert len(later) == 6  # each rollout's second segment starts at the rewritten turn
    heads = [s for s in sent if s not in later]
    assert {s.advantage for s in later} <= {s.advantage for s in heads}


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("raise", "error"),
        ("hang", "timeout"),
        ("garbage", "bad_output"),
        ("nan", "bad_output"),
        ("bad_dict", "bad_output"),
    ],
)
def test_a_misbehaving_harness_scores_0_with_its_reason(tokenizer, smollm2_dir, mode, reason):
    # a hang must meet the timeout; the rest are asked and answered well inside theirs (a
    # first request pays its client's start: 1 s was once too short on a loaded machine)
    cfg = _cfg("misbehaves", rollout_timeout_s=1.0 if mode == "hang" else 60.0)
    prompts = _prompts(tokenizer, {"mode": mode})
    sent, eob, _ = _step(cfg, tokenizer, prompts, smollm2_dir)
    stats = eob.stats
    assert stats[f"env/errors/{reason}"] == 6 and stats["samples/unaccounted"] == 0.0
    assert stats["samples/skipped"] == 6  # all reward 0: equal, counted


def test_a_harness_that_never_asks_fails_its_group(tokenizer, smollm2_dir):
    sent, eob, _ = _step(_cfg("never_asks"), tokenizer, _prompts(tokenizer), smollm2_dir)
    stats = eob.stats
    assert stats["samples/missing"] == 6 and stats["dropped/group_error"] == 2 * 3 * 3
    assert stats["samples/unaccounted"] == 0.0


def test_harnesses_that_block_their_threads_stop_the_run(tokenizer, smollm2_dir, monkeypatch):
    import async_grpo.batcher.harness as harness

    monkeypatch.setattr(harness, "THREAD_SLACK_S", 0.5)
    cfg = _cfg("misbehaves", rollout_timeout_s=0.5)
    prompts = _prompts(tokenizer, {"mode": "block", "seconds": 4})
    with pytest.raises(Exception, match="blocked their threads past environment.rollout_timeout_s"):
        _step(cfg, tokenizer, prompts, smollm2_dir)


@pytest.mark.parametrize(
    "env,line",
    [
        ({"rollout": None}, "environment.rollout: expected module:function"),
        ({"rollout": "no_such_module:f"}, "environment.rollout: cannot import no_such_module"),
        ({"rollout": "harnesses_for_tests:nope"}, "has no function 'nope'"),
        ({"rollout": "harnesses_for_tests:not_async"}, "must be an async def"),
        ({"name": "calculator"}, "environment.name/url: a harness"),
        ({"tool_parser": "no_parser"}, "environment.tool_parser: 'no_parser' is not one of"),
    ],
)
def test_harness_settings_are_refused_in_one_line(env, line):
    from async_grpo.config import ConfigError
    from async_grpo.preflight.settings import validate

    e = {"kind": "openai", "rollout": "harnesses_for_tests:two_turns"} | env
    cfg = replace(RunConfig(), environment=EnvironmentConfig(**e))
    with pytest.raises(ConfigError, match=re.escape(line)):
        validate(cfg)


def test_share_prompts_is_refused_with_a_harness():
    from async_grpo.config import ConfigError
    from async_grpo.preflight.settings import validate

    cfg = replace(_cfg("two_turns"), batcher=BatcherConfig(share_prompts=True))
    with pytest.raises(ConfigError, match="batcher.share_prompts"):
        validate(cfg)


def test_a_split_rollout_survives_the_checkpoint_round_trip(tokenizer, smollm2_dir, tmp_path):
    """Pending groups go into checkpoints as JSON; a rollout's later segment keeps its
    `continues` mark, so the replayed books count rollouts as before."""
    import json
    from dataclasses import asdict

    from async_grpo.batcher.harness import HarnessRunner
    from async_grpo.inference.types import SamplingSettings
    from async_grpo.trainer.checkpoint import PENDING_FILE, load_pending

    cfg = replace(_cfg("rewrites_history"), model=str(smollm2_dir))

    async def main():
        runner = HarnessRunner(cfg, {"generation": Pool(tokenizer)}, tokenizer)
        await runner.start()
        try:
            return await runner.group(_prompts(tokenizer)[0], 3, SamplingSettings(32, seed=2), 0)
        finally:
            await runner.stop()

    group = asyncio.run(asyncio.wait_for(main(), 60))
    assert [s.continues for s in group] == [False, True] * 3
    assert all(s.episode is None for s in group if s.continues)
    (tmp_path / PENDING_FILE).write_text(json.dumps({"3": [[asdict(s) for s in group]]}))
    assert load_pending(tmp_path) == {3: [group]}


def test_the_tool_parsers_read_from_source_are_vllms_own():
    """The config's check reads vLLM's tool parsers from its source (no vLLM import before
    Ray); it must be exactly the set vLLM's manager reports."""
    from async_grpo.environments.endpoint import _imported_tool_parser_names, tool_parser_names

    read = tool_parser_names()
    assert {"hermes", "llama3_json", "mistral"} <= read
    assert read == set(_imported_tool_parser_names())
