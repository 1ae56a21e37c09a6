"""`models.in_dtype`: the weights a bf16 engine loads are stored in bf16 (a copy made once
in the cache), so vLLM loads them as they are instead of casting and warning per tensor."""

from __future__ import annotations

import torch
from _tiny import tiny_llama
from safetensors.torch import load_file

from async_grpo.models import in_dtype


def test_bf16_copy_is_the_cast_and_is_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_GRPO_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "model"
    tiny_llama(seed=2).save_pretrained(src)
    assert in_dtype(src, "float32") == src.resolve()  # already stored so: the folder itself
    copy = in_dtype(src, "bfloat16")
    assert copy != src.resolve() and (copy / "config.json").is_file()
    want, got = load_file(src / "model.safetensors"), load_file(copy / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    made = (copy / "model.safetensors").stat().st_mtime_ns
    assert in_dtype(src, "bfloat16") == copy  # reused, not written again
    assert (copy / "model.safetensors").stat().st_mtime_ns == made
    assert in_dtype(copy, "bfloat16") == copy  # a bf16 folder is used as it is
