"""Write docs/configuration.md from the typed config in async_grpo/config.py.

    .venv/bin/python scripts/gen_config_docs.py          # (re)write the page
    .venv/bin/python scripts/gen_config_docs.py --check  # exit 1 if the page is stale

One table per section of `RunConfig` (key as a dotted path, type, default, meaning). A key's
meaning is the trailing `# ...` comment on its line in config.py, else its entry in
`DESCRIPTIONS` below. The script fails when a key has neither, or when `DESCRIPTIONS` holds a
key that is gone or that now has a comment, so the page cannot silently lose a key.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
import sys
import tokenize
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from async_grpo import config as config_module  # noqa: E402
from async_grpo.config import ConfigError, RunConfig  # noqa: E402
from async_grpo.preflight.settings import load_config  # noqa: E402

OUT = REPO / "docs" / "configuration.md"

# Meanings of the keys whose line in config.py carries no comment.
DESCRIPTIONS: dict[str, str] = {
    "generation.weight_transport": "`broadcast`: this worker takes pushes over the broadcast"
    " group even on the trainer's node (e.g. a container that does not share the trainer's"
    " `/dev/shm`); `auto`: the trainer chooses (see [weight-sync.md](weight-sync.md))",
    "generation.cpu_linear": "CPU engines' linear layers: `onednn` (vLLM's choice) repacks"
    " each weight for oneDNN, and a push rebuilds, loads and repacks every layer; `torch`"
    " keeps plain weights that a push writes in place, about 10x faster, but decodes 10-30%"
    " slower (measured on AVX2, `bench/engine_linear.py`; docs/weight-sync.md)",
    "generation.weight_update": "how a push meets running requests: `wait` lets them finish"
    " on the old weights first; `in_flight` freezes them, swaps the weights, recomputes"
    " their KV under the new ones and goes on, each token labelled with the version that"
    " sampled it (docs/weight-sync.md)",
    "trainer.weight_transport": "how pushed weights reach each generation worker: `auto`"
    " picks shared memory (same node, CPU), CUDA IPC (same GPU) or the broadcast group"
    " (elsewhere), per worker; `broadcast`, `shm`, `cuda_ipc` force one (an error where the"
    " placement cannot use it). See [weight-sync.md](weight-sync.md)",
    "data": "the prompts: a JSONL, JSON, Parquet or CSV file, a folder of parquet shards, or"
    " a folder written by `Dataset.save_to_disk`, read by the `datasets` library (columns"
    " as `dataset` says; [data.md](data.md)); every row is checked at start-up, and a prompt"
    " without token ids is tokenized as `prompt_format` says when it is drawn",
    "prompt_format": "`chat`: each prompt is a user turn (or its list of messages) in the"
    " model's chat template (a model without one is refused at start-up); `plain`: the text"
    " as it is, for base models (R1-Zero-style prompts); message prompts are refused",
    "output_dir": "where `training_params.json`, `training_metrics.jsonl` and"
    " `checkpoints/` go; `--resume` looks here",
    "generation.num_workers": "vLLM engines that `async-grpo run` starts"
    " (`async-grpo worker --num-workers` overrides it)",
    "generation.max_new_tokens": "completion length limit; a completion cut here is"
    " truncated (see `trainer.loss.mask_truncated`)",
    "generation.temperature": "sampling temperature; must equal `trainer.loss.temperature`",
    "generation.top_p": "nucleus sampling threshold (1.0 = off)",
    "generation.dtype": "engine dtype (auto: bf16 where the node computes it natively, else fp32, resolved per worker); weight pushes travel in it",
    "generation.gpu_memory_utilization": "fraction of GPU memory vLLM may take for"
    " weights and KV cache (GPU only)",
    "generation.tensor_parallel_size": "GPUs per engine; each shard joins the weight-sync"
    " group (see [cluster.md](cluster.md))",
    "generation.seed": "vLLM engine seed; per-request sampling seeds come from `batcher.seed`",
    "logprob.num_workers": "reference log-prob workers that `async-grpo run` starts; only"
    " started when `trainer.loss.kl_coef` > 0",
    "logprob.max_tokens_per_batch": "token budget of one packed forward; a longer sample"
    " is refused",
    "logprob.dtype": "dtype of the reference model (auto as for generation)",
    "logprob.threads": "CPU threads per log-prob worker (also what it reserves from Ray)",
    "verifier.num_workers": "verifier actors; each scores in its own sandbox subprocesses",
    "verifier.rewards": "rule reward functions by name ([] with a model reward alone): built-ins `countdown`, `math`, `exact`,"
    " registered names or `module.path:function` ([rewards.md](rewards.md))",
    "verifier.combine": "how several rewards fold into one score",
    "verifier.weights": "weight per reward name, for `combine: weighted` (every reward needs one)",
    "verifier.timeout_s": "wall-clock limit per sample; the scoring subprocess is killed and"
    " the sample scores 0",
    "batcher.questions_per_step": "prompts per optimizer step; a step trains on"
    " questions_per_step x samples_per_question completions",
    "batcher.max_tokens_per_gpu": "token budget (prompt + completion) of one minibatch on"
    " one trainer rank",
    "batcher.seed": "seed of the prompt order, the per-request sampling seeds and the"
    " trainer's torch RNG",
    "trainer.num_ranks": "trainer processes that `async-grpo run` starts; under your own"
    " torchrun the world size decides",
    "trainer.lr": "AdamW learning rate (after warm-up)",
    "trainer.defer_grad_sync": "reduce gradients across ranks once per step, in the backward"
    " of its last minibatch, instead of after every minibatch: fewer reductions, while each"
    " rank holds unsharded gradients during the step (off: sharded gradients throughout)",
    "trainer.warmup_steps": "linear warm-up steps, then the rate stays constant",
    "trainer.max_steps": "optimizer steps of the run; a resumed run continues up to it",
    "trainer.weight_decay": "AdamW weight decay",
    "trainer.grad_clip": "clip the global gradient norm to this value",
    "trainer.device": "`cpu` (gloo) or `cuda` (NCCL): the trainer, the weight-sync group, and"
    " the pools `async-grpo run` starts",
    "trainer.logprob_chunk_size": "positions per chunk of the LM head in the trainer's"
    " log-prob pass; bounds the [chunk, vocab] buffers",
    "trainer.threads": "torch threads per trainer rank",
    "trainer.loss.kl_estimator": "KL estimator against the reference model ([loss.md](loss.md))",
    "trainer.loss.entropy_coef": "weight of the entropy bonus (0 = off)",
    "trainer.loss.aggregation": "how token terms are normalised over the step: DAPO, original"
    " GRPO or Dr.GRPO ([loss.md](loss.md))",
}

INTRO = """\
# Configuration

