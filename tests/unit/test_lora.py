"""LoRA on the trainer (trainer/lora.py, payloads.py, checkpoint.py): a frozen base with
PEFT's adapters on FSDP2, the step's exact gradient with the base's log-probs as the KL
reference, what a push sends, and adapter-only checkpoints that resume exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _dist import one_rank_group, run_two_ranks
from _tiny import tiny_llama
from _trainer import LOSS, ScriptedBatcher, run_config, samples, trainer
from transformers import AutoModelForCausalLM

from async_grpo import adapters
from async_grpo.adapters import adapter_file_name
from async_grpo.config import LoraConfig, TrainerConfig
from async_grpo.core.logprobs import batch_logprobs
from async_grpo.core.loss import build_loss, loss_counts
from async_grpo.core.packing import pack
from async_grpo.trainer import lora
from async_grpo.trainer.model import _copy_rows, build_policy, full_state_dict

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    """The tiny Llama, with SmolLM2's tokenizer (a checkpoint saves the tokenizer too)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=4).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return str(path)


def _trained_looking(named: list[tuple[str, torch.Tensor]], seed: int = 3) -> None:
    """Give B non-zero values too (as after some steps), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in named:
        if ".lora_B." in name:
            full = torch.randn(p.shape, generator=gen) * 0.05
            with torch.no_grad():
                _copy_rows(p, lambda rows, f=full: f[rows])


def _adapters(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in module.named_parameters() if adapters.is_adapter(n)]


def _reference(model_dir: str, seed: int) -> torch.nn.Module:
    """transformers' own model with PEFT's adapters holding the policy's starting values."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    adapters.inject(model, LORA)
    lora.init_adapters(_adapters(model), seed, _copy_rows)
    _trained_looking(_adapters(model))
    return model


