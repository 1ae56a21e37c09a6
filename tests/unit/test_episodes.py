"""Multi-turn episodes in the batcher, token by token, with the real SmolLM2 tokenizer, a
scripted generation pool and a real EnvironmentWorker (in-process, no Ray): the ids are
the sampled ones plus the template's turn text, the mask covers only the model's tokens,
environment failures end their episode with reward 0 and a reason, no instance leaks,
and packing turns environment tokens into context."""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import replace

import pytest
import torch

from async_grpo.batcher.batcher import ExperienceBatcher
from async_grpo.batcher.episodes import EpisodeRunner
from async_grpo.batcher.types import EndOfBatch, Minibatch
from async_grpo.config import BatcherConfig, EnvironmentConfig, LossConfig, RunConfig, TrainerConfig
from async_grpo.core.packing import IGNORE_INDEX, PackInput, pack
from async_grpo.data import Prompt
from async_grpo.environments import Environment, StepResult, environment
from async_grpo.environments.pool import EnvironmentWorker
from async_grpo.environments.turns import TurnFormat
from async_grpo.inference.types import Completion, SamplingSettings

LOGPROB = -0.5


class ScriptedModel:
    """Reads the last user turn of the ids it is given: a number -> answers it; else a
    calculator call for the question. Each token's log-prob is LOGPROB."""

    def __init__(self, tokenizer, version=0, close_turn=True, wrong_on_odd_seeds=False):
        self.tok, self.version, self.close_turn = tokenizer, version, close_turn
        self.wrong_on_odd_seeds = wrong_on_odd_seeds
        self.calls = 0
        self.retries = 0

    async def call(self, n, method, ids, n2, sampling, on_retry=None, min_version=-1):
        assert (n, n2, method) == (1, 1, "generate")
        self.calls += 1
        last_user = self.tok.decode(ids).rsplit("<|im_start|>user\n", 1)[1]
        last_user = last_user.split("<|im_end|>")[0]
        if last_user.strip().isdigit():
            wrong = self.wrong_on_odd_seeds and sampling.seed % 2
            text = f"The answer is {1 if wrong else last_user.strip()}."
        else:
            a, b = re.findall(r"\d+", last_user)[:2]
            text = f"<calc>{a} * {b}</calc>"
        token_ids = self.tok(text, add_special_tokens=False).input_ids
        cut = len(token_ids) >= sampling.max_new_tokens  # vLLM: finish_reason "length"
        token_ids = token_ids[: sampling.max_new_tokens]
        if self.close_turn and not cut:
            token_ids = [*token_ids, self.tok.eos_token_id]
        finish = "length" if cut or not self.close_turn else "stop"
        return [Completion(token_ids, [LOGPROB] * len(token_ids), text, finish, self.version)]


class InProcessEnvironments:
    """The environment pool's client, with one in-process EnvironmentWorker behind it
    (calls go through `.remote` like a Ray handle's)."""

    def __init__(self, cfg: EnvironmentConfig) -> None:
        self.worker = EnvironmentWorker(cfg, "env-0")
        self.call_timeout_s = 30.0
        self.retries = 0

    @contextlib.asynccontextmanager
    async def hold(self, n, hold_s):
        yield "env-0", _Handle(self.worker)

    async def drop(self, worker_id, reason):
        raise AssertionError(f"dropped {worker_id}: {reason}")


class _Handle:
    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name):
        method = getattr(self.obj, name)

        class Remote:
            @staticmethod
            def remote(*args):
                async def run():
                    out = method(*args)
                    return await out if asyncio.iscoroutine(out) else out

                return run()

        return Remote


def _cfg(env: str = "calculator", **env_kw) -> RunConfig:
    return replace(
        RunConfig(),
        environment=EnvironmentConfig(name=env, step_timeout_s=0.5, **env_kw),
        batcher=BatcherConfig(
            questions_per_step=2, samples_per_question=3, max_tokens_per_gpu=1024
        ),
        trainer=TrainerConfig(max_steps=1, loss=LossConfig()),
    )


def _prompt(tokenizer, a: int, b: int) -> Prompt:
    from async_grpo.data.tokenize import chat_token_ids

    text = f"What is {a} * {b}?"
    return Prompt(text, str(a * b), chat_token_ids(tokenizer, text))


def _group(cfg, tokenizer, model, prompt):
    envs = InProcessEnvironments(cfg.environment)
    runner = EpisodeRunner(
        cfg, {"generation": model, "environment": envs}, TurnFormat(tokenizer, 16)
    )
    group = asyncio.run(runner.group(prompt, 3, SamplingSettings(48, seed=1), 0))
    return group, envs.worker


