"""An agent harness as an environment: `async def rollout(client, row)`, written against
the `openai` SDK, drives a whole conversation and returns its reward.

    async def rollout(client: openai.AsyncOpenAI, row: dict) -> float | dict[str, float]:
        reply = await client.chat.completions.create(model=row["model"], messages=row["prompt"])
        return float(reply.choices[0].message.content.strip() == str(row["answer"]))

`row` holds `prompt` (the data row's messages, or its text under `prompt_format: plain`),
`answer`, `metadata`, `prefill` (the text the data says the model's turn starts with; a
harness sends it as a final assistant message with `continue_final_message`, as to a vLLM
server) and `model` (the name the endpoint serves). The client's base URL is
the rollout's own on the run's endpoint (endpoint.py), so every token it is sent back
comes from the pool and is kept as sampled.

Harness code is untrusted: each rollout runs in a thread of its own, in an event loop of
its own, under `environment.rollout_timeout_s`. One that raises ends with reward 0
(`error`), one past its time likewise (`timeout`), one that returns anything but a finite
number or a dict of them (`bad_output`). A rollout whose code blocks its thread (no await)
cannot be stopped there: the thread is counted as stuck, and `STUCK_LIMIT` of them stop the
run with a line saying so, rather than leave it slowing down.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from async_grpo.config import ConfigError
from async_grpo.deadline import within
from async_grpo.text import not_unicode

STUCK_LIMIT = 4  # rollout threads still blocked after their timeout; then the run stops
THREAD_SLACK_S = 10.0  # past the rollout's own timeout: its loop could not even cancel it


class BadOutput(ValueError):
    """A rollout returned something that is not a reward."""


@dataclass
class Scored:
    """A reward with named parts that need not sum to it (a rubric's weighted sum and its
    functions' values, environments/verifiers_env.py)."""

    reward: Any
    parts: dict[str, Any]


@dataclass
class Pending:
    """A finished rollout whose reward its group gives: `state` goes to the rollout
    function's `score_group` with the group's others (environments/verifiers_env.py)."""

    state: Any


def load_rollout(spec: str | None) -> Callable[..., Any]:
    """`module:function` -> an `async def rollout(client, row)`; a one-line ConfigError
    naming `environment.rollout` otherwise."""
    where = "environment.rollout"
    module, sep, name = (spec or "").partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{where}: expected module:function (async def rollout(client, row))")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import {module} ({e})") from None
    except AttributeError:
        raise ConfigError(f"{where}: {module} has no function {name!r}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{where}: {spec} must be an async def taking (client, row)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ConfigError(f"{where}: {spec} must take two arguments (client, row)") from None
    return fn


def reward_of(result: Any) -> tuple[float, dict[str, float]]:
    """(reward, named parts) of what a rollout returned: a finite number, or a dict of
    named finite numbers (summed), or a `Scored`; BadOutput naming what is wrong otherwise."""
    if isinstance(result, Scored):
        parts = {str(k): _number(v, f"reward {k!r}") for k, v in result.parts.items()}
        return _number(result.reward, "the reward"), parts
    if isinstance(result, dict):
        if not result or not_unicode(list(result)) is not None:
            raise BadOutput(f"returned {_short(result)}: a dict needs named rewards")
        parts = {}
        for key, value in result.items():
            if not isinstance(key, str):
                raise BadOutput(f"returned a reward named {_short(key)}, not a string")
            parts[key] = _number(value, f"reward {key!r}")
        return sum(parts.values()), parts
    return _number(result, "the reward"), {}


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadOutput(f"{what} is {_short(value)}, not a finite number")
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def drive(
    fn: Callable[..., Any], base_url: str, token: str, row: dict[str, Any], timeout_s: float
) -> Any:
    """One rollout, in the calling thread's own event loop: `fn(client, row)` with an
    `openai.AsyncOpenAI` client at `base_url`, cancelled at `timeout_s`."""

    async def main() -> Any:
        import openai

        # no retries: a request the client gave up on may still be sampled and kept. One
        # TLS context for every client: making one loads the CA bundle (about 60 ms a
        # rollout otherwise; bench/harness_overhead.py), though the endpoint is plain HTTP
        http = openai.DefaultAsyncHttpxClient(verify=_tls())
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key=token, max_retries=0, timeout=timeout_s, http_client=http
        ) as client:
            return await within(fn(client, row), timeout_s)

    return asyncio.run(main())


_TLS: list[Any] = []
_TLS_LOCK = threading.Lock()


def _tls() -> Any:
    """The process's one default TLS context, made on first use."""
    with _TLS_LOCK:
        if not _TLS:
            import ssl

            _TLS.append(ssl.create_default_context())
        return _TLS[0]
