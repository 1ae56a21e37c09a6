"""The family matrix, trainer side: for each family's tiny random model (async_grpo/
model_families.py), and for the real Gemma 3 270M, the trainer's load equals transformers' own `from_pretrained` in every
parameter and buffer, and its fp32 log-probs on a packed row, prompts shared or not, are
as close to transformers' fp64 forward of each sequence alone as transformers' own fp32
forward is (the bound is measured on the machine that runs the test, never carried over
from another CPU kind). The sequences are longer than the families' sliding windows. (Engine side, after a push: tests/integration.)"""

from __future__ import annotations

import pytest
import torch
from _dist import one_rank_group

from async_grpo.config import LossConfig, TrainerConfig
from async_grpo.core.attention.flex import FlexAttention
from async_grpo.core.packing import PackInput, pack
from async_grpo.model_families import FAMILIES, FLEX_REFUSED, WINDOW, make_family_model
from async_grpo.preflight.family import check_samples
from async_grpo.trainer.model import build_policy

TEMPERATURE = 0.9
REAL = "gemma3-270m"  # real weights (models.prepare_model), beside the tiny random models
MATRIX = [*FAMILIES, REAL]
FLEX_CASES_REFUSED = {(f, "flex") for f in FLEX_REFUSED}


@pytest.fixture(scope="module")
def gloo_world():
    with one_rank_group("gloo"):
        yield


class _Dirs(dict):
    """The tiny families' folders; the real model's is prepared (once, cached) when asked."""

    def __missing__(self, name: str):
        from async_grpo.models import prepare_model

        self[name] = prepare_model(name)
        return self[name]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("families")
    return _Dirs({f: make_family_model(f, root / f, smollm2_dir, seed=1) for f in FAMILIES})


def _reference(model_dir, dtype=torch.float32):
    """transformers' own eager forward; in fp64 its experts loop (grouped_mm has no fp64)."""
    from transformers import AutoModelForCausalLM

    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", **experts
    ).eval()


_truth: dict[str, tuple[list[torch.Tensor], float]] = {}


def _fp64_truth(model_dir, samples) -> tuple[list[torch.Tensor], float]:
    """Each sample's log-probs from transformers' fp64 forward, alone, and the bound a fp32
    forward is held to on this machine: 4x how far transformers' own fp32 forward lands
    from them (at least 1e-5). On the real model's 18 layers that spread is 2-8e-5 for
    random tokens near -19 nats; a mask that leaks or drops keys is off by tenths of a nat."""
    key = str(model_dir)
    if key not in _truth:
        fp64, fp32 = _reference(model_dir, torch.float64), _reference(model_dir)
        truth = [_alone(fp64, s).float() for s in samples]
        spread = max(
            (_alone(fp32, s) - t).abs().max().item() for s, t in zip(samples, truth, strict=True)
        )
        _truth[key] = truth, max(4 * spread, 1e-5)
        del fp64
    return _truth[key]


def _policy(model_dir, attention=None):
    cfg = TrainerConfig(
        compute_dtype="float32", loss=LossConfig(temperature=TEMPERATURE), logprob_chunk_size=7
    )
    return build_policy(str(model_dir), cfg, torch.device("cpu"), 1, attention)


def _samples(vocab: int) -> list[PackInput]:
    """The start-up check's row: two groups of two samples, longer than the window."""
    out = check_samples(vocab)
    assert max(len(s.prompt_ids) + len(s.completion_ids) for s in out) > WINDOW + 12
    return out


def _alone(model, s: PackInput) -> torch.Tensor:
    """transformers' log-probs of `s`'s completion, the sequence on its own."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1]  # [C, V]
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp.gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]  # [C]


@pytest.mark.parametrize("family", MATRIX)
def test_load_equals_transformers(gloo_world, family_dirs, family):
    """Every parameter and buffer (rotary tables of each kind, embedding scales) after the
    trainer's sharded load is what `from_pretrained` gives; nothing loaded is re-drawn."""
    reference = _reference(family_dirs[family])
    policy = _policy(family_dirs[family])
    ours = {n.removeprefix("hf."): t for n, t in policy.named_parameters()}
    ours |= {n.removeprefix("hf."): t for n, t in policy.named_buffers()}
    theirs = dict(reference.named_parameters()) | dict(reference.named_buffers())
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        mine = ours[name]
        mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
        assert torch.equal(mine.detach(), tensor.detach()), name


