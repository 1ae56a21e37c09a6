"""Whether the trainer computes what transformers computes for a model's family, checked
before Ray starts on a small random twin of the model.

A family can differ from the ones the matrix tests in ways no config key names: positions
it computes from the attention mask rather than `position_ids` (GPT-2, OPT), ALiBi (Bloom),
attention sinks a kernel drops, a transform of the logits. So instead of a list of names,
the run builds the model's own config class with its own settings at a small size (2 to 4
layers of width 128, one of each layer type, windows of 16 tokens, 4 experts), draws random
weights, saves it in the family's file layout, loads it with the trainer's own loader and
compares the log-probs of a packed row (prompts shared and not, through each attention
backend the run will use) with transformers' eager forward of each sequence alone.

Random fp32 twins agree to about 1e-6 nats where the family is supported; the failures
seen are 0.09 nats and more. `LIMIT` sits between the two, three orders of magnitude
from each. It takes about a second (bench/model_families.py --check lists the families)."""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from async_grpo.core.model_parts import config_parts
from async_grpo.model_families import WINDOW, random_model  # the window: shorter than the rows

LIMIT = 1e-3  # nats
WIDTH = 128

_SIZES = {  # the names families give their sizes -> the twin's
    "hidden_size": WIDTH, "n_embd": WIDTH, "d_model": WIDTH,
    "intermediate_size": 2 * WIDTH, "ffn_hidden_size": 2 * WIDTH, "n_inner": 2 * WIDTH,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "num_key_value_heads": 1,
    "head_dim": 64, "max_position_embeddings": 512, "n_positions": 512,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "moe_k": 2,
    "kv_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 64,
}  # fmt: skip
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def twin_config(config: Any) -> Any:
    """`config` at the twin's size; every other setting as the model has it."""
    twin = copy.deepcopy(config)
    for part in config_parts(twin):
        _shrink(part)
    return twin


def _shrink(twin: Any) -> None:
    for key, value in _SIZES.items():
        if getattr(twin, key, None) is not None:
            with contextlib.suppress(AttributeError):  # derived from others (Falcon's head_dim)
                setattr(twin, key, value)
    kinds = list(getattr(twin, "layer_types", None) or [])
    distinct = list(dict.fromkeys(kinds))
    layers = max(2, len(distinct))
    if kinds:
        twin.layer_types = [distinct[i % len(distinct)] for i in range(layers)]
    for key in _LAYER_COUNTS:
        if getattr(twin, key, None) is not None:
            setattr(twin, key, layers)
    if getattr(twin, "sliding_window", None):
        twin.sliding_window = WINDOW
    if getattr(twin, "first_k_dense_replace", None):
        twin.first_k_dense_replace = 1


def _twin(config: Any, folder: Path) -> Any:
    """The reference: transformers' eager model of `config` with random weights (norms
    moved off their initial values, so a skipped one shows), saved to `folder` in the
    family's file layout."""
    model = random_model(config, 0, attn_implementation="eager")
    model.save_pretrained(folder)
    return model.eval()


def _trainers_model(folder: Path, attention: Any) -> Any:
    """The model as the trainer builds it: `build_policy` (meta device, FSDP2 on one rank,
    the trainer's own loader) in fp32, in a one-process gloo group of its own; left in
    training mode, as the trainer runs it."""
    import torch
    import torch.distributed as dist

    from async_grpo.config import LossConfig, TrainerConfig
    from async_grpo.trainer.model import build_policy

    cfg = TrainerConfig(
        dtype="float32", compute_dtype="float32", loss=LossConfig(temperature=1.0),
        logprob_chunk_size=7,
    )  # fmt: skip
    if dist.is_initialized():  # inside a process that already has its group
        return build_policy(str(folder), cfg, torch.device("cpu"), 1, attention)
    store = dist.FileStore(str(folder / "group"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return build_policy(str(folder), cfg, torch.device("cpu"), 1, attention)
    finally:
        dist.destroy_process_group()


def check_samples(vocab: int) -> list[Any]:
    """Two groups of two samples (random tokens >= 3), each longer than the twin's window:
    the packed row of the check, and of the family matrix's tests."""
    import torch

    from async_grpo.core.packing import PackInput

    g = torch.Generator().manual_seed(0)
    out = []
    for n_p, n_cs in [(11, (20, 9)), (6, (25, 12))]:
        prompt = torch.randint(3, vocab, (n_p,), generator=g).tolist()
        for n_c in n_cs:
            completion = torch.randint(3, vocab, (n_c,), generator=g).tolist()
            out.append(PackInput(prompt, completion, 1.0, [0.0] * n_c))
    return out


def packed_error(config: Any, attention: Any) -> float:
    """The largest |log p| difference (nats) between the trainer's packed path and
    transformers' forward of each sequence alone, on `config`'s twin."""
    import torch

    from async_grpo.core.packing import pack

    config = twin_config(config)
    with tempfile.TemporaryDirectory(prefix="async-grpo-twin-") as folder:
        # each model its own copy: transformers writes the attention choice into the config
        try:
            reference = _twin(copy.deepcopy(config), Path(folder))
        except Exception as e:
            raise TwinError(e) from e
        ours = _trainers_model(Path(folder), attention)
    samples = check_samples(config.get_text_config().vocab_size)
    worst = 0.0
    with torch.no_grad():
        alone = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = reference(ids, use_cache=False).logits[0, len(s.prompt_ids) - 1 : -1]
            logp = torch.log_softmax(logits.float(), dim=-1)  # [C, V]
            alone.append(logp.gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0])
        for share in (False, True):
            batch = attention.prepare(pack(samples, share_prompts=share))
            logp, _ = ours(batch, False)  # [T]
            for i, want in enumerate(alone):
                got = logp[(batch.sample_index == i) & batch.loss_mask]
                worst = max(worst, (got - want).abs().max().item())
    return worst


def family_problem(config: Any, attentions: list[Any]) -> str | None:
    """None where the trainer is exact on `config`'s family with every backend in
    `attentions`, else what was found (one line). Quiet: the twin's progress bars, warnings
    and log lines are kept off the console, whose refusals are one line."""
    with _quiet():
        return _family_problem(config, attentions)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import io
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stderr(io.StringIO()),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _family_problem(config: Any, attentions: list[Any]) -> str | None:
    kind = getattr(config, "model_type", "?")
    for attention in attentions:
        try:
            err = packed_error(config, attention)
        except TwinError as e:
            return (
                f"model type {kind!r} could not be checked: transformers cannot build a"
                f" small twin of it ({_first_line(e.cause)})"
            )
        except Exception as e:  # any failure of the family's code on this path
            return (
                f"model type {kind!r} fails on the trainer's packed path with"
                f" {attention.name} attention ({_first_line(e)})"
            )
        if not err < LIMIT:
            return (
                f"model type {kind!r}: the trainer's packed log-probs differ from"
                f" transformers' by {err:.2g} nats with {attention.name} attention"
                f" (a small random twin; exact families agree to {LIMIT:g})"
            )
    return None


class TwinError(Exception):
    """transformers could not build the twin itself (before any code of ours ran)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__