def test_an_episode_is_the_sampled_ids_and_the_template_turns_with_a_model_only_mask(tokenizer):
    cfg = _cfg()
    prompt = _prompt(tokenizer, 347, 29)
    group, worker = _group(cfg, tokenizer, ScriptedModel(tokenizer), prompt)
    call = tokenizer("<calc>347 * 29</calc>", add_special_tokens=False).input_ids + [2]
    between = tokenizer(
        "\n<|im_start|>user\n10063<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    ).input_ids
    answer = tokenizer("The answer is 10063.", add_special_tokens=False).input_ids + [2]
    for s in group:
        assert s.prompt_ids == prompt.input_token_ids
        assert s.completion_ids == call + between + answer
        assert s.completion_mask == [True] * len(call) + [False] * len(between) + [True] * len(
            answer
        )
        assert s.logprobs == [LOGPROB] * len(call) + [0.0] * len(between) + [LOGPROB] * len(answer)
        assert (s.reward, s.truncated, s.loss_tokens) == (1.0, False, len(call) + len(answer))
        assert s.episode["turns"] == 2 and s.episode["info/tool_calls"] == 1.0
        assert s.episode["env_errors"] == 0.0
    assert worker.live() == 0 and worker.stats()["env/released"] == 3


def test_environment_tokens_are_context_in_the_packed_row(tokenizer):
    group, _ = _group(_cfg(), tokenizer, ScriptedModel(tokenizer), _prompt(tokenizer, 12, 34))
    for share in (False, True):
        batch = pack([s.to_pack_input() for s in group], share_prompts=share)
        assert batch.num_tokens == sum(s.loss_tokens for s in group)
        s = group[0]
        # the labels of the first sample's completion positions are its ids where masked in
        want = [
            t if m else IGNORE_INDEX
            for t, m in zip(s.completion_ids, s.completion_mask, strict=True)
        ]
        row = batch.labels[0][batch.labels[0] != IGNORE_INDEX].tolist()
        assert row[: s.loss_tokens] == [t for t in want if t != IGNORE_INDEX]
        on_env = ~batch.loss_mask & (batch.sample_index == 0)
        assert batch.behaviour_logprobs[on_env].abs().sum() == 0
        assert batch.advantages[on_env].abs().sum() == 0


def test_packing_refuses_a_mask_of_the_wrong_length():
    with pytest.raises(ValueError, match="completion_mask has 1 entries, expected 2"):
        pack([PackInput([1, 2], [3, 4], 1.0, [0.0, 0.0], completion_mask=[True])])
    ones = pack([PackInput([1, 2], [3, 4], 1.0, [-1.0, -1.0], completion_mask=[True, True])])
    plain = pack([PackInput([1, 2], [3, 4], 1.0, [-1.0, -1.0])])
    assert torch.equal(ones.labels, plain.labels) and ones.num_tokens == plain.num_tokens == 2


@environment("test_breaks")
class Breaks(Environment):
    """Per task metadata: fails in `mode` at its first step."""

    def reset(self, task):
        self.mode = task.metadata["mode"]

    async def step(self, action):
        if self.mode == "raise":
            raise RuntimeError("tool crashed")
        if self.mode == "hang":
            await asyncio.sleep(5)
        if self.mode == "garbage":
            return StepResult(None, 1.0, True)  # type: ignore[arg-type]
        return StepResult("0", 0.5, False)


@pytest.mark.parametrize(
    ("mode", "reason"), [("raise", "error"), ("hang", "timeout"), ("garbage", "bad_output")]
)
def test_a_broken_environment_ends_its_episode_with_reward_0_and_a_reason(tokenizer, mode, reason):
    prompt = replace(_prompt(tokenizer, 2, 3), metadata={"mode": mode})
    group, worker = _group(_cfg("test_breaks"), tokenizer, ScriptedModel(tokenizer), prompt)
    for s in group:
        assert s.reward == 0.0 and s.episode["env_errors"] == 1.0
        assert s.episode[f"env_errors/{reason}"] == 1.0 and s.episode["turns"] == 1
        assert all(s.completion_mask)  # the model's one turn; nothing appended after
    assert worker.live() == 0


def test_turns_and_tokens_are_bounded(tokenizer):
    prompt = replace(_prompt(tokenizer, 2, 3), metadata={"mode": "ok"})
    group, worker = _group(
        _cfg("test_breaks", max_turns=3), tokenizer, ScriptedModel(tokenizer), prompt
    )
    # out of turns, each turn closed: not truncated (`mask_truncated` keeps these failures
    # in the loss; it once dropped exactly the episodes that never finished)
    assert all(s.episode["turns"] == 3 and not s.truncated and s.reward == 1.5 for s in group)
    # out of tokens: with 20, no room is left for a second turn after the first's 11
    # tokens and the observation (nothing cut); with 26 the second turn is cut at the
    # budget, and the episode is truncated
    for budget, turns, cut in [(20, 1, False), (26, 2, True)]:
        short = _cfg("test_breaks", max_turns=3, max_episode_tokens=budget)
        group, worker = _group(short, tokenizer, ScriptedModel(tokenizer), prompt)
        for s in group:
            assert len(s.completion_ids) <= budget and s.episode["turns"] == turns
            assert s.truncated == cut
    assert worker.live() == 0


def test_the_batcher_trains_episodes_with_loss_counts_of_model_tokens_only(tokenizer):
    cfg = _cfg()
    prompts = [_prompt(tokenizer, 12 + i, 34) for i in range(4)]

    async def main():
        b = ExperienceBatcher(cfg, prompts, num_ranks=1, turns=TurnFormat(tokenizer, 16))
        envs = InProcessEnvironments(cfg.environment)
        model = ScriptedModel(tokenizer, wrong_on_odd_seeds=True)
        b._clients = {"generation": model, "environment": envs}
        await b.start(0)
        await b.set_version(0)
        items = []
        while not isinstance(item := await b.get(0, 30), EndOfBatch):
            items.append(item)
        await b.stop()
        return items, item, envs.worker

    items, eob, worker = asyncio.run(asyncio.wait_for(main(), 60))
    sent = [s for mb in items if isinstance(mb, Minibatch) for s in mb.samples]
    assert sent and all(s.completion_mask is not None and not all(s.completion_mask) for s in sent)
    sent_tokens = sum(sum(s.completion_mask) for s in sent)
    assert eob.global_tokens == sent_tokens + eob.skipped_tokens
    assert eob.global_samples == len(sent) + eob.skipped_samples == 6
    assert eob.stats["turns/mean"] == 2.0 and eob.stats["tool_calls/mean"] == 1.0
    assert 0 < eob.stats["reward/mean"] < 1
    assert eob.stats["env/errors"] == 0.0 and eob.stats["samples/unaccounted"] == 0.0
    assert worker.live() == 0


@pytest.mark.parametrize("on_error", ["score", "regenerate"])
def test_a_failing_environment_is_scored_or_its_group_regenerated(tokenizer, on_error):
    cfg = _cfg("test_breaks", on_error=on_error)
    prompts = [replace(_prompt(tokenizer, 2 + i, 3), metadata={"mode": "raise"}) for i in range(4)]

    async def main():
        b = ExperienceBatcher(cfg, prompts, num_ranks=1, turns=TurnFormat(tokenizer, 16))
        envs = InProcessEnvironments(cfg.environment)
        b._clients = {"generation": ScriptedModel(tokenizer), "environment": envs}
        await b.start(0)
        await b.set_version(0)
        while not isinstance(item := await b.get(0, 30), EndOfBatch):
            pass
        await b.stop()
        return item, envs.worker

    eob, worker = asyncio.run(asyncio.wait_for(main(), 60))
    books = eob.stats
    assert books["samples/unaccounted"] == 0.0 and worker.live() == 0
    if on_error == "score":  # all reward 0: counted, with the reason
        assert books["samples/skipped"] == 6 and books["env/errors/error"] == 6
    else:  # 3 attempts per group, then the slot is missing
        assert books["dropped/env_error"] == 2 * 3 * 3 and books["samples/missing"] == 6


def test_an_episode_survives_the_checkpoint_round_trip(tokenizer, tmp_path):
    """Pending groups go into checkpoints as JSON and are replayed on resume."""
    import json
    from dataclasses import asdict

    from async_grpo.trainer.checkpoint import PENDING_FILE, load_pending

    group, _ = _group(_cfg(), tokenizer, ScriptedModel(tokenizer), _prompt(tokenizer, 5, 6))
    (tmp_path / PENDING_FILE).write_text(json.dumps({"3": [[asdict(s) for s in group], None]}))
    assert load_pending(tmp_path) == {3: [group, None]}


@pytest.mark.parametrize("close_is_eos", [True, False], ids=["close-is-eos", "close-is-not-eos"])
def test_a_turn_closed_by_a_stop_id_reads_as_the_template_renders_it(tokenizer, close_is_eos):
    """A model turn that ends on the template's close is not closed a second time, also
    when that close is not the tokenizer's EOS but one of the engine's other stop ids (as
    Gemma's <end_of_turn> and Llama 3's <|eot_id|> are)."""
    import copy

    tok = copy.deepcopy(tokenizer)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    stop = []
    if not close_is_eos:
        tok.eos_token = "<|endoftext|>"
        stop = [im_end]  # generation_config's eos_token_id
    fmt = TurnFormat(tok, 16, stop)
    question, call = "What is 2 * 3?", "<calc>2 * 3</calc>"
    action = tok(call, add_special_tokens=False).input_ids + [im_end]  # stopped on the close
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    ids = list(getattr(ids, "input_ids", ids)) + action
    ids += fmt.between("6", fmt.closed(action))[0]
    chat = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": call},
        {"role": "user", "content": "6"},
    ]
    assert tok.decode(ids) == tok.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    cut = action[:-1]  # a turn cut at its limit: the close is added
    assert tok.decode(fmt.between("6", fmt.closed(cut))[0]).startswith("<|im_end|>")


