"""The prepared SmolLM2 folder loads and generates in transformers. (That vLLM serves it and
scores as the trainer does: test_weight_transports.py in fp32, test_inference_pools.py in
this machine's `auto` dtype, on their pools' engines.)"""

import subprocess
import sys

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