def test_a_lora_policy_starts_as_its_base_and_trains_only_the_adapters(model_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.config.use_cache = False
    batch = pack(samples())
    with torch.no_grad():
        want, _ = batch_logprobs(base, batch, 1.0, 1024, False)
    cfg = TrainerConfig(compute_dtype="float32", lora=LORA)
    with one_rank_group("cpu:gloo"):
        policy = build_policy(model_dir, cfg, CPU, 1)
        with torch.no_grad():
            got, _ = policy(batch, False)
        from async_grpo.trainer.model import build_optimizer

        opt, _ = build_optimizer(policy, cfg)
        trained = {n for n, p in policy.named_parameters() if p.requires_grad}
        names = {n for n, _ in _adapters(policy)}
        held = {p.dtype for n, p in policy.named_parameters() if not adapters.is_adapter(n)}
        bf16 = build_policy(model_dir, replace(cfg, compute_dtype="bfloat16"), CPU, 1)
        bf16_held = {p.dtype for n, p in bf16.named_parameters() if not adapters.is_adapter(n)}
        bf16_adapters = {p.dtype for _, p in _adapters(bf16)}
    assert torch.equal(got, want)  # B starts at zero: the adapted model is the base
    assert trained == names and len(names) == 2 * 3 * 2  # A and B, 3 modules, 2 layers
    assert sum(len(g["params"]) for g in opt.param_groups) == len(names)
    assert held == {torch.float32}
    assert bf16_held == {torch.bfloat16} and bf16_adapters == {torch.float32}


def _step_delta(rank: int, model_dir: str, out: str, world: int = 2) -> None:
    cfg = run_config(out)
    cfg = replace(cfg, trainer=replace(cfg.trainer, lora=LORA))
    tr = trainer(model_dir, cfg, CPU, ScriptedBatcher(samples(), rank, world))
    _trained_looking(_adapters(tr.policy))
    before = {k: v.clone() for k, v in full_state_dict(tr.policy).items()}
    record = tr.step(0)
    after = full_state_dict(tr.policy)
    if rank == 0:
        delta = {k: before[k] - after[k] for k in before}
        torch.save({"delta": delta, "record": record}, Path(out) / "step.pt")


def test_two_rank_lora_step_is_the_whole_batch_gradient_with_the_base_as_reference(
    model_dir, tmp_path
):
    """Two FSDP2 ranks, SGD at lr 1: the adapters move by exactly minus the gradient of
    the whole batch's loss, whose KL reference is the base model (adapters off), computed
    by PEFT on transformers' own model in one process."""
    run_two_ranks(_step_delta, model_dir, str(tmp_path))
    saved = torch.load(tmp_path / "step.pt")

    model = _reference(model_dir, seed=0)
    batch = pack(samples())
    with torch.no_grad(), lora.adapters_off(model):
        ref, _ = batch_logprobs(model, batch, LOSS.temperature, 1024, False)
    batch.ref_logprobs = ref.masked_fill(~batch.loss_mask, 0.0)
    tokens, count = loss_counts(batch, LOSS.mask_truncated)
    logp, ent = batch_logprobs(model, batch, LOSS.temperature, 1024, True)
    loss, m = build_loss(LOSS, 64)(logp, batch, tokens, count, ent, 1)
    loss.backward()
    assert m["kl_sum"] > 0  # the adapters moved the policy off the base
    grads = {adapter_file_name(n): p.grad for n, p in _adapters(model)}
    assert set(grads) == set(saved["delta"])  # the adapters alone are in the state
    for name, g in grads.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        assert (saved["delta"][name] - g).abs().max().item() <= 1e-4 * scale + 1e-7, name
    assert saved["record"]["time/reference"] > 0
    assert saved["record"]["kl"] > 0


def test_a_push_sends_the_adapter_by_peft_names_or_the_merged_weights(model_dir):
    """The adapter payload is PEFT's own saved state (names and values); the merged payload
    is a full model that computes what the adapted policy computes."""
    from peft import get_peft_model, get_peft_model_state_dict

    from async_grpo.trainer.payloads import AdapterOnly, MergedAdapter

    batch = pack(samples())
    with one_rank_group("cpu:gloo"):
        policy = build_policy(model_dir, TrainerConfig(compute_dtype="float32", lora=LORA), CPU, 1)
        _trained_looking(_adapters(policy))
        with torch.no_grad():
            adapted, _ = policy(batch, False)
        sent = {}
        for payload in (AdapterOnly(policy), MergedAdapter(policy)):
            out = {}
            for name, shape, index, part in payload.wire:
                n = payload.sources[index]
                fulls = [p.detach() for _, p in payload.params[index : index + n]]
                out[name] = payload.build(index, fulls)[part].clone()
                assert tuple(out[name].shape) == shape
            sent[payload.kind.name if payload.kind.name == "adapter" else "merged"] = out

    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        adapters.peft_config(LORA),
    )
    peft_model.load_state_dict(
        {k.replace(".weight", ".default.weight"): v for k, v in sent["adapter"].items()},
        strict=False,
    )
    expected = get_peft_model_state_dict(peft_model)
    assert set(expected) == set(sent["adapter"])
    for k, v in expected.items():
        assert torch.equal(v, sent["adapter"][k]), k

    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged.config.use_cache = False
    missing = set(merged.state_dict()) - set(sent["merged"])
    assert missing <= {"lm_head.weight"} or not merged.config.tie_word_embeddings
    merged.load_state_dict(sent["merged"], strict=True)
    with torch.no_grad():
        got, _ = batch_logprobs(merged, batch, 1.0, 1024, False)
    assert (got - adapted).abs().max().item() < 1e-5


def _policy_and_adam(model_dir: str, out: str):
    from async_grpo.trainer.model import build_optimizer

    cfg = replace(run_config(out), trainer=replace(run_config(out).trainer, lora=LORA))
    policy = build_policy(model_dir, cfg.trainer, CPU, 1)
    opt, sched = build_optimizer(policy, cfg.trainer)
    return cfg, policy, opt, sched


