"""Metrics sinks, each read back from its own store: the JSONL's names, steps and values.

The rows mimic a run with evaluation: an evaluation row arrives after the training row of
a later step and carries the earlier step (the policy version it evaluated), and one value
is NaN (null in the JSONL, absent from every tracker). Values are exact in float32, so
TensorBoard's float32 store compares with `==`.
"""

import json
import os
import struct
import sys
import zlib
from pathlib import Path

import pytest

from async_grpo.config import TrackersConfig
from async_grpo.metrics import METRICS_FILE, MetricsWriter, read_metrics
from async_grpo.sinks.base import INSTALL_HINT, MetricsSink
from async_grpo.sinks.mlflow import flatten_params, mlflow_key

ROWS = [
    (1, {"loss": 1.5, "reward/mean": 0.25}),
    (2, {"loss": 0.5, "reward/mean": 0.75, "kl": float("nan")}),
    (1, {"eval/pass@1": 0.5, "eval/reward/mean": 0.375}),  # version 1, evaluated late
    (3, {"loss": 0.25, "reward/mean": 1.0}),
    (3, {"eval/pass@1": 0.75, "eval/reward/mean": 0.625}),
]
PARAMS = {"model": "m", "trainer": {"lr": 1e-6, "max_steps": 3}, "pass_k": [1, 2], "x": "y" * 600}


def write_run(output_dir: Path, trackers: TrackersConfig) -> list[dict]:
    """Write PARAMS and ROWS through a MetricsWriter; return the JSONL rows read back."""
    with MetricsWriter(output_dir, trackers) as w:
        w.write_params(PARAMS)
        for step, row in ROWS:
            w.log(step, row)
        assert w.sink_errors == 0
    return read_metrics(output_dir / METRICS_FILE)


def series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Per metric name, its (step, value) points in the order written; nulls left out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and value is not None:
                out.setdefault(key, []).append((row["step"], value))
    return out


def test_the_rows_are_what_the_sinks_are_compared_with(tmp_path):
    rows = write_run(tmp_path, TrackersConfig())
    assert [r["step"] for r in rows] == [1, 2, 1, 3, 3]
    assert rows[1]["kl"] is None
    assert series(rows)["eval/pass@1"] == [(1, 0.5), (3, 0.75)]
    assert "kl" not in series(rows)


def test_tensorboard_reads_back_every_name_and_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = series(write_run(tmp_path, TrackersConfig(tensorboard=True)))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(key)] == points, key