<!-- Generated by scripts/gen_config_docs.py from async_grpo/config.py: edit those, then run
     `.venv/bin/python scripts/gen_config_docs.py`. -->

A run is one YAML file (`configs/quickstart.yaml` is the CPU default) plus dotted overrides
on the command line; an override wins over the file, and a key left out keeps its default:

```bash
async-grpo run configs/quickstart.yaml trainer.lr=1e-6 batcher.samples_per_question=8
```

Override values are read as YAML: `trainer.loss.dual_clip=null`,
`verifier.rewards=[countdown, exact]`, `generation.enforce_eager=false`. `run`, `train` and
`worker --config FILE` take the same file and overrides: give every process of a run the
same ones. The resolved tree is saved as `OUTPUT_DIR/training_params.json`.

The config is checked before anything starts. An unknown key, a wrong type or a setting that
could not run stops the command with exit code 2 and one line that starts with the key:

```
$ async-grpo run configs/quickstart.yaml {example_override}
async-grpo: error: {example_error}
```

Besides the per-key types, every number must be finite (`nan` and `inf` pass any range
check otherwise) and within its range (counts and rates positive, coefficients and delays
not negative, fractions in (0, 1]), and these combinations are refused: `batcher.samples_per_question` above `generation.max_concurrent_seqs`;
`generation.max_new_tokens` not below `generation.max_model_len`;
`batcher.max_tokens_per_gpu` below `generation.max_model_len`; `trainer.push_every - 1`
above `batcher.max_off_policy_steps`; `trainer.loss.temperature` different from
`generation.temperature`; `verifier.combine: weighted` without a weight for every reward.
At start-up `run` and `train` also refuse a prompt that leaves no room to generate in
`generation.max_model_len` (the line names `FILE:LINE`), and `run` refuses, before Ray
starts: a reward name or `module:function` that does not resolve, `--resume` without a
checkpoint, a model folder that transformers or vLLM cannot load, and chat prompts for a
model without a chat template ([models.md](models.md)).
"""

EXAMPLE_OVERRIDE = "batcher.samples_per_question=128"


def field_comments() -> dict[str, dict[str, str]]:
    """class name -> field name -> the trailing comment on the field's line(s) in config.py."""
    source = Path(inspect.getsourcefile(config_module)).read_text()
    by_line = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = out.setdefault(node.name, {})
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                lines = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                comment = next((by_line[n] for n in lines if n in by_line), "")
                if comment:
                    fields[stmt.target.id] = comment
    return out


