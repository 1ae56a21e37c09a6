from pathlib import Path

import pytest

from async_grpo.config import ConfigError, RunConfig
from async_grpo.preflight.settings import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_exist():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


def _leaves(raw, prefix=()):
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_with_the_values_it_states(path):
    """Every value the YAML file sets arrives in the config unchanged (none dropped,
    renamed or coerced to something else), and the config passes validation."""
    import yaml

    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    leaves = list(_leaves(yaml.safe_load(path.read_text())))
    assert leaves, f"{path.name} sets nothing"
    for keys, value in leaves:
        got = cfg
        for k in keys:  # a free-form mapping (environment.args) is a dict
            got = got[k] if isinstance(got, dict) else getattr(got, k)
        if isinstance(got, tuple):
            got = list(got)
        assert got == value, f"{path.name}: {'.'.join(keys)} is {got!r}, the file says {value!r}"


def test_overrides_are_typed():
    cfg = load_config(
        REPO / "configs/quickstart.yaml",
        [
            "trainer.lr=1e-6",
            "verifier.rewards=[countdown, exact]",
            "trainer.loss.dual_clip=null",
            "generation.max_new_tokens=64",
        ],
    )
    assert cfg.trainer.lr == 1e-6 and isinstance(cfg.trainer.lr, float)
    assert cfg.verifier.rewards == ["countdown", "exact"]
    assert cfg.trainer.loss.dual_clip is None
    assert cfg.generation.max_new_tokens == 64


def test_int_is_accepted_for_float():
    assert load_config(None, ["trainer.lr=1"]).trainer.lr == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1", "trainer.lrr: unknown key"),
        ("trainer.loss.clip_hgh=1", "trainer.loss.clip_hgh: unknown key"),
        ("trainer.max_steps=ten", "trainer.max_steps: expected int, got 'ten'"),
        ("trainer.max_steps=true", "trainer.max_steps: expected int"),
        ("trainer.loss.kl_estimator=k4", "trainer.loss.kl_estimator: expected one of"),
        ("generation=3", "generation: expected a mapping"),
        ("batcher.samples_per_question=100", "batcher.samples_per_question: 100 exceeds"),
        ("generation.max_new_tokens=2000", "generation.max_new_tokens: 2000 leaves no room"),
        ("batcher.max_tokens_per_gpu=100", "batcher.max_tokens_per_gpu: 100 is below"),
        ("trainer.num_ranks=0", "trainer.num_ranks: must be > 0"),
        ("generation.kv_cache_gib=0", "generation.kv_cache_gib: must be > 0"),
        ("verifier.judge.kv_cache_gib=0", "verifier.judge.kv_cache_gib: must be > 0"),
        ("trainer.loss.temperature=0.7", "trainer.loss.temperature: 0.7 differs"),
        ("nonsense", "expected key.path=value"),
        ("trainer.attention=flex", "trainer.attention: 'flex' cannot train on CPU"),
        ("trainer.attention=flash", "trainer.attention: 'flash' cannot train on CPU"),
        ("logprob.attention=flash", "logprob.attention: 'flash' needs CUDA"),
        ("generation.dtype=bf16", "generation.dtype: expected one of"),
        ("trainer.weight_transport=rdma", "trainer.weight_transport: expected one of"),
        ("trainer.weight_transport=cuda_ipc", "trainer.weight_transport: 'cuda_ipc' cannot"),
        ("generation.weight_transport=shm", "generation.weight_transport: expected one of"),
        ("batcher.max_missing_fraction=0", "batcher.max_missing_fraction: must be in"),
        ("generation.top_p=0.9", "generation.top_p: 0.9 makes vLLM report log-probs of the"),
        ("generation.top_p=0", "generation.top_p: must be in"),
        ("trainer.loss.proximal=old", "trainer.loss.proximal: expected one of"),
        ("batcher.spare_groups=-1", "batcher.spare_groups: must be >= 0"),
        ("trainer.loss.objective=grpo", "trainer.loss.objective: expected one of"),
        ("trainer.loss.tis_cap=2", "trainer.loss.tis_cap: unknown key"),
        ("trainer.loss.cispo_cap=0", "trainer.loss.cispo_cap: must be > 0"),
        ("trainer.loss.sapo_tau_neg=0", "trainer.loss.sapo_tau_neg: must be > 0"),
        ("trainer.loss.clip_low=1.5", "trainer.loss.clip_low/clip_high: bad bounds 1.5"),
        ("trainer.loss.correction.floor=0.5", "trainer.loss.correction.floor: only a mask"),
        ("trainer.loss.correction.level=seq", "trainer.loss.correction.level: expected one"),
        ("trainer.loss.correction.cap=-1", "trainer.loss.correction.cap: must be > 0"),
        ("batcher.dynamic_sampling=-2", "batcher.dynamic_sampling: must be >= 0"),
        ("verifier.overlong.buffer=5000", "verifier.overlong: buffer 5000 must be in [0,"),
    ],
)
def test_bad_configs_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(None, [override])


def test_weighted_combine_needs_weights():
    with pytest.raises(ConfigError, match="verifier.weights: no weight for reward 'countdown'"):
        load_config(None, ["verifier.combine=weighted"])


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_dtypes_default_to_auto_and_attention_checks_on_cuda():
    cfg = load_config(None, [])
    assert (cfg.generation.dtype, cfg.logprob.dtype, cfg.trainer.compute_dtype) == ("auto",) * 3
    assert cfg.trainer.dtype == "float32" and cfg.trainer.activation_checkpointing is None
    on_cuda = ["trainer.device=cuda", "trainer.attention=flash", "batcher.share_prompts=true"]
    with pytest.raises(ConfigError, match="'flash' \\(varlen\\) cannot express"):
        load_config(None, on_cuda)
    assert load_config(None, on_cuda[:2]).trainer.attention == "flash"


def test_spare_groups_need_equal_reward_groups_to_be_set_aside():
    load_config(None, ["batcher.spare_groups=2"])  # the defaults set them aside
    with pytest.raises(ConfigError, match="batcher.spare_groups: spares replace equal-reward"):
        load_config(None, ["batcher.spare_groups=2", "trainer.loss.kl_coef=0.01"])
