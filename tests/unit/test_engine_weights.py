"""`models.in_dtype`: the weights a bf16 engine loads are stored in bf16 (a copy made once
in the cache), so vLLM loads them as they are instead of casting and warning per tensor."""

from __future__ import annotations

import os
import time

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


def test_a_copy_another_worker_finished_first_is_kept_not_deleted(tmp_path, monkeypatch):
    """Two workers of a node start at once and both make the copy: the one that finishes
    second keeps the first one's folder (its engine may be loading it) instead of deleting
    it. Here the second worker's copy is interleaved inside the first's."""
    import async_grpo.models as models

    monkeypatch.setenv("ASYNC_GRPO_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "model"
    tiny_llama(seed=2).save_pretrained(src)
    copy, seen = models._copy_in_dtype, {}

    def copy_while_another_worker_finishes(a, b, dtype):
        if not seen:
            seen["first"] = True
            seen["theirs"] = theirs = in_dtype(src, dtype)  # the other worker, first
            seen["inode"] = (theirs / "model.safetensors").stat().st_ino
        copy(a, b, dtype)

    monkeypatch.setattr(models, "_copy_in_dtype", copy_while_another_worker_finishes)
    mine = in_dtype(src, "bfloat16")
    assert mine == seen["theirs"]
    assert (mine / "model.safetensors").stat().st_ino == seen["inode"]  # the same file
    assert not [p for p in mine.parent.iterdir() if p.name.startswith(".")]  # nothing left


def test_a_changed_source_gets_a_copy_of_its_own(tmp_path, monkeypatch):
    """The earlier copy is left as it was: a worker started before the change may still be
    loading it."""
    monkeypatch.setenv("ASYNC_GRPO_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "model"
    tiny_llama(seed=2).save_pretrained(src)
    old = in_dtype(src, "bfloat16")
    made = (old / "model.safetensors").stat()
    tiny_llama(seed=3).save_pretrained(src)  # the source changed: a newer mtime
    os.utime(src / "model.safetensors", ns=(time.time_ns() + 10**9,) * 2)
    new = in_dtype(src, "bfloat16")
    assert new != old
    assert (old / "model.safetensors").stat().st_ino == made.st_ino  # untouched
    want = load_file(src / "model.safetensors")
    got = load_file(new / "model.safetensors")
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
    assert not [p for p in new.parent.iterdir() if p.name.startswith(".")]