def test_an_episode_keeps_the_version_of_each_token(tokenizer):
    """A weight update between an episode's turns (`in_flight` updates): each model token
    keeps the version that sampled it, so `samples/mixed_versions` sees the episode and the
    token staleness counts model tokens only (the environment's were never sampled)."""
    from async_grpo.batcher.stats import batch_stats, token_staleness

    class UpdatedBetweenTurns(ScriptedModel):  # the call turn at version 0, the answer at 1
        async def call(self, n, method, ids, *args, **kwargs):
            last_user = self.tok.decode(ids).rsplit("<|im_start|>user\n", 1)[1]
            self.version = int(last_user.split("<|im_end|>")[0].strip().isdigit())
            return await super().call(n, method, ids, *args, **kwargs)

    model = UpdatedBetweenTurns(tokenizer)
    group, _ = _group(_cfg(), tokenizer, model, _prompt(tokenizer, 12, 34))
    for s in group:
        assert s.episode["turns"] == 2 and s.version == 0
        versions, mask = s.token_versions, s.completion_mask
        first_env = mask.index(False)
        second = first_env + mask[first_env:].index(True)
        assert set(versions[:second]) == {0} and set(versions[second:]) == {1}
        model_tokens = [v for v, m in zip(versions, mask, strict=True) if m]
        assert token_staleness(1, [s]) == sum(1 - v for v in model_tokens) / len(model_tokens)
    assert batch_stats(1, [group], 0.0)["samples/mixed_versions"] == 1.0


