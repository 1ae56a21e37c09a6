"""Training hooks: the runner names a hook that raises, user hooks load from the config,
a real `Trainer.step` calls the events in order (and pushes the final weights when a hook
evaluates them), and the sample log stays bounded and exact on resume."""

import json
from dataclasses import replace

import pytest
import torch
from _dist import one_rank_group
from _trainer import ScriptedBatcher, run_config, samples, trainer

from async_grpo.config import HookSpec
from async_grpo.errors import UserError
from async_grpo.hooks import HookContext, HookFailed, Hooks, TrainingHook, load_hooks
from async_grpo.trainer.setup import process_group_backend


class Recorder(TrainingHook):
    def __init__(self, final=False, tag="r"):
        self.events, self.final, self.tag = [], final, tag

    @property
    def wants_final_push(self):
        return self.final

    def before_step(self, step):
        self.events.append(("before_step", step))

    def after_step(self, step, metrics, samples):
        self.events.append(("after_step", step, metrics["policy_version"], len(samples)))

    def before_push(self, version):
        self.events.append(("before_push", version))

    def after_push(self, version):
        self.events.append(("after_push", version))

    def after_checkpoint(self, step, path):
        self.events.append(("after_checkpoint", step, path.name))


class Broken(TrainingHook):
    name = "uploader"

    def after_push(self, version):
        raise OSError("bucket not found")


def test_a_hook_that_raises_stops_with_its_name_and_event():
    first = Recorder()
    hooks = Hooks([first, Broken(), Recorder()])
    with pytest.raises(HookFailed) as e:
        hooks.call("after_push", 3)
    assert str(e.value) == (
        "hook uploader: after_push raised OSError: bucket not found; stopping the run"
    )
    assert isinstance(e.value, UserError) and first.events == [("after_push", 3)]
    with pytest.raises(ValueError, match="unknown hook event"):
        hooks.call("after_lunch")


def test_user_hooks_load_by_path_with_args():
    (h,) = load_hooks([HookSpec(f"{__name__}:Recorder", {"tag": "x"})])
    assert isinstance(h, Recorder) and h.tag == "x"
    with pytest.raises(UserError, match=r"hooks\[0\].path: cannot load 'no_such_mod:X'"):
        load_hooks([HookSpec("no_such_mod:X")])
    with pytest.raises(UserError, match="is not a TrainingHook subclass"):
        load_hooks([HookSpec("json:dumps")])
    with pytest.raises(UserError, match=r"hooks\[0\].args"):
        load_hooks([HookSpec(f"{__name__}:Recorder", {"colour": 1})])


class _Pusher:
    def __init__(self):
        self.pushed = []

    def push(self, version):
        self.pushed.append(version)
        return {}


@pytest.mark.parametrize("final", [False, True])
def test_trainer_step_calls_the_events_in_order(tiny_model_dir, tmp_path, final):
    """The last step (max_steps=1) saves; it pushes only when a hook wants the final
    weights (an evaluation of them), between before_push and after_push."""
    with one_rank_group(process_group_backend("cpu")):
        cfg = run_config(str(tmp_path))
        cfg = replace(
            cfg,
            trainer=replace(cfg.trainer, max_steps=1, push_every=1),
            batcher=replace(cfg.batcher, max_off_policy_steps=0),
        )
        batcher = ScriptedBatcher(samples(), 0, 1)
        batcher.items[-1].samples = [{"step": 1}]
        tr = trainer(str(tiny_model_dir), cfg, torch.device("cpu"), batcher)
        tr.pusher, rec = _Pusher(), Recorder(final)
        tr.hooks = Hooks([rec])
        tr.final_push = tr.hooks.wants_final_push
        tr.step(0)
    pushes = [("before_push", 1), ("after_push", 1)] if final else []
    assert rec.events == [
        ("before_step", 0),
        *pushes,
        ("after_checkpoint", 1, "step_1"),
        ("after_step", 1, 1, 1),
    ]
    assert tr.pusher.pushed == ([1] if final else [])


def test_the_sample_log_is_decoded_bounded_and_trimmed_on_resume(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoTokenizer

    from async_grpo.trainer.run_hooks import SampleLog

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("two plus two")
    row = {
        "step": 0,
        "prompt_ids": ids,
        "completion_ids": tok.encode(" is four"),
        "reward": 1.0,
        "reason": "match",
        "advantage": 0.5,
    }
    ctx = HookContext(None, tmp_path, str(tiny_model_dir))
    log = SampleLog(start_step=0, max_bytes=600)
    log.on_start(ctx)
    for step in (1, 2, 3, 4, 5):
        log.after_step(step, {}, [dict(row, step=step)] * 2)
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"] == "two plus two" and rows[0]["completion"] == " is four"
    assert rows[0]["reward"] == 1.0 and rows[0]["reason"] == "match" and rows[0]["advantage"] == 0.5
    assert (tmp_path / "samples.jsonl").stat().st_size <= 600 and log.full
    assert "no more samples are logged" in capsys.readouterr().err
    kept = max(r["step"] for r in rows)
    SampleLog(start_step=1).on_start(ctx)  # resumed from step 1: later rows go
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert kept > 1 and {r["step"] for r in rows} == {1}


def test_the_batcher_picks_logged_samples_across_groups():
    from async_grpo.batcher.stats import samples_to_log
    from async_grpo.batcher.types import ScoredSample
    from async_grpo.config import RunConfig

    groups = [
        [ScoredSample([1], [g, i], [0.0, 0.0], float(i), {}, 0.0, 0, False) for i in range(2)]
        for g in range(2)
    ]
    cfg = replace(RunConfig(), sample_every=2, samples_logged=3)
    assert samples_to_log(0, groups, cfg) == []  # step 1: not a multiple of 2
    picked = samples_to_log(1, groups, cfg)
    assert [p["completion_ids"] for p in picked] == [[0, 0], [1, 0], [0, 1]]
    assert all(p["step"] == 2 for p in picked)


class _LaggedBatcher(ScriptedBatcher):
    """Counts the trainer's waits for the steps already started (the fixed lag)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.lag_waits = 0

    def wait_generated(self):
        self.lag_waits += 1

    def pending(self, from_step):
        return {}


@pytest.mark.parametrize(
    ("update", "max_steps", "waits"),
    [("wait", 5, 1), ("in_flight", 5, 0), ("in_flight", 1, 1)],
)
def test_in_flight_updates_skip_the_fixed_lag_before_a_push_not_a_save(
    tiny_model_dir, tmp_path, update, max_steps, waits
):
    """`generation.weight_update: in_flight` pushes without waiting for the steps already
    started (their requests go on under the new weights); a save still waits for them so
    the checkpoint holds whole steps. max_steps=1: step 0 saves (and pushes nothing)."""
    with one_rank_group(process_group_backend("cpu")):
        cfg = run_config(str(tmp_path))
        cfg = replace(
            cfg,
            trainer=replace(cfg.trainer, max_steps=max_steps, push_every=1, save_every=0),
            batcher=replace(cfg.batcher, max_off_policy_steps=1),
            generation=replace(cfg.generation, weight_update=update),
        )
        batcher = _LaggedBatcher(samples(), 0, 1)
        tr = trainer(str(tiny_model_dir), cfg, torch.device("cpu"), batcher)
        tr.pusher = _Pusher()
        tr.step(0)
    assert batcher.lag_waits == waits
    assert tr.pusher.pushed == ([1] if max_steps > 1 else [])
