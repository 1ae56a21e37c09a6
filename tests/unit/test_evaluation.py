"""Held-out evaluation: pass@k by hand, the summary, the Evaluator over scripted pools
(the pools are tested for real in tests/integration/test_evaluation.py), the held-out rule."""

import asyncio
import json
import time
from pathlib import Path

import pytest

from async_grpo.config import ConfigError, EvalConfig
from async_grpo.data import Prompt
from async_grpo.evaluation import EvalSample, pass_at_k, summarize
from async_grpo.evaluation.runner import Evaluator
from async_grpo.inference.types import Completion
from async_grpo.preflight.settings import load_config
from async_grpo.rewards import RewardOutput


def test_pass_at_k_by_hand():
    # n=4, c=1: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25, abs=1e-12)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(4, 1, 4) == 1.0
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9, abs=1e-12)
    assert pass_at_k(8, 0, 8) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def _s(q, reward, passed, length=3, truncated=False, version=2, **components):
    return EvalSample(q, "p", "c", "a", reward, passed, "", length, truncated, version, components)


def test_summary_averages_pass_at_k_over_complete_questions():
    samples = [
        _s(0, 1.0, True, 4, x=1.0),
        _s(0, 0.0, False, 2, x=0.0),  # question 0: c=1 of n=2
        _s(1, 1.0, True, 6, True, x=1.0),
        _s(1, 1.0, True, 8, x=1.0),  # question 1: c=2
        _s(2, 1.0, True),  # question 2: one of its two samples missing -> left out
    ]
    m = summarize(samples, 2, [1, 2])
    assert m["eval/questions"] == 2 and m["eval/samples"] == 4
    assert m["eval/pass_at_1"] == pytest.approx((0.5 + 1.0) / 2, abs=1e-12)
    assert m["eval/pass_at_2"] == pytest.approx(1.0, abs=1e-12)
    assert m["eval/reward/mean"] == pytest.approx(0.75, abs=1e-12)
    assert m["eval/output_length/mean"] == pytest.approx(5.0, abs=1e-12)
    assert m["eval/truncated_fraction"] == pytest.approx(0.25, abs=1e-12)
    assert m["eval/reward/x"] == pytest.approx(0.75, abs=1e-12)


class _Generation:
    """Scripted generation pool: completion i of question with token id t is `t+i`."""

    def __init__(self, version):
        self.version, self.calls, self.in_flight, self.peak = version, [], 0, 0

    async def call(self, n, method, ids, n2, sampling, min_version=-1, background=False):
        assert method == "generate" and n == n2 and background
        self.calls.append((ids, sampling, min_version))
        self.in_flight += n
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= n
        if ids == [99]:
            raise TimeoutError("scripted: the worker never answered")
        return [
            Completion([ids[0], i], [-0.1, -0.2], str(ids[0] + i), "stop", self.version)
            for i in range(n)
        ]


class _Verifier:
    async def call(self, n, method, items, rewards=None, evaluation=False):
        assert method == "score" and rewards == ["exact"] and evaluation
        return [RewardOutput(float(x.completion == x.answer), {"hit": 1.0}, "ok") for x in items]


def _prompts(answers):
    return [Prompt(f"q{i}", a, input_token_ids=[10 * (i + 1)]) for i, a in enumerate(answers)]