def read_wandb_records(path: Path) -> list:
    """Every record of a `.wandb` transaction log: a 7-byte header (`:W&B`, magic, version),
    then LevelDB-log blocks of 32 KiB: records of [crc32 (4), length (2), type (1), data],
    a record split across blocks as FIRST/MIDDLE/LAST pieces. wandb 0.31 ships no Python
    reader (its Go core writes the file), so this follows the format; the CRC is checked."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pieces, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            break
        piece = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(piece, zlib.crc32(bytes([kind]))) == crc, f"bad CRC at byte {pos}"
        pos += 7 + length
        pieces += piece
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def wandb_item(item) -> tuple[str, object]:
    """(name, value) of a history or config item: the core writes a logged key as a
    one-element `nested_key` (`["reward/mean"]`), the Python side as `key`."""
    assert item.key or len(item.nested_key) == 1, item
    return item.key or item.nested_key[0], json.loads(item.value_json)


def test_wandb_offline_reads_back_every_name_step_and_param(tmp_path):
    wandb = pytest.importorskip("wandb")
    try:
        rows = write_run(tmp_path, TrackersConfig(wandb=True))
    finally:
        wandb.teardown()  # stop the wandb-core service this test started
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = read_wandb_records(log)
    kinds = [r.WhichOneof("record_type") for r in records]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("async-grpo", tmp_path.name)
    history = [  # W&B's own columns (`_step`, `_runtime`, `_timestamp`) left out
        {name: value for name, value in map(wandb_item, r.history.item) if name[0] != "_"}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    # One W&B row per JSONL row, in order, with the JSONL's own names and its step column.
    assert history == [{k: v for k, v in row.items() if v is not None} for row in rows]
    assert series(history) == series(rows)
    config = dict(
        wandb_item(u)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for u in r.config.update
    )
    assert {k: config[k] for k in PARAMS} == PARAMS
    assert "exit" in kinds  # the run was finished


def test_mlflow_file_store_reads_back_every_name_step_and_param(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # restored after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the sink must set it for a file store
    expected = series(write_run(tmp_path, TrackersConfig(mlflow=True)))
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("async-grpo").experiment_id])
    assert (run.info.run_name, run.info.status) == (tmp_path.name, "FINISHED")
    assert set(run.data.metrics) == {mlflow_key(k) for k in expected}
    assert "eval/pass_at_1" in run.data.metrics  # the one renamed name
    for key, points in expected.items():
        history = client.get_metric_history(run.info.run_id, mlflow_key(key))
        assert sorted((m.step, m.value) for m in history) == sorted(points), key
    assert run.data.params == {
        "model": "m",
        "trainer.lr": "1e-06",
        "trainer.max_steps": "3",
        "pass_k": "[1, 2]",
        "x": "y" * 497 + "...",
    }


def test_a_tracker_that_cannot_open_fails_loud(tmp_path):
    pytest.importorskip("mlflow")
    with pytest.raises(Exception, match="nosuch://x"):
        MetricsWriter(tmp_path, TrackersConfig(mlflow=True, mlflow_uri="nosuch://x"))


def test_mlflow_names_and_params():
    assert mlflow_key("eval/pass@16") == "eval/pass_at_16"
    assert mlflow_key("reward/countdown/format_reward") == "reward/countdown/format_reward"
    assert mlflow_key("time/weight_push") == "time/weight_push"
    assert mlflow_key("a<b>=c") == "a_b__c"
    assert flatten_params({"a": {"b": {"c": None}, "d": {}}, "e": True, "f@k": "s"}) == {
        "a.b.c": "null",
        "a.d": "{}",
        "e": "true",
        "f_at_k": "s",
    }


def test_missing_tracker_packages_are_one_warning_each(tmp_path, capsys, monkeypatch):
    for module in ("torch.utils.tensorboard", "wandb", "mlflow", "mlflow.tracking"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails
    trackers = TrackersConfig(tensorboard=True, wandb=True, mlflow=True)
    with MetricsWriter(tmp_path, trackers) as w:
        assert w.sinks == []
        for step, row in ROWS:
            w.log(step, row)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 + 3  # the NaN warning, one line per tracker
    for key, package in [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow-")]:
        (line,) = [x for x in lines if f"trackers.{key} is on" in x]
        assert f"the {package}" in line and INSTALL_HINT in line
    assert len(read_metrics(tmp_path / METRICS_FILE)) == len(ROWS)
    assert not (tmp_path / "tensorboard").exists()


class Recording(MetricsSink):
    """A sink that keeps what it is given (stands in for a tracker that works)."""

    name = "recording"
    where = "memory"

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.params: list[dict] = []
        self.closed = 0

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.rows.append({"step": step, **scalars})

    def log_params(self, params: dict) -> None:
        self.params.append(params)

    def close(self) -> None:
        self.closed += 1


class Broken(Recording):
    """A tracker whose store fails on the second row."""

    name = "broken"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.rows:
            raise OSError("disk full")
        super().log(step, scalars)


def test_a_sink_that_raises_is_turned_off_and_the_jsonl_keeps_every_row(tmp_path, capsys):
    broken, working = Broken(), Recording()
    w = MetricsWriter(tmp_path)
    w.sinks = [broken, working]
    w.write_params({"lr": 1e-6, "path": tmp_path})
    for step, row in ROWS:
        w.log(step, row)
    w.close()
    w.close()
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert len(rows) == len(ROWS)
    assert working.rows == [{k: v for k, v in r.items() if v is not None} for r in rows]
    assert working.params == broken.params == [{"lr": 1e-6, "path": str(tmp_path)}]
    assert broken.rows == working.rows[:1]
    assert (w.sink_errors, w.sinks, broken.closed, working.closed) == (1, [], 1, 1)
    err = capsys.readouterr().err
    assert err.count("metrics sink broken: log raised OSError('disk full')") == 1
    assert err.count("warning") == 2  # that one, and the NaN written as null
