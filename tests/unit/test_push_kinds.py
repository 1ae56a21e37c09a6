"""Push kinds are one class each, picked in one place, the same class on both sides: the
trainer's payloads name theirs, the worker and the engine pick it by that name (the pushes
themselves cross real engines in tests/integration/test_lora_serving.py and
test_model_families_engine.py)."""

from __future__ import annotations

import pytest

from async_grpo.inference.push_kinds import kind_of_folder, push_kind
from async_grpo.inference.push_kinds.select import KINDS
from async_grpo.trainer import payloads


def test_each_payload_names_a_kind_the_receivers_pick_by_name():
    classes = [payloads.FullWeights, payloads.AdapterOnly, payloads.MergedAdapter]
    assert {c.kind.name for c in classes} == set(KINDS) == {"weights", "adapter"}
    for c in classes:
        assert type(push_kind(c.kind.name)) is c.kind


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown push kind 'int8'.*adapter.*weights"):
        push_kind("int8")


def test_a_checkpoint_folder_is_served_as_the_kind_it_holds(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    assert kind_of_folder(str(tmp_path / "hf")).name == "weights"
    assert kind_of_folder(str(adapter)).name == "adapter"


def test_an_adapter_push_is_refused_by_an_engine_without_lora_serving():
    class Worker:
        worker_id, lora = "gen-0", None

    push_kind("weights").check_worker(Worker())
    with pytest.raises(RuntimeError, match="gen-0: the trainer pushes LoRA adapters"):
        push_kind("adapter").check_worker(Worker())