@pytest.mark.parametrize("share_prompts", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize(
    ("family", "backend"),
    [(f, b) for f in FAMILIES for b in ("dense", "flex") if (f, b) not in FLEX_CASES_REFUSED]
    + [(REAL, "dense")],
)
def test_packed_logprobs_equal_each_sequence_alone(
    gloo_world, family_dirs, family, share_prompts, backend
):
    """Dense SDPA (the CPU trainer) and flex_attention's BlockMask (forward only on CPU:
    the log-prob workers; the CUDA trainer's kernel) on the same row."""
    attention = FlexAttention(max_tokens=256) if backend == "flex" else None
    policy = _policy(family_dirs[family], attention)
    samples = _samples(policy.hf.config.vocab_size)
    truth, tolerance = _fp64_truth(family_dirs[family], samples)
    batch = policy.attention.prepare(pack(samples, share_prompts=share_prompts))
    assert batch.needs_explicit_mask == share_prompts
    with torch.no_grad():
        logp, _ = policy(batch, False)  # [T]
    for i in range(len(samples)):
        mine = logp[(batch.sample_index == i) & batch.loss_mask]  # [C]
        err = (mine - truth[i]).abs().max().item()
        assert err < tolerance, (i, err, tolerance)


@pytest.mark.parametrize("family", MATRIX)
def test_a_push_sends_the_files_tensors_under_their_names(family_dirs, family):
    """What a push puts on the wire for each parameter of the trainer's model is exactly a
    tensor of the model's files, under the file's name (fused experts go back to one
    tensor per expert); a tied head also goes as `lm_head.weight`."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from async_grpo.trainer.payloads import FullWeights

    hf = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32)
    payload = FullWeights(hf)
    with safe_open(str(family_dirs[family] / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
        sent = set()
        for name, shape, index, part in payload.wire:
            tensor = payload.build(index, [payload.params[index][1].detach()])[part]
            assert tuple(tensor.shape) == shape, name
            if name == "lm_head.weight" and name not in stored:
                assert hf.config.tie_word_embeddings
                continue
            assert torch.equal(tensor, f.get_tensor(name)), name
            sent.add(name)
    assert sent == stored


@pytest.mark.parametrize("family", sorted(FLEX_REFUSED))
def test_what_the_flex_path_cannot_compute_is_found_before_ray(family_dirs, family):
    """The start-up check (a small random twin through the trainer's own build, load and
    forward) finds the family the flex path gets wrong, and passes it on the dense path."""
    from transformers import AutoConfig

    from async_grpo.core.attention import DenseAttention
    from async_grpo.preflight.family import family_problem

    config = AutoConfig.from_pretrained(family_dirs[family])
    assert family_problem(config, [DenseAttention()]) is None
    problem = family_problem(config, [FlexAttention(max_tokens=256)])
    assert problem and "flex attention" in problem and family in problem


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_the_start_up_check_passes_the_matrix_and_finds_dropout(family_dirs, family):
    """The twin check passes matrix families; with the trainer's dropout switch undone, GPT-2
    (dropout 0.1 in its config) is found 0.2 nats off: the check runs in training mode."""
    from unittest import mock

    from transformers import AutoConfig

    from async_grpo.core.attention import DenseAttention
    from async_grpo.preflight.family import family_problem

    config = AutoConfig.from_pretrained(family_dirs[family])
    assert family_problem(config, [DenseAttention()]) is None
    if family == "gpt2":
        with (
            mock.patch("async_grpo.trainer.model.without_dropout", lambda c: []),
            mock.patch("async_grpo.trainer.model.drop_no_activations", lambda m: None),
        ):
            problem = family_problem(config, [DenseAttention()])
        assert problem and "differ from transformers'" in problem
