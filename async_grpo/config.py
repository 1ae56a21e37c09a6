"""Typed configuration: one dataclass per part, loaded from YAML plus dotted overrides.

In: a YAML file (configs/*.yaml) and overrides such as `trainer.lr=1e-6`.
Out: a `RunConfig` (`from_dict`); each part receives only its own sub-config. Unknown
keys and wrong types raise `ConfigError` naming the key's path; contradictions between
settings are refused by `preflight.settings.validate`, and `preflight.settings.load_config` does
both from a file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from async_grpo.errors import UserError

Dtype = Literal["float32", "bfloat16", "float16"]
# "auto": bf16 where the process's device computes it natively, else fp32 (precision.py)
ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]
# "auto": flash-attn varlen on CUDA when installed (unshared rows), else flex_attention on
# CUDA, dense SDPA on CPU (core/attention/)
Attention = Literal["auto", "sdpa", "flex", "flash"]
Kernels = Literal["eager", "liger", "compile"]  # see trainer/model.py: apply_liger, wrap_layers
WeightTransport = Literal["auto", "broadcast", "shm", "cuda_ipc"]  # see async_grpo/transports


ReferenceSource = Literal["none", "base", "logprob_pool"]


class ConfigError(UserError):
    """A config that cannot run: the message starts with the key's dotted path."""


@dataclass
class GenerationConfig:
    """vLLM generation workers (one engine each)."""

    num_workers: int = 1
    max_concurrent_seqs: int = 64  # capacity a worker advertises to its registry
    max_model_len: int = 1024  # prompt + completion tokens
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    dtype: ComputeDtype = "auto"
    kv_cache_gib: float = 2.0  # CPU KV cache, exactly (not whole GiB); GPU uses memory utilisation
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True  # on CPU: ~60 s start instead of ~200 s, ~half the tok/s
    tensor_parallel_size: int = 1
    threads: int = 1  # CPU threads per engine
    cpus: str | None = None  # cores of the engines ("0", "0-3"); None: any (docs/placement.md)
    seed: int = 0
    weight_transport: Literal["auto", "broadcast"] = "auto"
    weight_update: Literal["wait", "in_flight"] = "wait"
    cpu_linear: Literal["onednn", "torch"] = "onednn"


@dataclass
class LogprobConfig:
    """Transformers workers that compute reference / old-policy log-probs."""

    num_workers: int = 1
    max_tokens_per_batch: int = 2048
    dtype: ComputeDtype = "auto"
    attention: Attention = "auto"  # auto: flash varlen / flex on CUDA, sdpa on CPU
    threads: int = 1
    cpus: str | None = None  # cores the log-prob workers may run on; None: any


@dataclass
class OverlongConfig:
    """DAPO's soft overlong penalty, added to a single-turn sample's reward as the component
    `overlong` (rewards/overlong.py): 0 up to max_new_tokens - buffer, then falling linearly
    to -penalty at max_new_tokens."""

    buffer: int = 0  # tokens of the ramp (verl overlong_buffer.len); 0: off
    penalty: float = 1.0  # the penalty at the limit (verl penalty_factor; TRL: 1)


@dataclass
class JudgeConfig:
    """An LLM judge served by its own vLLM workers (rewards/judge.py): each completion is
    put in `template` with its question and reference answer, and the verdict is read as
    the probability of a yes token (`verdict: yes_prob`, one forward, no sampling) or as
    the number `pattern` finds in the judge's greedy reply (`verdict: pattern`)."""

    model: str | None = None  # a model folder or prepared name; None: no judge
    template: str | None = None  # the prompt, with {question} {answer} {completion}; None: built-in
    verdict: Literal["yes_prob", "pattern"] = "yes_prob"  # P(yes) of the first token, or a number
    yes: list[str] = field(default_factory=lambda: ["yes"])  # yes_prob: the yes words
    no: list[str] = field(default_factory=lambda: ["no"])  # yes_prob: the no words
    pattern: str = r"(?i)score:\s*(-?\d+(?:\.\d+)?)"  # pattern: group 1 is the number
    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])  # pattern: -> [0, 1]
    max_tokens: int = 32  # pattern: the judge's reply at most
    timeout_s: float = 60.0  # a group's verdicts past this get `fallback` (judge/timeout)
    fallback: float = 0.0  # the score of a verdict that timed out, failed or did not parse
    num_workers: int = 1  # judge workers (one vLLM engine each)
    max_concurrent_seqs: int = 32  # judgements a worker runs at once
    max_model_len: int = 2048  # the rendered prompt (+ reply) at most
    dtype: ComputeDtype = "auto"  # as generation.dtype
    kv_cache_gib: float = 1.0  # CPU KV cache of a judge engine
    gpu_memory_utilization: float = 0.3  # GPU share of a judge engine
    threads: int = 1  # CPU threads per judge engine
    cpus: str | None = None  # cores of the judge engines; None: any