@environment("test_not_unicode")
class NotUnicode(Environment):
    """Its first observation, by task metadata `mode`: a lone surrogate, bytes that are
    not UTF-8 read with surrogateescape (as `os.fsdecode` or a subprocess gives them),
    or the raw bytes themselves."""

    def reset(self, task):
        self.mode, self.steps = task.metadata["mode"], 0

    def step(self, action):
        self.steps += 1
        if self.steps > 1:
            return StepResult("", 1.0, True)
        observation = {
            "surrogate": "1 * 6\ud800",
            "escaped": b"1 * 6 caf\xe9".decode("utf-8", "surrogateescape"),
            "bytes": b"1 * 6 caf\xe9",
        }[self.mode]
        return StepResult(observation, 0.0, False)


@pytest.mark.parametrize(
    ("mode", "shown"),
    [("surrogate", "1 * 6\ufffd"), ("escaped", "1 * 6 caf\ufffd"), ("bytes", None)],
)
def test_an_observation_that_is_not_unicode_is_replaced_and_counted(tokenizer, mode, shown):
    """The tokenizer raises TypeError on a lone surrogate: each one goes in as U+FFFD and
    the observation is counted; bytes are not a str observation: bad_output."""
    from async_grpo.batcher.stats import episode_stats

    prompt = replace(_prompt(tokenizer, 2, 3), metadata={"mode": mode})
    group, worker = _group(_cfg("test_not_unicode"), tokenizer, ScriptedModel(tokenizer), prompt)
    stats = episode_stats([s.episode for s in group])
    if shown is None:
        assert stats["env/errors/bad_output"] == 3 and all(s.reward == 0.0 for s in group)
    else:
        assert stats["env/observations_not_unicode"] == 3 and stats["env/errors"] == 0
        for s in group:
            env_text = tokenizer.decode(
                [t for t, m in zip(s.completion_ids, s.completion_mask, strict=True) if not m]
            )
            assert f"user\n{shown}<|im_end|>" in env_text and s.reward == 1.0
    assert worker.live() == 0