def test_evaluator_scores_every_question_at_the_version_and_bounds_concurrency():
    cfg = EvalConfig(
        data="x",
        samples_per_question=2,
        pass_k=[1, 2],
        temperature=1.0,
        rewards=["exact"],
        max_concurrent_seqs=4,
    )
    gen = _Generation(version=3)
    ev = Evaluator(
        cfg, 16, _prompts(["11", "20", "0"]), {"generation": gen, "verifier": _Verifier()}
    )
    r = asyncio.run(ev.evaluate(3))
    # question 0 (token 10): "10", "11" -> c=1; question 1: "20", "21" -> c=1; question 2: none
    assert r.error is None and r.metrics["eval/questions"] == 3
    assert r.metrics["eval/pass_at_1"] == pytest.approx((0.5 + 0.5 + 0.0) / 3, abs=1e-12)
    assert r.metrics["eval/pass_at_2"] == pytest.approx(2 / 3, abs=1e-12)
    assert r.metrics["eval/policy_version"] == 3 and r.metrics["eval/other_version_samples"] == 0
    assert all(mv == 3 for *_, mv in gen.calls)  # leased from workers serving version 3
    assert gen.peak <= 4  # max_concurrent_seqs
    seeds = {s.seed for _, s, _ in gen.calls}
    assert len(seeds) == 3  # one per question, the same at every version:
    again = asyncio.run(
        Evaluator(
            cfg,
            16,
            _prompts(["11", "20", "0"]),
            {"generation": _Generation(4), "verifier": _Verifier()},
        ).evaluate(4)
    )
    assert [s.completion for s in again.samples] == [s.completion for s in r.samples]


def test_a_question_that_fails_is_counted_and_named_not_lost():
    cfg = EvalConfig(data="x", rewards=["exact"])
    prompts = _prompts(["10", "x"]) + [Prompt("bad", "1", input_token_ids=[99])]
    r = asyncio.run(
        Evaluator(
            cfg, 8, prompts, {"generation": _Generation(0), "verifier": _Verifier()}
        ).evaluate(0)
    )
    assert r.metrics["eval/questions"] == 2 and r.metrics["eval/missing_questions"] == 1
    assert "1 of 3 questions failed" in r.error and "never answered" in r.error
    assert r.metrics["eval/pass_at_1"] == pytest.approx(0.5, abs=1e-12)


def test_an_evaluation_past_its_timeout_reports_what_finished():
    class Slow(_Generation):
        async def call(self, n, method, ids, *a, **k):
            if ids == [20]:
                await asyncio.sleep(30)
            return await super().call(n, method, ids, *a, **k)

    cfg = EvalConfig(data="x", rewards=["exact"], timeout_s=0.5)
    r = asyncio.run(
        Evaluator(
            cfg, 8, _prompts(["10", "20"]), {"generation": Slow(0), "verifier": _Verifier()}
        ).evaluate(0)
    )
    assert "not finished within eval.timeout_s=0.5s" in r.error
    assert r.metrics["eval/questions"] == 1 and r.metrics["eval/missing_questions"] == 1


def test_an_evaluation_stops_when_no_worker_serves_its_version(monkeypatch):
    """A generation worker replaced during an evaluation loads the newest checkpoint, older
    than the evaluated version: its requests could only wait out `eval.timeout_s` while the
    trainer waits for the evaluation before its next push. It stops as soon as no registered
    worker serves the version (or a newer one), with what finished."""
    from async_grpo.evaluation import runner
    from async_grpo.inference.types import WorkerStatus

    monkeypatch.setattr(runner, "UNSERVED_CHECK_S", 0.05)

    class Replaced(_Generation):  # question 20's worker was replaced: its call never ends
        def __init__(self, version):
            super().__init__(version)
            self.served = {"gen-a": 3}
            outer = self

            class _Status:
                async def remote(self):
                    return [
                        WorkerStatus(w, "generation", 8, 0, v, "", 0.0)
                        for w, v in outer.served.items()
                    ]

            self.registry = type("Registry", (), {"status": _Status()})()

        async def connect(self):
            pass

        async def call(self, n, method, ids, *a, **k):
            if ids == [20]:
                self.served = {"gen-b": 2}  # the replacement loaded checkpoint 2
                await asyncio.sleep(30)
            return await super().call(n, method, ids, *a, **k)

    cfg = EvalConfig(data="x", rewards=["exact"], timeout_s=20)
    t = time.monotonic()
    r = asyncio.run(
        Evaluator(
            cfg, 8, _prompts(["10", "20"]), {"generation": Replaced(3), "verifier": _Verifier()}
        ).evaluate(3)
    )
    assert time.monotonic() - t < 5
    assert r.error == "no generation worker serves version 3 or newer any more"
    assert r.metrics["eval/questions"] == 1 and r.metrics["eval/missing_questions"] == 1