@dataclass
class RewardModelConfig:
    """A sequence-classification reward model (one score per sequence) served by its own
    transformers workers in token-budgeted batches (rewards/reward_model.py)."""

    model: str | None = None  # a folder with an AutoModelForSequenceClassification; None: none
    timeout_s: float = 60.0  # a group's scores past this get `fallback` (reward_model/timeout)
    fallback: float = 0.0  # the score of a sample that timed out, failed or was not finite
    num_workers: int = 1  # reward-model workers (one transformers model each)
    max_tokens_per_batch: int = 4096  # padded tokens in one forward
    max_length: int = 2048  # a longer prompt + completion keeps its last tokens
    dtype: ComputeDtype = "auto"  # as logprob.dtype
    threads: int = 1  # CPU threads per worker
    cpus: str | None = None  # cores of the reward-model workers; None: any


@dataclass
class VerifierConfig:
    """Rule rewards on CPU workers, each score in a subprocess killed at `timeout_s`; model
    rewards (`judge`, `reward_model`) on pools of their own. A sample's reward is the
    rules' reward (`combine`) plus each model reward times `weights[name]` (default 1)."""

    num_workers: int = 1
    rewards: list[str] = field(default_factory=lambda: ["countdown"])
    combine: Literal["sum", "max", "weighted"] = "sum"
    weights: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 5.0
    max_concurrency: int = 4  # scoring subprocesses per worker
    max_error_fraction: float = 1.0  # a step with this share of samples failing to score stops
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)

    @property
    def models(self) -> list[str]:
        """The model rewards this run scores with, by name (`judge`, `reward_model`)."""
        return [
            n for n, c in (("judge", self.judge), ("reward_model", self.reward_model)) if c.model
        ]


@dataclass
class EnvironmentConfig:
    """Multi-turn episodes instead of one scored completion: `kind: steps` against an
    environment pool (`name`, or a server at `url`), `kind: openai` by an agent harness
    (`rollout`) through the generation pool's OpenAI endpoint (environments/harness.py),
    `kind: verifiers` by an installed `verifiers` environment (`name`, `args`) through the
    same endpoint (environments/verifiers_env.py)."""

    kind: Literal["steps", "openai", "verifiers"] = "steps"  # reset/step, rollout, verifiers env
    name: str | None = None  # None: single-turn; else an environment (kind verifiers: its name)
    args: dict[str, Any] = field(default_factory=dict)  # kind verifiers: load_environment(**args)
    url: str | None = None  # server-backed: the environment's HTTP server (environments/http.py)
    num_workers: int = 1  # environment workers (Ray actors hosting the instances)
    capacity: int = 256  # live instances (episodes) a worker holds at once
    max_turns: int | None = None  # model turns per episode; None: the environment's own
    max_episode_tokens: int | None = None  # tokens after the prompt; None: the environment's
    max_observation_tokens: int = 64  # an observation longer than this is cut (counted)
    step_timeout_s: float = 10.0  # reset, step or close past this ends the episode (reward 0)
    on_error: Literal["score", "regenerate"] = "score"  # regenerate: a group with a failed episode
    rollout: str | None = None  # kind openai: module:function, async def rollout(client, row)
    rollout_timeout_s: float = 300.0  # a rollout past this ends with reward 0 (counted)
    tool_parser: str | None = None  # vLLM's tool-call parser for the endpoint (e.g. hermes)
    max_rollouts: int = 256  # rollouts open at once on the endpoint

    @property
    def multi_turn(self) -> bool:
        """Episodes (an environment or a harness) rather than scored single completions."""
        return self.name is not None or self.kind != "steps"

    @property
    def harness(self) -> bool:
        """Rollouts driven through the endpoint (an agent harness or a verifiers
        environment) rather than reset/step episodes."""
        return self.kind != "steps"


@dataclass
class BatcherConfig:
    """The ExperienceBatcher: prompts in, packed per-rank minibatches out."""

    questions_per_step: int = 4
    samples_per_question: int = 4  # the GRPO group size
    max_off_policy_steps: int = 1  # 0 = synchronous on-policy
    max_tokens_per_gpu: int = 1024
    share_prompts: bool = False  # a group's prompt once per row (dense mask or flex BlockMask)
    skip_zero_advantage: bool = (
        True  # equal-reward groups: counted, not run (exact if no KL/entropy)
    )
    max_missing_fraction: float = 1.0  # a step with this share of samples never arriving stops
    spare_groups: int = 0  # extra groups per step; finished ones replace equal-reward groups
    dynamic_sampling: int = 0  # redraws of an equal-reward group with a fresh prompt; 0: off
    curriculum: bool = False  # draw prompts by measured mastery (data/curriculum.py)
    curriculum_floor: float = 0.1  # draw weight of a prompt always or never solved (1.1: unseen)
    curriculum_pass: float = 1.0  # a sample passes (counts to mastery) at this reward or above
    seed: int = 0