def annotation_texts() -> dict[str, dict[str, str]]:
    """class name -> field name -> the annotation as written in config.py."""
    source = Path(inspect.getsourcefile(config_module)).read_text()
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                s.target.id: ast.get_source_segment(source, s.annotation) or ""
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    return out


def yaml_value(value: Any) -> str:
    """A default as one would write it in the YAML file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        if "e" in text:  # 1e-06 -> 1e-6
            mantissa, exp = text.split("e")
            text = f"{mantissa}e{int(exp)}"
        return text
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def sections(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted prefix, dataclass) for the root and every nested section, depth first."""
    out = [(prefix, cls)]
    for f in dataclasses.fields(cls):
        tp = type(default_of(f))
        if dataclasses.is_dataclass(tp):
            out += sections(tp, f"{prefix}{f.name}.")
    return out


def leaf_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every settable key as a dotted path."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = type(default_of(f))
        if dataclasses.is_dataclass(tp):
            keys += leaf_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def example_error() -> str:
    try:
        load_config(None, [EXAMPLE_OVERRIDE])
    except ConfigError as e:
        return str(e)
    raise SystemExit(f"gen_config_docs: {EXAMPLE_OVERRIDE} is no longer refused; pick another")


def render() -> str:
    comments, annotations = field_comments(), annotation_texts()
    comment_keys: set[str] = set()
    missing: list[str] = []
    parts = [INTRO.format(example_override=EXAMPLE_OVERRIDE, example_error=example_error())]
    for prefix, cls in sections():
        rows = []
        for f in dataclasses.fields(cls):
            default = default_of(f)
            if dataclasses.is_dataclass(type(default)):
                continue  # its own section
            key = prefix + f.name
            comment = comments.get(cls.__name__, {}).get(f.name, "")
            if comment:
                comment_keys.add(key)
            meaning = comment or DESCRIPTIONS.get(key, "")
            if not meaning:
                missing.append(key)
            kind = annotations.get(cls.__name__, {}).get(f.name) or str(f.type)
            rows.append(
                f"| `{key}` | `{cell(kind)}` | `{cell(yaml_value(default))}` | {cell(meaning)} |"
            )
        title = prefix.rstrip(".") or "top level"
        doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        parts.append(
            f"## {title}\n\n{doc}\n\n| key | type | default | meaning |\n|---|---|---|---|\n"
            + "\n".join(rows)
            + "\n"
        )
    problems = [f"{k}: no comment in config.py and no entry in DESCRIPTIONS" for k in missing]
    known = set(leaf_keys())
    problems += [
        f"{k}: in DESCRIPTIONS but not a config key" for k in DESCRIPTIONS if k not in known
    ]
    problems += [
        f"{k}: has a comment in config.py; drop its DESCRIPTIONS entry"
        for k in DESCRIPTIONS
        if k in comment_keys
    ]
    if problems:
        raise SystemExit("gen_config_docs: " + "; ".join(problems))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if docs/configuration.md is not up to date"
    )
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(REPO)}")
        return 0
    current = OUT.read_text() if OUT.is_file() else ""
    if current == text:
        return 0
    diff = difflib.unified_diff(
        current.splitlines(), text.splitlines(), "docs/configuration.md", "generated", lineterm=""
    )
    print("\n".join(list(diff)[:60]))
    print(
        "docs/configuration.md differs from async_grpo/config.py:"
        " run `.venv/bin/python scripts/gen_config_docs.py`",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