def _adam_step(cfg, policy, opt, sched, seed: int) -> None:
    from async_grpo.trainer.loop import Trainer

    tr = Trainer(cfg, policy, opt, sched, ScriptedBatcher(samples(seed), 0, 1), "", CPU)
    tr.step(0)


def test_an_adapter_checkpoint_holds_the_adapters_alone_and_resumes_exactly(model_dir, tmp_path):
    """Save after one Adam step, load into a freshly built policy: the adapters and Adam's
    moments are restored exactly, so the next step gives the same adapters as in the run
    that never stopped; the checkpoint holds no base weight, and PEFT loads its adapter
    folder onto the base model as the policy it came from; `async-grpo export` merges it
    into a model transformers loads that computes the same."""
    from peft import PeftModel

    from async_grpo.export import export_merged
    from async_grpo.trainer import checkpoint

    batch = pack(samples())
    with one_rank_group("cpu:gloo"):
        cfg, policy, opt, sched = _policy_and_adam(model_dir, str(tmp_path))
        _adam_step(cfg, policy, opt, sched, seed=5)
        path = checkpoint.save(
            str(tmp_path), 1, policy, opt, sched, full_state_dict(policy), model_dir, 0
        )
        with torch.no_grad():
            saved_logp, _ = policy(batch, False)
        _adam_step(cfg, policy, opt, sched, seed=6)
        uninterrupted = {k: v.clone() for k, v in full_state_dict(policy).items()}

        cfg, fresh, opt2, sched2 = _policy_and_adam(model_dir, str(tmp_path))
        checkpoint.load(path, fresh, opt2, sched2)
        _adam_step(cfg, fresh, opt2, sched2, seed=6)
        resumed = full_state_dict(fresh)
    assert set(resumed) == set(uninterrupted)
    for k, v in uninterrupted.items():
        assert torch.equal(resumed[k], v), k

    assert checkpoint.weights_dir(path) == path / "adapter" and not (path / "hf").exists()
    dcp_bytes = sum(f.stat().st_size for f in (path / "dcp").iterdir())
    base_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    assert dcp_bytes < base_bytes / 10  # adapters and their moments, no base weight

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, path / "adapter")
    with torch.no_grad():
        got, _ = batch_logprobs(peft_model.base_model.model, batch, LOSS.temperature, 1024, False)
    assert (got - saved_logp).abs().max().item() < 1e-5

    out = export_merged(path, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        got, _ = batch_logprobs(merged, batch, LOSS.temperature, 1024, False)
    assert (got - saved_logp).abs().max().item() < 1e-5
    assert (out / "config.json").is_file() and not (tmp_path / "merged.tmp").exists()


def test_a_bf16_step_with_the_base_as_reference_first(model_dir, tmp_path):
    """bf16 compute, fp32 adapters, a KL term: the step's first forward is the base's (the
    adapters off). The adapters' gradients still reach them in fp32 and the step runs
    (PEFT's own adapter switch made FSDP2 fix bf16 gradients for them: the step raised)."""
    cfg = run_config(str(tmp_path))
    cfg = replace(cfg, trainer=replace(cfg.trainer, lora=LORA, compute_dtype="bfloat16"))
    with one_rank_group("cpu:gloo"):
        tr = trainer(model_dir, cfg, CPU, ScriptedBatcher(samples(), 0, 1))
        _trained_looking(_adapters(tr.policy))
        before = {k: v.clone() for k, v in full_state_dict(tr.policy).items()}
        record = tr.step(0)
        after = full_state_dict(tr.policy)
    assert record["kl"] > 0 and record["grad_norm"] > 0
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_export_refuses_what_it_cannot_merge(model_dir, tmp_path):
    """One line naming what is wrong, before anything is written."""
    from async_grpo.errors import UserError
    from async_grpo.export import export_merged

    with pytest.raises(UserError, match="holds no adapter"):
        export_merged(Path(model_dir), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_tied_head_stays_out_of_the_adapter_state(tmp_path, smollm2_dir):
    """A tied LM head is the frozen embedding: it is neither saved, nor in an adapter
    folder (vLLM refuses an adapter holding `lm_head.weight`)."""
    from transformers import AutoTokenizer

    from async_grpo.trainer.checkpoint import _model_and_optim
    from async_grpo.trainer.model import build_optimizer

    tiny_llama(seed=2, tie_word_embeddings=True).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(tmp_path)
    cfg = TrainerConfig(compute_dtype="float32", lora=LORA)
    with one_rank_group("cpu:gloo"):
        policy = build_policy(str(tmp_path), cfg, CPU, 1)
        opt, _ = build_optimizer(policy, cfg)
        state = full_state_dict(policy)
        model_sd, _ = _model_and_optim(policy, opt)
    assert state and all(".lora_" in k for k in state), sorted(state)[:3]
    assert model_sd and all(adapters.is_adapter(k) for k in model_sd), sorted(model_sd)[:3]


def _meta_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoConfig

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


@pytest.mark.parametrize(
    "targets, named",
    [
        (["lm_head"], "lm_head"),  # the chunked head multiplies by the base weight alone
        (["embed_tokens"], "model.embed_tokens"),
        (["q_proj", "lm_head"], "lm_head"),
    ],
)
def test_adapters_outside_the_decoder_layers_are_refused(model_dir, targets, named):
    """Wherever PEFT would place an adapter outside the decoder layers' linear modules, the
    model is refused (the trainer would never train it): found on the model, not by name."""
    with pytest.raises(ValueError, match="only the decoder layers' linear modules") as e:
        adapters.inject(_meta_model(model_dir), replace(LORA, target_modules=targets))
    assert str(e.value).startswith(f"trainer.lora.target_modules: {named} ")
    hf = _meta_model(model_dir)
    adapters.inject(hf, replace(LORA, target_modules=["all-linear"]))  # every layer's own
    assert len(adapters.adapted_modules(hf)) == 7 * 2


def _save(model_dir: str, out: Path, lora_cfg: LoraConfig | None, step: int = 1) -> Path:
    """A checkpoint of a freshly built policy (LoRA `lora_cfg`, or full fine-tuning)."""
    from async_grpo.trainer import checkpoint
    from async_grpo.trainer.model import build_optimizer

    cfg = TrainerConfig(compute_dtype="float32", lora=lora_cfg or LoraConfig())
    policy = build_policy(model_dir, cfg, CPU, 1)
    opt, sched = build_optimizer(policy, cfg)
    state = full_state_dict(policy)
    return checkpoint.save(str(out), step, policy, opt, sched, state, model_dir, 0)


def test_a_checkpoint_records_its_lora_settings_and_a_resume_with_others_is_refused(
    model_dir, tmp_path
):
    """trainer_state.json records rank, alpha, dropout and the adapted modules as PEFT
    resolved them ([all-linear] and the same modules named one by one are one setting); a
    load into a policy of other settings (alpha rescales the policy; fewer targets would
    drop trained factors, the load not being strict under LoRA) or of the other kind is
    refused in one line naming what differs; the same step saved again by full fine-tuning
    leaves no adapter/ of the earlier one beside its hf/."""
    import json

    from async_grpo.errors import UserError
    from async_grpo.trainer import checkpoint
    from async_grpo.trainer.model import build_optimizer

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_cfg = replace(LORA, target_modules=every, dropout=0.05)
    with one_rank_group("cpu:gloo"):
        path = _save(model_dir, tmp_path, lora_cfg)
        saved = json.loads((path / checkpoint.STATE_FILE).read_text())["lora"]
        hf = _meta_model(model_dir)
        adapters.inject(hf, replace(lora_cfg, target_modules=["all-linear"]))
        assert saved == adapters.lora_settings(replace(lora_cfg, target_modules=["all-linear"]), hf)
        assert saved["rank"] == 4 and saved["alpha"] == 8.0 and saved["dropout"] == 0.05
        assert len(saved["target_modules"]) == 7 * 2
        assert checkpoint.saved_lora_settings(path) == saved

        def refused(other: LoraConfig | None) -> str:
            cfg = TrainerConfig(compute_dtype="float32", lora=other or LoraConfig())
            policy = build_policy(model_dir, cfg, CPU, 1)
            opt, sched = build_optimizer(policy, cfg)
            with pytest.raises(UserError) as e:
                checkpoint.load(path, policy, opt, sched)
            assert "\n" not in str(e.value) and str(path) in str(e.value)
            return str(e.value)

        assert "alpha 8.0 -> 16.0)" in refused(replace(lora_cfg, alpha=16.0))
        narrowed = refused(replace(lora_cfg, target_modules=["q_proj", "v_proj"]))
        assert "target_modules [down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj," in narrowed
        assert "(14 modules) -> [q_proj, v_proj] (4 modules)" in narrowed
        assert "this run trains every weight" in refused(None)

        path = _save(model_dir, tmp_path, None)  # the same step, now full fine-tuning
        assert (path / "hf").is_dir() and not (path / "adapter").exists()
        assert checkpoint.saved_lora_settings(path) is None
        assert "it trained every weight" in refused(lora_cfg)


def test_an_adapter_names_its_base_so_a_copied_checkpoint_evaluates_from_any_folder(
    model_dir, tmp_path, monkeypatch
):
    """The adapter's config names its base by an absolute path (a model given by a relative
    one), or by a prepared model's name when the base is that model's prepared folder (found
    again in the cache of whichever machine reads it): `eval` and `export` find the base of
    a checkpoint copied elsewhere, from another working directory."""
    import shutil

    from async_grpo.evaluation.target import eval_model_dir
    from async_grpo.export import export_merged

    monkeypatch.chdir(Path(model_dir).parent)
    relative = Path(model_dir).name
    with one_rank_group("cpu:gloo"):
        path = _save(relative, tmp_path / "run", LORA)
    config = adapters.read_adapter_config(path / "adapter")
    assert config["base_model_name_or_path"] == str(Path(model_dir).resolve())
    copied = tmp_path / "elsewhere" / "step_1"
    shutil.copytree(path, copied)
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert eval_model_dir(str(copied)) == Path(model_dir).resolve()
    assert (export_merged(copied, tmp_path / "merged") / "model.safetensors").is_file()

    cache = tmp_path / "cache"  # a prepared model: the folder prepare-model leaves
    shutil.copytree(model_dir, cache / "models" / "smollm2-135m")
    from async_grpo.models import _DONE_MARKER

    (cache / "models" / "smollm2-135m" / _DONE_MARKER).write_text("{}")
    monkeypatch.setenv("ASYNC_GRPO_CACHE", str(cache))
    with one_rank_group("cpu:gloo"):
        path = _save(str(cache / "models" / "smollm2-135m"), tmp_path / "prepared", LORA)
    assert adapters.read_adapter_config(path / "adapter")["base_model_name_or_path"] == (
        "smollm2-135m"
    )
    assert eval_model_dir(str(path)) == cache / "models" / "smollm2-135m"


def test_writers_of_one_adapter_folder_at_once_never_meet(tmp_path):
    """The tensor-parallel workers of one engine each write the pushed adapter to the same
    folder: each file goes under a temporary name of its writer's own, then is renamed (with
    one shared temporary name, a writer renamed away the other's file, or installed it half
    written)."""
    import threading

    tensors = {adapter_file_name("model.layers.0.mlp.down_proj.lora_A.default.weight"): (
        torch.randn(4, 128)
    )}  # fmt: skip
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(30):
                adapters.write_adapter(tmp_path / "a", tensors, {"r": 4, "lora_alpha": 8})
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    got, config = adapters.read_adapter(tmp_path / "a")
    assert torch.equal(next(iter(got.values())), next(iter(tensors.values())))
    assert config["r"] == 4 and not list((tmp_path / "a").glob("*.tmp"))