@dataclass
class CorrectionConfig:
    """Off-policy correction: a detached weight exp(old - behaviour) on each token's policy
    term, from the proximal policy's log-probs (`old`) and the sampler's, at token or
    sequence level, truncated or masked outside a band (core/correction.py)."""

    level: Literal["token", "sequence", "geometric"] = "token"  # geometric: per-token mean
    mode: Literal["truncate", "mask", "off"] = "truncate"  # mask: 0 outside [floor, cap]; off: 1
    cap: float | None = 2.0  # truncate: min(weight, cap); mask: upper edge; None: none
    floor: float | None = None  # mask: lower edge (IcePop 0.5); None: none
    negative_threshold: float | None = None  # A<0, mean log(sampler/trainer) above: 0; None: off


@dataclass
class LossConfig:
    """The GRPO loss family (async_grpo.core.loss)."""

    objective: Literal["ppo", "gspo", "cispo", "gmpo", "sapo"] = "ppo"  # docs/loss.md
    clip_low: float | None = None  # None: the objective's own (ppo 0.2, gspo 3e-4, gmpo 0.4)
    clip_high: float | None = None  # None: the objective's own (ppo 0.28 DAPO, gspo 4e-4)
    cispo_cap: float = 1.2  # cispo: the IS weight's cap, min(ratio, cap), detached
    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature for A > 0
    sapo_tau_neg: float = 1.05  # sapo: the gate's temperature for A <= 0
    dual_clip: float | None = 3.0  # bound on the ratio for negative advantages; None disables
    kl_coef: float = 0.0  # 0 disables the reference model entirely
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    # None: the objective's own (token_mean; seq_mean_token_mean for gspo, gmpo and sapo)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"] | None = None
    constant_normalizer: float | None = None  # Dr.GRPO divisor; defaults to max_new_tokens
    advantage_std_norm: bool = True  # False = Dr.GRPO advantages (r - mean)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    proximal: Literal["behaviour", "current"] = "current"  # the ratio against (docs/loss.md)
    mask_truncated: bool = False  # drop samples cut at the length limit from the loss
    temperature: float = 1.0  # log-probs are computed at the sampling temperature


@dataclass
class LoraConfig:
    """Low-rank adapters (PEFT) on the frozen base; `rank` 0 trains every weight instead.
    See docs/lora.md."""

    rank: int = 0  # r; 0: off (full fine-tuning)
    alpha: float = 32.0  # the update is (alpha / rank) * B @ A
    dropout: float = 0.0  # on the adapters' input (PEFT's lora_dropout)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # or [q_proj, v_proj]
    push: Literal["adapter", "merged"] = "adapter"  # merged: full weights, W + (alpha/r) B A


@dataclass
class TrainerConfig:
    """The torchrun FSDP2 trainer."""

    num_ranks: int = 1
    lr: float = 1e-6
    warmup_steps: int = 0
    max_steps: int = 20
    mini_batches: int = 1  # optimizer updates per generated batch, whole groups each (docs/loss.md)
    epochs: int = 1  # passes over those mini-batches per batch
    stop_at_reward: float | None = None  # end once the last stop_window steps' mean reaches it
    stop_window: int = 3  # steps in that mean
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    dtype: Dtype = "float32"  # master weights, optimizer state and gradient reduction
    compute_dtype: ComputeDtype | None = "auto"  # FSDP2 fwd/bwd; auto: bf16 if native; None: dtype
    attention: Attention = "auto"  # auto: flash varlen / flex on CUDA, dense sdpa on CPU
    activation_checkpointing: bool | None = None  # per decoder layer; None: on for CUDA only
    kernels: Kernels = "eager"  # liger: Liger-Kernel (CUDA); compile: torch.compile per layer
    defer_grad_sync: bool = True
    device: Literal["cpu", "cuda"] = "cpu"
    save_every: int = 0  # 0 = only at the end
    push_every: int = 1  # push weights to the workers every k optimizer steps
    weight_transport: WeightTransport = "auto"
    logprob_chunk_size: int = 1024
    threads: int = 1
    cpus: str | None = None  # cores the ranks may run on ("1", "2-7"); None: any
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class EvalConfig:
    """Held-out evaluation during a run (async_grpo/evaluation): the generation pool at the
    version just pushed, scored by the verifier pool. Off while `data` is None."""

    data: str | None = (
        None  # held-out prompts, any form `data` takes (none may be a training prompt)
    )
    split: str | None = (
        None  # the split of eval.data (same columns as `dataset` says); None: dataset.split
    )
    every: int = 10  # evaluate every this many policy versions (a multiple of push_every)
    at_start: bool = True  # also the starting weights (version 0, or the resumed one)
    max_questions: int | None = None  # the first N prompts of the file; None: all of them
    samples_per_question: int = 1  # n; pass@k is reported for each k of `pass_k` <= n
    pass_k: list[int] = field(default_factory=lambda: [1])  # each k in 1..samples_per_question
    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int | None = None  # None: generation.max_new_tokens
    pass_threshold: float = 1.0  # a sample passes at this reward or above
    rewards: list[str] | None = None  # None: verifier.rewards (combined the same way)
    models: list[str] | None = None  # model rewards added (judge, reward_model); None: the run's
    max_concurrent_seqs: int = 32  # eval sequences in flight at once, over the whole pool
    timeout_s: float = 600.0  # one evaluation, all of it; the next push waits for it
    seed: int = 0  # sampling seeds per question (the same at every version)


