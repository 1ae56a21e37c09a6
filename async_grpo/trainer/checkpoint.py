"""Checkpoints: an HF folder (loadable by transformers and vLLM) + exact-resume state.

Layout: OUTPUT_DIR/checkpoints/step_N/{hf/, dcp/, pending_groups.json,
trainer_state.json}; a LoRA run (`trainer.lora`) saves `adapter/` (PEFT's folder, whose
config names the base model) instead of `hf/`, and its `dcp/` holds the adapters alone, and OUTPUT_DIR/checkpoints/latest naming the newest complete one.
`trainer_state.json` is written last, so a checkpoint without it is incomplete and never
resumed from. The sampler needs no state of its own: step N draws prompts N*q .. N*q+q-1.
`pending_groups.json` holds the groups already generated for steps >= N (asynchronous runs
generate ahead), which the resumed run trains on instead of generating them again.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from async_grpo.errors import UserError

STATE_FILE = "trainer_state.json"
PENDING_FILE = "pending_groups.json"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}"


def weights_dir(path: Path) -> Path:
    """The folder a worker loads a checkpoint from: its adapter, or its HF model."""
    adapter = Path(path) / "adapter"
    return adapter if adapter.is_dir() else Path(path) / "hf"


def _options(policy: Any) -> Any:
    """Under LoRA the frozen base is left out of the state (it is the model's files)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = getattr(policy, "lora", None) is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _model_and_optim(policy: Any, opt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The resumable state; under LoRA the adapters alone (a tied head comes back from
    `get_state_dict` though frozen: it is the base's, so it is left out)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from async_grpo.adapters import is_adapter

    model_sd, optim_sd = get_state_dict(policy, opt, options=_options(policy))
    if getattr(policy, "lora", None) is not None:
        model_sd = {k: v for k, v in model_sd.items() if is_adapter(k)}
    return model_sd, optim_sd


def save(
    output_dir: str,
    step: int,
    policy: Any,
    opt: Any,
    sched: Any,
    full_state: dict[str, Any],
    tokenizer_dir: str,
    rank: int,
    counters: dict[str, Any] | None = None,
    pending: dict[int, Any] | None = None,
) -> Path:
    """Collective: every rank writes its shard; rank 0 writes the HF folder and the state
    (step, scheduler and the trainer's running `counters`)."""
    import torch.distributed.checkpoint as dcp

    path = checkpoint_dir(output_dir, step)
    model_sd, optim_sd = _model_and_optim(policy, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    if rank == 0:
        from transformers import AutoTokenizer

        if getattr(policy, "lora", None) is not None:
            from async_grpo.adapters import write_adapter

            write_adapter(path / "adapter", full_state, policy.adapter_config, tokenizer_dir)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path / "adapter")
        else:
            policy.hf.save_pretrained(path / "hf", state_dict=full_state)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path / "hf")
        if pending:
            groups = {
                str(s): [None if g is None else [asdict(x) for x in g] for g in slots]
                for s, slots in pending.items()
            }
            (path / PENDING_FILE).write_text(json.dumps(groups))
        state = {"step": step, "policy_version": step, "scheduler": sched.state_dict()}
        state |= counters or {}
        tmp = path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path / STATE_FILE)
        latest = path.parent / "latest"
        (path.parent / "latest.tmp").write_text(path.name)
        os.replace(path.parent / "latest.tmp", latest)
    dist.barrier()
    return path


def find_resume(output_dir: str, resume: str) -> Path:
    """`resume` is "latest" (the newest complete checkpoint of OUTPUT_DIR) or a step dir."""
    if resume == "latest":
        latest = Path(output_dir) / "checkpoints" / "latest"
        if not latest.is_file():
            raise UserError(f"--resume: no checkpoint in {latest.parent}")
        path = latest.parent / latest.read_text().strip()
    else:
        path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(f"--resume: {path} is not a complete checkpoint (no {STATE_FILE})")
    return path


def load(path: Path, policy: Any, opt: Any, sched: Any) -> dict[str, Any]:
    """Restore model, optimizer and scheduler in place (collective); returns the saved
    state (`step` and the counters)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    options = _options(policy)
    model_sd, optim_sd = _model_and_optim(policy, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        policy,
        opt,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    info = json.loads((path / STATE_FILE).read_text())
    sched.load_state_dict(info["scheduler"])
    return info


def load_pending(path: Path) -> dict[int, list[Any]]:
    """The groups a checkpoint kept for the steps after it ({} if it kept none)."""
    from async_grpo.batcher.types import ScoredSample

    file = Path(path) / PENDING_FILE
    if not file.is_file():
        return {}
    raw = json.loads(file.read_text())
    return {
        int(s): [None if g is None else [ScoredSample(**x) for x in g] for g in slots]
        for s, slots in raw.items()
    }
