"""Reward registry: the wire types, the `@reward` decorator, name lookup and `combine`.

A reward is a plain function `fn(sample: RewardInput) -> RewardOutput | float`. It is found
by name in three places, in this order:

1. `"module.path:function"`: imported on demand (no registration needed);
2. the in-process registry filled by `@reward("name")` (the built-ins register on import);
3. the `async_grpo.rewards` entry-point group of installed packages, so a user package can
   ship rewards without editing this one:
   `[project.entry-points."async_grpo.rewards"] my_reward = "my_pkg.rewards:my_reward"`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from async_grpo.errors import UserError

ENTRY_POINT_GROUP = "async_grpo.rewards"
_BUILTIN_MODULES = (
    "async_grpo.rewards.countdown",
    "async_grpo.rewards.math_reward",
    "async_grpo.rewards.exact",
    "async_grpo.rewards.number",
)


@dataclass
class RewardInput:
    """One sample to score. `completion` is untrusted model output: never evaluate it.

    `answer` is the ground truth from the data file (its type depends on the reward:
    countdown wants `{"target": int, "numbers": [int, ...]}`, math and exact a string).
    """

    prompt: str
    completion: str
    answer: Any
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardOutput:
    """A score. `reward` is finite; `components` are named parts for metrics (by
    convention they add up to `reward` for a single reward); `reason` says why a
    sample got nothing (e.g. "no <answer> tag", "timeout", "error: ValueError: ...")."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    reason: str = ""


RewardFn = Callable[[RewardInput], "RewardOutput | float"]
_REGISTRY: dict[str, RewardFn] = {}


def reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register `fn` under `name`. Returns `fn` unchanged, so it stays a plain function."""

    def register(fn: RewardFn) -> RewardFn:
        old = _REGISTRY.get(name)
        if old is not None and _qualified(old) != _qualified(fn):
            raise UserError(
                f"reward {name!r}: already registered by {_qualified(old)}, "
                f"cannot register {_qualified(fn)} under the same name"
            )
        _REGISTRY[name] = fn
        return fn

    return register


def get_reward(name: str) -> RewardFn:
    """Resolve `name` (registered, entry point, or `"module:function"`) to a function."""
    if ":" in name:
        return _load_spec(name)
    _import_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    for ep in _entry_points():
        if ep.name == name:
            fn = ep.load()
            if not callable(fn):
                raise UserError(f"reward {name!r}: entry point {ep.value} is not callable")
            return fn
    raise UserError(
        f"reward {name!r}: unknown; known rewards: {', '.join(known_rewards())} "
        f"(or give 'module.path:function')"
    )


def known_rewards() -> list[str]:
    """Names `get_reward` accepts without a module path: registered and entry points."""
    _import_builtins()
    return sorted(set(_REGISTRY) | {ep.name for ep in _entry_points()})


def as_output(value: RewardOutput | float) -> RewardOutput:
    """Normalise what a reward function returned; a non-finite or non-number is an error."""
    if isinstance(value, RewardOutput):
        out = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        out = RewardOutput(reward=float(value))
    else:
        raise TypeError(f"a reward must return RewardOutput or float, got {type(value).__name__}")
    if not math.isfinite(out.reward):
        raise ValueError(f"a reward must be finite, got {out.reward}")
    return out


def combine(
    outputs: Mapping[str, RewardOutput],
    rule: Literal["sum", "max", "weighted"] = "sum",
    weights: Mapping[str, float] | None = None,
) -> RewardOutput:
    """Fold the outputs of several rewards (keyed by reward name) into one.

    Components come back prefixed by reward name (`countdown/format_reward`), plus each
    reward's own total under its bare name. Reasons are joined as `name: reason`.
    """
    if not outputs:
        raise ValueError("combine: no reward outputs to combine")
    weights = weights or {}
    if rule == "sum":
        total = sum(o.reward for o in outputs.values())
    elif rule == "max":
        total = max(o.reward for o in outputs.values())
    elif rule == "weighted":
        missing = [n for n in outputs if n not in weights]
        if missing:
            raise UserError(f"verifier.weights: no weight for reward {missing[0]!r}")
        total = sum(weights[n] * o.reward for n, o in outputs.items())
    else:
        raise UserError(f"verifier.combine: expected sum, max or weighted, got {rule!r}")
    components: dict[str, float] = {}
    for name, out in outputs.items():
        components[name] = out.reward
        components.update({f"{name}/{k}": v for k, v in out.components.items()})
    reason = "; ".join(f"{n}: {o.reason}" for n, o in outputs.items() if o.reason)
    if len(outputs) == 1:
        reason = next(iter(outputs.values())).reason
    return RewardOutput(reward=float(total), components=components, reason=reason)


@dataclass
class CombinedReward:
    """Several named rewards folded by `combine`; a picklable `RewardFn` (the sandbox
    sends it to its subprocesses, which import each function's module)."""

    rewards: dict[str, RewardFn]
    rule: Literal["sum", "max", "weighted"] = "sum"
    weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.rewards:
            raise UserError("verifier.rewards: at least one reward is required")
        if self.rule not in ("sum", "max", "weighted"):
            raise UserError(f"verifier.combine: expected sum, max or weighted, got {self.rule!r}")
        missing = [n for n in self.rewards if self.rule == "weighted" and n not in self.weights]
        if missing:
            raise UserError(f"verifier.weights: no weight for reward {missing[0]!r}")

    def __call__(self, sample: RewardInput) -> RewardOutput:
        outputs = {name: as_output(fn(sample)) for name, fn in self.rewards.items()}
        return combine(outputs, self.rule, self.weights)


def _qualified(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", "?")
    module = "__main__" if module == "__mp_main__" else module
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def import_spec(spec: str, kind: str) -> Any:
    """The object named by `"module.path:attr.path"`; a UserError naming `kind` and `spec`
    when the module cannot be imported or has no such attribute."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{kind} {spec!r}: cannot import module {module_name!r} ({e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{kind} {spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def _load_spec(spec: str) -> RewardFn:
    obj = import_spec(spec, "reward")
    if not callable(obj):
        attr = spec.partition(":")[2]
        raise UserError(f"reward {spec!r}: {attr!r} is not callable")
    return obj


def _import_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
