"""async-grpo: asynchronous GRPO training on Ray.

In: a YAML config (configs/), prompts as JSONL (sample-data/), a Hugging Face model folder.
Out: checkpoints, `training_metrics.jsonl` and plots under the run's output directory.
The parts map one-to-one onto the processes in docs/architecture.md.
"""

__version__ = "0.1.0"
