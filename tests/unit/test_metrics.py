"""MetricsWriter and read_metrics: round trip, scalar conversion, NaN as null, bad lines."""

import json
import sys

import numpy as np
import pytest

from async_grpo.config import TrackersConfig
from async_grpo.errors import UserError
from async_grpo.metrics import METRICS_FILE, PARAMS_FILE, MetricsWriter, read_metrics, summary_line


def test_log_round_trips_and_converts_scalars(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.log(1, {"loss": 0.5, "reward/mean": np.float32(0.25), "samples_seen": np.int64(8)})
        w.log(np.int64(2), {"loss": float("nan"), "kl": np.float64(float("inf")), "ok": True})
        assert w.non_finite == 2
    text = (tmp_path / METRICS_FILE).read_text()
    assert text.count("\n") == 2 and "NaN" not in text and "Infinity" not in text
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert rows == [
        {"step": 1, "loss": 0.5, "reward/mean": 0.25, "samples_seen": 8},
        {"step": 2, "loss": None, "kl": None, "ok": 1},
    ]
    assert type(rows[0]["samples_seen"]) is int


def test_torch_scalars_become_floats(tmp_path):
    torch = pytest.importorskip("torch")
    with MetricsWriter(tmp_path) as w:
        w.log(1, {"grad_norm": torch.tensor(1.5), "lr": torch.tensor([0.125])})
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 1, "grad_norm": 1.5, "lr": 0.125}]


def test_bad_values_fail_loud(tmp_path):
    with MetricsWriter(tmp_path) as w:
        with pytest.raises(ValueError, match="'step'"):
            w.log(1, {"step": 3})
        with pytest.raises(TypeError, match="metric 'x'"):
            w.log(1, {"x": "high"})
        with pytest.raises(TypeError, match="metric 'v'"):
            w.log(1, {"v": np.array([1.0, 2.0])})
    assert (tmp_path / METRICS_FILE).read_text() == ""  # nothing half-written


def test_a_second_writer_appends(tmp_path):
    for step in (1, 2):
        with MetricsWriter(tmp_path) as w:
            w.log(step, {"loss": float(step)})
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2]


def test_write_params_is_atomic_json(tmp_path):
    w = MetricsWriter(tmp_path / "run")
    path = w.write_params({"lr": 1e-6, "model": tmp_path / "m", "group_size": 8})
    w.write_params({"lr": 2e-6})  # overwrites
    w.close()
    w.close()
    assert path == tmp_path / "run" / PARAMS_FILE
    assert json.loads(path.read_text()) == {"lr": 2e-6}
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([PARAMS_FILE, METRICS_FILE])


def test_tensorboard_scalars_match_the_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"loss": 1.5, "reward/mean": 0.25}, {"loss": 0.5, "reward/mean": 0.75}]
    with MetricsWriter(tmp_path, TrackersConfig(tensorboard=True)) as w:
        for step, row in enumerate(rows, 1):
            w.log(step, row)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "reward/mean"}
    for key in ("loss", "reward/mean"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(i, r[key]) for i, r in enumerate(rows, 1)]


def test_tensorboard_without_the_package_is_a_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with MetricsWriter(tmp_path, TrackersConfig(tensorboard=True)) as w:
        w.log(1, {"loss": 1.0})
    assert "tensorboard" in capsys.readouterr().err
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 1, "loss": 1.0}]


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 1.0}\n\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert f"{path}:4: skipping a truncated last line" in capsys.readouterr().err


def test_bad_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2,\n{"step": 3}\n')
    with pytest.raises(UserError, match=rf"^{path}:2: not valid JSON"):
        read_metrics(path)


def test_bad_last_line_with_newline_is_an_error(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2\n')
    with pytest.raises(UserError, match=":2: not valid JSON"):
        read_metrics(path)


def test_non_object_line_and_missing_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(UserError, match=":2: expected a JSON object, got list"):
        read_metrics(path)
    with pytest.raises(UserError, match="metrics file not found"):
        read_metrics(tmp_path / "nope.jsonl")


def test_a_resumed_writer_drops_the_steps_after_its_checkpoint(tmp_path):
    """A run that crashed after step 5 but checkpointed at 3 is resumed from 3: steps 4
    and 5 are written again by the resumed run, so the old rows go (and a cut last line)."""
    with MetricsWriter(tmp_path) as w:
        for step in range(1, 6):
            w.log(step, {"loss": float(step)})
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    with MetricsWriter(tmp_path, after_step=3) as w:
        w.log(4, {"loss": 40.0})
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_a_fresh_run_in_a_used_folder_starts_a_new_file(tmp_path):
    """A run from step 0 keeps nothing of an earlier run there, its step-0 evaluation row
    included; a run resumed from step 2 keeps that row and the steps up to 2."""
    with MetricsWriter(tmp_path) as w:
        w.log(0, {"eval/pass_at_1": 0.1})
        for step in (1, 2, 3):
            w.log(step, {"loss": float(step)})
    with MetricsWriter(tmp_path, after_step=2) as w:
        pass
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [0, 1, 2]
    with MetricsWriter(tmp_path, after_step=0) as w:
        w.log(0, {"eval/pass_at_1": 0.2})
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert rows == [{"step": 0, "eval/pass_at_1": 0.2}]


def test_the_summary_line_reads_the_runs_own_files(tmp_path):
    """Steps, the last 4 steps' mean reward, the last held-out pass@1 (rows of `eval/*`
    keys only), the newest checkpoint and the metrics file; what a run lacks is left out."""
    assert summary_line(tmp_path, 3.4) == f"done: 0 steps in 3 s; metrics {tmp_path / METRICS_FILE}"
    with MetricsWriter(tmp_path) as w:
        w.log(0, {"eval/pass_at_1": 0.1})
        for step, reward in enumerate([0.0, 0.2, 0.4, 0.6, 0.8], start=1):
            w.log(step, {"loss": 1.0, "reward/mean": reward})
        w.log(4, {"eval/pass_at_1": 0.625})
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_5\n")
    assert summary_line(tmp_path, 125.2) == (
        "done: 5 steps in 2 min 5 s; training reward 0.500 (last 4 steps); held-out pass@1"
        f" 0.625 at version 4; checkpoint {tmp_path / 'checkpoints' / 'step_5'}; metrics"
        f" {tmp_path / METRICS_FILE}"
    )
