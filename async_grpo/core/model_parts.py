"""Where a Hugging Face causal LM keeps its parts, found from the model itself.

Families name them differently (`model.layers` in Llama, `gpt_neox.layers` with
`embed_out` in GPT-NeoX, `transformer.h` in GPT-2 and Falcon, `model.decoder.layers` in
OPT): the decoder is what the model's own `get_decoder()` returns, its layers the module
list that holds `num_hidden_layers` blocks, the head what `get_output_embeddings()`
returns. No attribute name is assumed."""

from __future__ import annotations

from typing import Any

from torch import nn


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head: returns the last hidden states (after the
    final norm) as `last_hidden_state`."""
    found = model.get_decoder()
    if found is None or found is model:
        raise ValueError(f"{type(model).__name__}: the model names no decoder (get_decoder)")
    return found


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's blocks, in order: the first module list under the decoder with one
    entry per hidden layer."""
    config = model.config.get_text_config() if hasattr(model, "config") else None
    count = getattr(config, "num_hidden_layers", None)
    for module in decoder(model).modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"{type(model).__name__}: no list of {count} decoder layers found")


def output_head(model: nn.Module) -> nn.Linear:
    """The LM head (a linear layer, possibly with a bias)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}: the LM head is {type(head).__name__}, not a linear layer"
        )
    return head


def without_dropout(config: Any) -> list[str]:
    """Set every dropout probability of a Hugging Face `config` (and its text config) to 0,
    before a model is built from it; returns the keys that were not 0. The policy's
    log-probs must be a function of the weights: the sampler's and the reference's are
    computed without dropout, so a family that ships with it (GPT-2 and OPT: 0.1) would
    otherwise train on log-probs 0.2-0.3 nats off. TRL and verl turn it off the same way."""
    changed = []
    for part in config_parts(config):
        for key, value in list(vars(part).items()):
            word = key.lower()
            if ("dropout" in word or "pdrop" in word) and isinstance(value, float) and value:
                setattr(part, key, 0.0)
                changed.append(key)
    return changed


def drop_no_activations(model: nn.Module) -> None:
    """`nn.Dropout` modules of the model itself at p = 0 (a family may hard-code one);
    LoRA's own dropout (`lora_dropout`, a setting of the run) is left as set."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and "lora_dropout" not in name:
            module.p = 0.0


def config_parts(config: Any) -> list[Any]:
    """A Hugging Face config and its text config, each once (the same object for a text
    model; the language part of a multimodal one)."""
    text = config.get_text_config()
    return [config] if text is config else [config, text]
