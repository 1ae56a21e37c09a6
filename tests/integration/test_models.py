"""The prepared SmolLM2 folder loads and generates in transformers and in vLLM."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from async_grpo.models import prepare_smollm2

pytestmark = pytest.mark.integration


def test_prepare_is_idempotent(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2() == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_cli_prints_the_folder(smollm2_dir):
    r = subprocess.run(
        [sys.executable, "-m", "async_grpo.cli", "prepare-model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == str(smollm2_dir)


def test_transformers_generates(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text


@functools.cache  # where `auto` is float32 the two tests below share one engine start
def _vllm_greedy(model_dir, dtype: str) -> dict:
    script = Path(__file__).with_name("vllm_smoke.py")
    r = subprocess.run(
        [sys.executable, str(script), str(model_dir), dtype],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _hf_logprobs(model_dir, prompt_ids, completion_ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from async_grpo.core.logprobs import batch_logprobs
    from async_grpo.core.packing import PackInput, pack

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n = len(completion_ids)
    batch = pack([PackInput(prompt_ids, completion_ids, 0.0, [0.0] * n)])
    with torch.no_grad():
        return batch_logprobs(model, batch)[0][batch.loss_mask]


def test_vllm_generates_what_the_trainer_scores(smollm2_dir):
    """What holds on every CPU kind: in fp32, vLLM's greedy answer names Paris and its
    per-token log-probs equal the trainer's (transformers, packed) for the same tokens.
    (A bf16 greedy answer is a near tie on some CPUs: "Paris" vs "L'Étoile" flipped by
    rounding, first-token log-probs -1.88 vs -1.83.)"""
    out = _vllm_greedy(smollm2_dir, "float32")
    assert "Paris" in out["text"]
    assert len(out["logprobs"]) == len(out["token_ids"]) > 0
    hf = _hf_logprobs(smollm2_dir, out["prompt_ids"], out["token_ids"])
    vllm = torch.tensor(out["logprobs"])
    assert (hf - vllm).abs().max() < 2e-3, (hf - vllm).abs().max()


def test_vllm_in_the_auto_dtype_scores_like_the_trainer(smollm2_dir):
    """In this machine's `auto` dtype (bf16 only where native) vLLM's log-probs of its own
    greedy completion stay within that dtype's rounding of the fp32 trainer's."""
    from async_grpo.precision import resolve_dtype

    dtype = resolve_dtype("auto", "cpu").dtype
    out = _vllm_greedy(smollm2_dir, dtype)
    hf = _hf_logprobs(smollm2_dir, out["prompt_ids"], out["token_ids"])
    vllm = torch.tensor(out["logprobs"])
    tol = 2e-3 if dtype == "float32" else 0.25  # bf16: 8 mantissa bits through 30 layers
    assert (hf - vllm).abs().mean() < tol / 2 and (hf - vllm).abs().max() < 2 * tol, (
        dtype,
        (hf - vllm).abs().max(),
    )
