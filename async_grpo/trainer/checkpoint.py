"""Checkpoints: an HF folder (loadable by transformers and vLLM) + exact-resume state.

Layout: OUTPUT_DIR/checkpoints/step_N/{hf/, dcp/, pending_groups.json,
trainer_state.json}; a LoRA run (`trainer.lora`) saves `adapter/` (PEFT's folder, whose
config names the base model: a prepared model's name or an absolute path) instead of
`hf/`, and its `dcp/` holds the adapters alone; OUTPUT_DIR/checkpoints/latest names the
newest complete one. `trainer_state.json` is written last, so a checkpoint without it is
incomplete and never resumed from; it records the LoRA settings (`lora`, null for full
fine-tuning), and a resume with other settings is refused. A step's folder is written
from empty: nothing of an earlier checkpoint of that step stays beside it. A new run
(no `--resume`) refuses an OUTPUT_DIR that holds checkpoints. The sampler needs no state
of its own: step N draws prompts N*q .. N*q+q-1. `pending_groups.json` holds the groups
already generated for steps >= N (asynchronous runs generate ahead), which the resumed run
trains on instead of generating them again.
"""

from __future__ import annotations

import json
import os
import shutil
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
    (step, scheduler, the LoRA settings and the trainer's running `counters`). An earlier
    checkpoint of the same step (a resumed run passing it again) is removed first, so no
    file of it (an `adapter/` beside a new `hf/`, its pending groups) is read as this one's."""
    import torch.distributed.checkpoint as dcp

    path = checkpoint_dir(output_dir, step)
    if rank == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier()  # no rank writes into the folder before it is empty
    model_sd, optim_sd = _model_and_optim(policy, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    if rank == 0:
        from async_grpo.models import load_tokenizer

        if getattr(policy, "lora", None) is not None:
            from async_grpo.adapters import base_model_record, write_adapter

            base = base_model_record(tokenizer_dir)
            write_adapter(path / "adapter", full_state, policy.adapter_config, base)
            load_tokenizer(tokenizer_dir).save_pretrained(path / "adapter")
        else:
            policy.hf.save_pretrained(path / "hf", state_dict=full_state)
            load_tokenizer(tokenizer_dir).save_pretrained(path / "hf")
        if pending:
            groups = {
                str(s): [None if g is None else [asdict(x) for x in g] for g in slots]
                for s, slots in pending.items()
            }
            (path / PENDING_FILE).write_text(json.dumps(groups))
        state = {"step": step, "policy_version": step, "scheduler": sched.state_dict()}
        state["lora"] = policy_lora_settings(policy)
        state |= counters or {}
        tmp = path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path / STATE_FILE)
        latest = path.parent / "latest"
        (path.parent / "latest.tmp").write_text(path.name)
        os.replace(path.parent / "latest.tmp", latest)
    dist.barrier()
    return path


def policy_lora_settings(policy: Any) -> dict[str, Any] | None:
    """The LoRA settings of a built policy (`adapters.lora_settings`), None without LoRA."""
    from async_grpo.adapters import lora_settings

    lora = getattr(policy, "lora", None)
    return None if lora is None else lora_settings(lora, policy.hf)


def saved_lora_settings(path: Path) -> dict[str, Any] | None:
    """The LoRA settings a checkpoint was saved with (None: full fine-tuning). A checkpoint
    written before they were recorded gives what its adapter folder holds (no modules)."""
    from async_grpo.adapters import is_adapter_dir, read_adapter_config

    state = json.loads((Path(path) / STATE_FILE).read_text())
    if "lora" in state:
        return state["lora"]
    if not is_adapter_dir(Path(path) / "adapter"):
        return None
    config = read_adapter_config(Path(path) / "adapter")
    return {"rank": config["r"], "alpha": config["lora_alpha"], "dropout": config["lora_dropout"]}


def lora_change(path: Path, saved: dict[str, Any] | None, now: dict[str, Any] | None) -> str | None:
    """One line saying how `now` (this run's LoRA settings) differs from `saved` (the
    checkpoint's), or None where a resume keeps the same function."""
    if saved is None and now is None:
        return None
    again = "resume with the settings it was saved with, or start a new run in another output_dir"
    if saved is None:
        what = f"it trained every weight; this run trains LoRA adapters (rank {now['rank']})"
        return f"--resume: {path}: {what}; {again}"
    if now is None:
        what = f"it trained LoRA adapters (rank {saved['rank']}); this run trains every weight"
        return f"--resume: {path}: {what}; {again}"
    diffs = [
        f"{key} {saved[key]} -> {now[key]}"
        for key in ("rank", "alpha", "dropout")
        if key in saved and saved[key] != now[key]
    ]
    old, new = saved.get("target_modules"), now["target_modules"]
    if old is not None and sorted(old) != sorted(new):
        diffs.append(f"target_modules {_modules(old)} -> {_modules(new)}")
    if not diffs:
        return None
    return (
        f"--resume: {path} was saved with other trainer.lora settings ({'; '.join(diffs)}); {again}"
    )


def _modules(names: list[str]) -> str:
    """Adapted modules, short: their distinct last names, and how many there are."""
    short = sorted({n.rpartition(".")[2] for n in names})
    return f"[{', '.join(short)}] ({len(names)} modules)"


def refuse_reuse(output_dir: str | Path, resume: str | None) -> None:
    """A new run (no `--resume`) writes its checkpoints into a folder that holds none: an
    earlier run's `step_N/` would otherwise sit beside (or under) this run's, and `eval`,
    `export`, `--resume` and late-joining workers would read it as this run's."""
    folder = Path(output_dir) / "checkpoints"
    if resume or not folder.is_dir():
        return
    steps = sorted((p.name for p in folder.glob("step_*")), key=lambda n: (len(n), n))
    if steps or (folder / "latest").exists():
        names = ", ".join(steps[-3:]) if steps else "latest"
        raise UserError(
            f"output_dir {output_dir} already holds an earlier run's checkpoints ({folder}:"
            f" {names}); pass --resume to continue or choose another output_dir"
        )


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
    state (`step` and the counters). A checkpoint of other LoRA settings, or whose model
    state holds other tensors than the policy's, is refused (`UserError`): under LoRA the
    load is not strict (the frozen base is not in the state), so a tensor the policy lacks
    would otherwise be dropped unsaid."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    change = lora_change(path, saved_lora_settings(path), policy_lora_settings(policy))
    if change:
        raise UserError(change)
    options = _options(policy)
    model_sd, optim_sd = _model_and_optim(policy, opt)
    saved = {
        k.removeprefix("model.")
        for k in dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
        if k.startswith("model.")
    }
    if saved != set(model_sd):
        extra, missing = sorted(saved - set(model_sd)), sorted(set(model_sd) - saved)
        raise UserError(
            f"--resume: {path} holds other model tensors than this policy: {len(extra)} it"
            f" lacks ({', '.join(extra[:2])}), {len(missing)} missing ({', '.join(missing[:2])})"
        )
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
