"""On CUDA (skipped elsewhere): one real `Trainer.step` on one NCCL rank (the default
group `cpu:gloo,cuda:nccl` the trainer builds), fp32 compute, equals the whole-batch
gradient computed on the CPU; every collective used a device the group has a backend for.
(On one rank the trainer's own collectives are its host counts; FSDP2's device traffic
goes through functional collectives, which `dist.*` spies do not see.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

pytestmark = pytest.mark.gpu


def test_one_nccl_rank_runs_a_step(tmp_path):
    from _dist import one_rank_group
    from _tiny import tiny_llama
    from _trainer import ScriptedBatcher, run_config, samples, trainer
    from test_trainer_step import COLLECTIVES, _reference

    from async_grpo.trainer.model import full_state_dict
    from async_grpo.trainer.setup import process_group_backend

    model_dir = tmp_path / "tiny"
    tiny_llama(seed=4).save_pretrained(model_dir)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    seen: set[str] = set()
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def spy(name):
        def call(*args, **kwargs):
            for a in [*args, *kwargs.values()]:
                for t in a if isinstance(a, list) else [a]:
                    if isinstance(t, torch.Tensor):
                        seen.add(t.device.type)
            return real[name](*args, **kwargs)

        return call

    backend = process_group_backend("cuda")
    try:
        for name in COLLECTIVES:
            setattr(dist, name, spy(name))
        with one_rank_group(backend):
            cfg = run_config(str(tmp_path), device="cuda")
            tr = trainer(str(model_dir), cfg, device, ScriptedBatcher(samples(), 0, 1))
            before = {k: v.clone() for k, v in full_state_dict(tr.policy).items()}
            record = tr.step(0)
            after = full_state_dict(tr.policy)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    assert seen <= {"cpu", "cuda"} and "cpu" in seen
    assert all(t.device.type == "cuda" for t in tr.policy.parameters())
    ref, _ = _reference(str(model_dir))
    for name, g in ref.items():
        d = before[name] - after[name]
        assert (d - g).abs().max().item() <= 2e-3 * g.abs().max().item() + 1e-6, name
    assert record["grad_norm"] > 0
