"""Metrics sinks: experiment trackers beside `training_metrics.jsonl`.

In: from `metrics.MetricsWriter`, each row's finite scalars under the JSONL's own names
(`reward/mean`, `eval/pass_at_1`) with its step, and the run's config once. Out: the same
numbers in a tracker's store. One interface (`base.MetricsSink`), one file per tracker:
`tensorboard`, `wandb`, `mlflow`; `select.open_sinks` opens the ones the config turns on
and says which.
"""
