"""On CUDA (skipped elsewhere): the families whose attention differs per layer (sliding
windows by layer kind, a window on every layer, attention soft-capping) compute on packed
rows what transformers computes on each sequence alone, with the CUDA trainer's backends:
flex_attention's BlockMask (prompts shared or not) and flash-attn varlen. The CPU side of
the same check, in fp32: tests/unit/test_model_families.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

pytestmark = pytest.mark.gpu
FAMILIES = ["gemma2", "gemma3_text", "mistral"]  # windows of 16 by layer kind / every layer
VOCAB = 512


def _model_dir(tmp_path: Path, family: str) -> Path:
    from transformers import AutoModelForCausalLM

    from async_grpo.model_families import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, VOCAB), dtype=torch.float32)
    model.save_pretrained(tmp_path / family)
    return tmp_path / family


def _samples():
    from async_grpo.core.packing import PackInput

    g = torch.Generator().manual_seed(0)
    out = []
    for n_prompt, lengths in [(30, (60, 25)), (12, (70, 40))]:  # well past the window
        prompt = torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist()
        for n in lengths:
            out.append(
                PackInput(
                    prompt, torch.randint(3, VOCAB, (n,), generator=g).tolist(), 1.0, [0.0] * n
                )
            )
    return out


def packed_equals_alone(model_dir: Path, backend, share: bool, device: str, dtype: str) -> float:
    """Mean |packed - alone| over the completions' log-probs: the packed row through the
    trainer's policy and `backend`, against transformers' eager forward on each sequence."""
    from transformers import AutoModelForCausalLM

    from async_grpo.config import TrainerConfig
    from async_grpo.core.packing import pack
    from async_grpo.trainer.model import build_policy

    cfg = TrainerConfig(dtype="float32", compute_dtype=dtype)
    policy = build_policy(str(model_dir), cfg, torch.device(device), 1, backend)
    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
    ).to(device)
    samples = _samples()
    batch = backend.prepare(pack(samples, share_prompts=share)).to(device)
    with torch.no_grad():
        logp, _ = policy(batch, False)
    errors = []
    for i, s in enumerate(samples):
        mine = logp[(batch.sample_index == i) & batch.loss_mask].float()
        ids = torch.tensor([s.prompt_ids + s.completion_ids], device=device)
        with torch.no_grad():
            logits = reference(ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(s.completion_ids, device=device)[:, None]
        )[:, 0]
        errors.append((mine - want).abs())
    return torch.cat(errors).mean().item()


@pytest.fixture(scope="module")
def nccl_world():
    from _dist import one_rank_group

    torch.cuda.set_device(0)
    with one_rank_group("cpu:gloo,cuda:nccl", timeout_s=120):
        yield


@pytest.mark.parametrize(("name", "share"), [("flex", False), ("flex", True), ("flash", False)])
@pytest.mark.parametrize("family", FAMILIES)
def test_windows_and_softcapping_on_cuda_backends(nccl_world, tmp_path, family, name, share):
    from async_grpo.core.attention import select_attention

    try:
        backend, _ = select_attention(name, "cuda", share, True, 8192)
    except ValueError as e:
        pytest.skip(str(e))
    err = packed_equals_alone(_model_dir(tmp_path, family), backend, share, "cuda", "bfloat16")
    # bf16 rounding keeps the mean near 1e-2 on 2 layers; with the windows (and Gemma-2's
    # soft-capping) dropped, these rows are off by 0.13-0.17 on average (fp32, flex on CPU;
    # this function in fp32 there: 1.6e-7 to 1.9e-7)
    assert err < 2e-2, err
