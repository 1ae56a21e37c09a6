"""Training hooks: code that runs on trainer rank 0 around steps, pushes, checkpoints and
evaluations, without editing the trainer.

A hook subclasses `TrainingHook` and overrides the events it wants; the trainer calls each
hook in order through `Hooks`. The built-in evaluation (`evaluation.hook.EvalHook`), the
checkpoint announcement to late-joining workers and the sample log are hooks too. A hook
that raises stops the run with one line naming the hook and the event (exit code 2).
User hooks come from the config: `hooks: [{path: "my_pkg.hooks:Upload", args: {...}}]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_grpo.errors import UserError

EVENTS = (
    "on_start",
    "before_step",
    "after_step",
    "before_push",
    "after_push",
    "after_checkpoint",
    "after_eval",
    "on_end",
)


@dataclass
class HookContext:
    """What a hook may use: the run's config, its output folder, the model folder, and
    `log(step, metrics)`, which writes a row to the metrics (JSONL and trackers);
    `last_version` is the run's last version: `trainer.max_steps`, or the step at which
    `trainer.stop_at_reward` ended it (set before that version's push)."""

    cfg: Any
    output_dir: Path
    model_dir: str
    log: Any = None
    hooks: Any = None  # the `Hooks` running this one (to raise `after_eval` from a hook)
    extra: dict[str, Any] = field(default_factory=dict)
    last_version: int | None = None


class TrainingHook:
    """Override any of these; every event runs on trainer rank 0, in the trainer's thread
    (a slow hook slows the run). `samples` in `after_step` are the training samples logged
    that step (`sample_every`), as JSON-ready dicts with the decoded text."""

    name = ""  # shown in errors; the class name when empty

    def on_start(self, ctx: HookContext) -> None: ...

    def before_step(self, step: int) -> None: ...

    def after_step(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None: ...

    def before_push(self, version: int) -> None: ...

    def after_push(self, version: int) -> None: ...

    def after_checkpoint(self, step: int, path: Path) -> None: ...

    def after_eval(self, version: int, result: Any) -> None: ...

    def on_end(self) -> None: ...

    @property
    def wants_final_push(self) -> bool:
        """True: the trainer also pushes the final weights (an evaluation of them)."""
        return False


class HookFailed(UserError):
    """A hook raised: the run stops with the hook's name, the event and the cause."""


class Hooks:
    """The hooks of a run, called in order for each event."""

    def __init__(self, hooks: list[TrainingHook]) -> None:
        self.hooks = list(hooks)

    def call(self, event: str, *args: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown hook event {event!r} (known: {', '.join(EVENTS)})")
        for hook in self.hooks:
            try:
                getattr(hook, event)(*args)
            except HookFailed:
                raise
            except Exception as e:
                name = hook.name or type(hook).__name__
                raise HookFailed(
                    f"hook {name}: {event} raised {type(e).__name__}: {e}; stopping the run"
                ) from e

    @property
    def wants_final_push(self) -> bool:
        return any(h.wants_final_push for h in self.hooks)


def load_hooks(specs: list[Any]) -> list[TrainingHook]:
    """The user's hooks from `cfg.hooks` (`path` = module:Class, built with `args`)."""
    import pkgutil

    hooks = []
    for i, spec in enumerate(specs):
        try:
            cls = pkgutil.resolve_name(spec.path)
        except (ImportError, AttributeError, ValueError) as e:
            raise UserError(f"hooks[{i}].path: cannot load {spec.path!r} ({e})") from None
        if not (isinstance(cls, type) and issubclass(cls, TrainingHook)):
            raise UserError(f"hooks[{i}].path: {spec.path!r} is not a TrainingHook subclass")
        try:
            hooks.append(cls(**spec.args))
        except TypeError as e:
            raise UserError(f"hooks[{i}].args: {spec.path} does not take them ({e})") from None
    return hooks