def test_background_start_then_collect_in_version_order():
    async def run():
        cfg = EvalConfig(data="x", rewards=["exact"])
        ev = Evaluator(
            cfg, 8, _prompts(["10"]), {"generation": _Generation(0), "verifier": _Verifier()}
        )
        await ev.start(5)
        await ev.start(0)
        assert await ev.running() == [0, 5]
        done = await ev.wait(10)
        assert [r.version for r in done] == [0, 5] and await ev.finished() == []

    asyncio.run(run())


def _write(path, inputs):
    path.write_text("".join(json.dumps({"input": x, "answer": "1"}) + "\n" for x in inputs))


def test_eval_data_that_overlaps_training_is_refused(tmp_path, tiny_model_dir):
    from async_grpo.data.held_out import held_out_prompts

    _write(tmp_path / "train.jsonl", ["what is 1+1?", "what is 2+2?"])
    _write(tmp_path / "eval.jsonl", ["what is 3+3?", "what is 2+2?"])
    cfg = load_config(
        None, [f"data={tmp_path / 'train.jsonl'}", f"eval.data={tmp_path / 'eval.jsonl'}"]
    )
    with pytest.raises(ConfigError, match="1 of its 2 prompts are also training prompts.*row 2"):
        held_out_prompts(cfg, str(tiny_model_dir))
    _write(tmp_path / "eval.jsonl", ["what is 3+3?", "what is 4+4?", "what is 5+5?"])
    cfg.eval.max_questions = 2
    assert [p.input for p in held_out_prompts(cfg, str(tiny_model_dir))] == [
        "what is 3+3?",
        "what is 4+4?",
    ]


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.every=3", "eval.every: 3 is not a multiple of trainer.push_every=2"),
        ("eval.pass_k=[4]", "eval.pass_k: each k must be in 1..eval.samples_per_question=1"),
        ("eval.samples_per_question=4", "greedy samples are all the same"),
        ("eval.max_new_tokens=5000", "eval.max_new_tokens: must be in 1..1023"),
        ("eval.rewards=[]", "eval.rewards: name at least one reward"),
    ],
)
def test_eval_settings_that_cannot_run_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(
            None,
            [
                "eval.data=x.jsonl",
                "trainer.push_every=2",
                "batcher.max_off_policy_steps=1",
                override,
            ],
        )


def test_the_old_tensorboard_key_says_where_it_went():
    with pytest.raises(ConfigError, match="tensorboard: moved; use trackers.tensorboard"):
        load_config(None, ["tensorboard=true"])


def test_an_evaluation_finished_before_the_run_ends_is_still_logged(ray_cluster, tiny_model_dir):
    """The final version's evaluation can finish before rank 0 reaches the run's end (a
    small held-out set, a slow last checkpoint): the hook's end still writes its row, once,
    through a real actor."""
    import ray

    from async_grpo.evaluation.hook import EvalHook
    from async_grpo.evaluation.scoring import EvalResult
    from async_grpo.hooks import HookContext, Hooks

    @ray.remote(num_cpus=0)
    class AtOnce:  # the Evaluator's interface; every evaluation is done as it starts
        def __init__(self):
            self.done = []

        def start(self, version):
            self.done.append(EvalResult(version, {"eval/pass_at_1": 0.5}, [], 0.0))

        def finished(self):
            done, self.done = self.done, []
            return done

        def wait(self, timeout_s):
            return self.finished()

    cfg = load_config(
        "configs/arithmetic.yaml",
        ["eval.data=sample-data/arithmetic-heldout.jsonl", "eval.every=2", "trainer.max_steps=4"],
    )
    rows = []
    hook = EvalHook(cfg, str(tiny_model_dir), 0)
    hook.ctx = HookContext(cfg, Path("."), str(tiny_model_dir), lambda s, r: rows.append(s))
    hook.ctx.hooks = Hooks([])
    hook.actor = AtOnce.remote()
    hook.after_push(4)  # the final push; its evaluation is finished before the end
    ray.get(hook.actor.__ray_ready__.remote(), timeout=60)
    hook.on_end()
    assert rows == [4]