@dataclass
class DatasetConfig:
    """How the rows of `data` and `eval.data` become prompts (async_grpo/data/, docs/data.md):
    any file form the `datasets` library reads, its columns mapped by name or by a function."""

    split: str | None = None  # of a dataset with several splits; None: the only one, else train
    prompt_key: str = "input"  # the prompt's column: a string, or a list of {role, content}
    answer_key: str = "answer"  # the ground truth's column, handed to the rewards
    map: str | None = None  # `module:function`: a row in, {prompt, answer, metadata?} out
    system_prompt: str | None = None  # a system message before each prompt (chat only)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking


@dataclass
class TrackersConfig:
    """Experiment trackers beside training_metrics.jsonl: the same metric names in each
    (async_grpo/sinks). Each needs its package (the `trackers` extra)."""

    tensorboard: bool = False  # output_dir/tensorboard
    wandb: bool = False  # Weights & Biases; offline by default (`wandb sync` later)
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: no network, no login
    mlflow: bool = False  # MLflow; a local store under output_dir/mlruns by default
    mlflow_uri: str | None = None  # None: file store in output_dir/mlruns
    project: str = "async-grpo"  # the W&B project and the MLflow experiment
    run_name: str | None = None  # None: the output_dir's folder name


@dataclass
class HookSpec:
    """A user hook (trainer/hooks.py): `path` is `module:Class`, built with `args`."""

    path: str = ""
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    """The whole run. `model` is a Hugging Face folder (see `async-grpo prepare-model`)."""

    model: str = "smollm2-135m"  # a folder, or the name of a prepared model
    data: str = "sample-data/countdown.jsonl"
    # chat: each prompt is a user turn in the model's chat template; plain: the text as
    # it is (base models, R1-Zero-style prompts)
    prompt_format: Literal["chat", "plain"] = "chat"
    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # columns, split, chat settings
    output_dir: str = "outputs/run"
    ray_address: str | None = None  # None: start a local Ray instance
    sample_every: int = 0  # every k steps, a few training samples to output_dir/samples.jsonl
    samples_logged: int = 4  # samples written each time (the file is bounded, see docs)
    max_worker_restarts: int = 3  # dead pool workers `run` replaces over a run, then it stops
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    logprob: LogprobConfig = field(default_factory=LogprobConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trackers: TrackersConfig = field(default_factory=TrackersConfig)
    hooks: list[HookSpec] = field(default_factory=list)  # user hooks: [{path: mod:Class, args: {}}]

    @property
    def eval_dataset(self) -> DatasetConfig:
        """How `eval.data` is read: the `dataset` settings, with `eval.split` when set."""
        return dataclasses.replace(self.dataset, split=self.eval.split or self.dataset.split)

    @property
    def reference(self) -> ReferenceSource:
        """Where the KL term's reference log-probs come from, decided here once and read by
        the batcher, `run`, the worker CLI and the trainer: "none" without a KL term; "base"
        under LoRA (the trainer's own frozen base with its adapters off: no reference
        model, no log-prob pool); else "logprob_pool" (the log-prob workers' frozen model)."""
        if self.trainer.loss.kl_coef <= 0:
            return "none"
        return "base" if self.trainer.lora.rank else "logprob_pool"


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (`1e-6`, `true`, `[a]`)."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key.path=value")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(text) if text else ""


def from_dict(cls: type, raw: Any, where: str) -> Any:
    """Build dataclass `cls` from `raw`, checking every key and type; `where` is the path."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or '<root>'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"{_join(where, unknown[0])}: unknown key (known: {', '.join(sorted(names))})"
        )
    kwargs = {k: _coerce(hints[k], v, _join(where, k)) for k, v in raw.items()}
    return cls(**kwargs)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(tp: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # YAML reads `cpus: 0` or `run_name: 2026` as a number
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads `1e-6` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and not (
        isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value
