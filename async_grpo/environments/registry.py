"""Environments by name, found like rewards: `"module.path:Class"`, the in-process registry
filled by `@environment("name")` (the built-ins register on import), or the
`async_grpo.environments` entry-point group of installed packages."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

from async_grpo.environments.base import Environment
from async_grpo.errors import UserError
from async_grpo.rewards.registry import import_spec

ENTRY_POINT_GROUP = "async_grpo.environments"
_BUILTIN_MODULES = ("async_grpo.environments.calculator", "async_grpo.environments.guess")
_REGISTRY: dict[str, type[Environment]] = {}


def environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Register an Environment subclass under `name`; returns the class unchanged."""

    def register(cls: type[Environment]) -> type[Environment]:
        old = _REGISTRY.get(name)
        if old is not None and _qualified(old) != _qualified(cls):
            raise UserError(
                f"environment {name!r}: already registered by {_qualified(old)},"
                f" cannot register {_qualified(cls)} under the same name"
            )
        _REGISTRY[name] = cls
        return cls

    return register


def get_environment(name: str) -> type[Environment]:
    """The Environment class for `name` (registered, entry point, or `module:Class`)."""
    if ":" in name:
        return _checked(name, import_spec(name, "environment"))
    _import_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return _checked(name, ep.load())
    raise UserError(
        f"environment {name!r}: unknown; known environments: {', '.join(known_environments())}"
        " (or give 'module.path:Class')"
    )


def known_environments() -> list[str]:
    _import_builtins()
    eps = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(set(_REGISTRY) | eps)


def _checked(name: str, obj: object) -> type[Environment]:
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise UserError(f"environment {name!r}: {obj!r} is not an Environment subclass")
    return obj


def _qualified(cls: type) -> str:
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
    return f"{module}.{cls.__qualname__}"


def _import_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
