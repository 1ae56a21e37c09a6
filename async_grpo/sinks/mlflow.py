"""MLflow: a run in a local file store under `output_dir/mlruns`, or at a given URI."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from async_grpo.sinks.base import MetricsSink, warn

MAX_PARAM_CHARS = 500  # older MLflow servers refuse longer param values; 3.x takes 6000
_REFUSED = re.compile(r"[^/\w.\- :]")  # MLflow names: alphanumerics, `_ - . / :` and space


def mlflow_key(name: str) -> str:
    """The MLflow name of a JSONL name: MLflow refuses `@`, so `@` becomes `_at_`
    (`eval/pass@1` -> `eval/pass_at_1`), and any other character it refuses becomes `_`.
    Every name of docs/metrics.md is unchanged (pass@k is `eval/pass_at_k` there too)."""
    return _REFUSED.sub("_", name.replace("@", "_at_"))


def flatten_params(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts as dotted keys (`trainer.lr`), each value a string MLflow keeps: strings
    as they are, anything else as JSON (`1e-06`, `true`, `null`, `[1, 2]`), cut to
    MAX_PARAM_CHARS characters (ending in `...`)."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MAX_PARAM_CHARS:
            text = text[: MAX_PARAM_CHARS - 3] + "..."
        flat[mlflow_key(name)] = text
    return flat


class MlflowSink(MetricsSink):
    """One `log_batch` per row, names through `mlflow_key`, the row's step as MLflow's step
    (MLflow takes steps in any order). Experiment = `project`; a new run each time (a
    resumed run included), named `run_name`.

    `uri` None: a file store in `output_dir/mlruns`, which works offline. MLflow 3 keeps
    that store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE is true,
    so for a `file:` URI this sets it in the process environment (when not set already).
    Uses `MlflowClient`, not the fluent `mlflow.start_run`: no process-wide active run or
    tracking URI is changed. Needs the `mlflow-skinny` (or `mlflow`) package.
    """

    name = "mlflow"

    def __init__(self, output_dir: Path, project: str, run_name: str, uri: str | None) -> None:
        uri = uri or (output_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(project)
        )
        self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        self.uri = uri
        self.where = f"{uri} (experiment {project!r}, run {self.run_id})"
        self._params: dict[str, str] = {}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def log_params(self, params: dict[str, Any]) -> None:
        """The config flattened (`flatten_params`). MLflow params are set once per run: on a
        later call only new keys are logged, and changed values are kept (with a warning)."""
        from mlflow.entities import Param

        flat = flatten_params(params)
        changed = [k for k, v in flat.items() if self._params.get(k, v) != v]
        if changed:
            shown = ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else "")
            warn(f"mlflow: params are set once per run; kept the first value of {shown}")
        new = {k: v for k, v in flat.items() if k not in self._params}
        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in new.items()])
        self._params.update(new)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
