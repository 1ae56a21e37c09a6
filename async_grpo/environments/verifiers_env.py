"""`verifiers` environments as they are (`environment.kind: verifiers`): an installed
environment, loaded by `verifiers` itself (`load_environment(name, **args)`), runs its own
rollouts (its turns, its tools, its parser) against the run's OpenAI endpoint, and its
rubric scores them. Each rollout is an agent-harness rollout (environments/harness.py):
a thread and an event loop of its own, the same timeouts and counted failures, and every
token kept as the pool sampled it (endpoint.py).

The classic `verifiers` API (`vf.SingleTurnEnv`, `vf.MultiTurnEnv`, `vf.ToolEnv`,
`vf.Rubric`, ...) is what is supported, as `verifiers` 0.3 serves it (`VERSION`); 0.4
dropped it for a new API. A rollout's input is its data row: the prompt's messages (the
environment's `system_prompt` first when the row has none), `answer`, and the row's
metadata as `info` (rows written from the environment's own dataset keep its own columns
there, handed back as they were). The reward is the rubric's (its weighted sum);
every reward function's and metric's value is logged as `reward/<name>`. A rubric with
group reward functions scores a group's finished rollouts together (those that failed
score 0 and are not in it). A rollout the environment ended with an error (its
`state["error"]`) scores 0 as an `error`.

`data: environment` takes the environment's own dataset: written before Ray starts to
OUTPUT_DIR/environment-data/train.parquet, read from there as any data file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from async_grpo.config import ConfigError, RunConfig
from async_grpo.environments.harness import Pending, Scored

VERSION = "0.3"  # the verifiers release line whose classic API this reads
PIN = "0.3.1"  # the release scripts/setup.sh installs (pyproject.toml's `verifiers` extra)
ENV_DATA = "environment"  # `data`: the environment's own dataset
ROW_KEY = "verifiers_row"  # metadata: the environment's own columns of a row, as JSON text

_LOADED: dict[str, Any] = {}  # environment, by name and args: loaded once a process
_LOCK = threading.Lock()


def load_env(name: str | None, args: dict[str, Any]) -> Any:
    """The environment `verifiers` loads for `name` with `args`; a one-line ConfigError
    naming what failed otherwise."""
    where = f"environment.name={name}"
    if not name:
        raise ConfigError("environment.name: kind verifiers needs an installed environment")
    key = json.dumps([name, args], sort_keys=True, default=repr)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _load(name, args, where)
        return _LOADED[key]


def _load(name: str, args: dict[str, Any], where: str) -> Any:
    install = f"pip install 'async-grpo[verifiers]' and pip install --no-deps verifiers=={PIN}"
    try:
        import verifiers as vf
    except ImportError as e:
        raise ConfigError(
            f"{where}: kind verifiers needs the verifiers package ({e}); {install}"
            " (scripts/setup.sh does both)"
        ) from None
    found = getattr(vf, "__version__", "?")
    if not found.startswith(VERSION + "."):
        raise ConfigError(
            f"{where}: verifiers {found} is installed; kind verifiers reads the classic API"
            f" of verifiers {VERSION}.x ({install})"
        )
    import verifiers.legacy.envs.environment as vf_environment

    from async_grpo.data.forms import quiet_datasets

    quiet_datasets()  # an environment maps its dataset as it is built: no progress bars

    quiet = logging.getLogger("verifiers")  # it logs a failed load before it raises
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the raise becomes our one line
    try:
        with _no_signal_handlers(vf_environment):
            env = vf.load_environment(name, **args)
    except ValueError as e:  # verifiers' own word for a module that does not import
        cause = e.__cause__ or e
        raise ConfigError(
            f"{where}: cannot import it as a verifiers environment ({_line(cause)})"
        ) from None
    except Exception as e:
        cause = e.__cause__ or e
        raise ConfigError(
            f"{where}: load_environment(**environment.args) failed: {_line(cause)}"
        ) from None
    finally:
        quiet.setLevel(level)
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"{where}: load_environment returned {type(env).__name__}")
    if env.provides_advantages:
        raise ConfigError(
            f"{where}: its rubric gives advantages of its own; the run computes them"
            " (trainer.loss), so use a rubric that gives rewards"
        )
    return env


@contextlib.contextmanager
def _no_signal_handlers(module: Any) -> Iterator[None]:
    """Build environments without the SIGINT/SIGTERM handlers `verifiers` installs in
    every `Environment.__init__`: they would replace the run's and the trainer's own (a
    SIGTERM there would `exit(143)` from whatever frame it lands in), and off the main
    thread (the batcher loads its environment in a worker thread) `signal.signal`
    raises. Its `atexit` teardown is kept."""
    real = module.signal
    module.signal = types.SimpleNamespace(
        **{k: getattr(real, k) for k in dir(real) if not k.startswith("__")}
    )
    module.signal.signal = lambda signum, handler: None
    try:
        yield
    finally:
        module.signal = real


def _line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return text if len(text) <= 200 else text[:197] + "..."


class VerifiersRollout:
    """`rollout(client, row)` of one environment: its own rollout against the client's
    endpoint, scored by its rubric; a rubric with group reward functions scores the
    group's finished rollouts together (`score_group`)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.grouped = bool(env.rubric.has_group_rewards)

    async def __call__(self, client: Any, row: dict[str, Any]) -> Scored | Pending:
        from verifiers.clients import OpenAIChatCompletionsClient

        args = (
            rollout_input(row, self.env.system_prompt),
            OpenAIChatCompletionsClient(client),
            row["model"],
            {},  # the run's sampling settings: the endpoint applies them
        )
        if self.grouped:
            state = await self.env.rollout(*args)
            if state.get("error"):
                raise RuntimeError(
                    f"the environment ended its rollout with {_said(state['error'])}"
                )
            return Pending(state)
        out = await self.env.run_rollout(*args)
        if out.get("error"):
            raise RuntimeError(f"the environment ended its rollout with {_said(out['error'])}")
        return Scored(out.get("reward"), dict(out.get("metrics") or {}))

    def score_group(self, pending: list[Pending]) -> list[Scored]:
        """The rubric's scores of a group's finished rollouts, together (in the calling
        thread's own event loop)."""
        states = [p.state for p in pending]

        async def main() -> None:
            await self.env.rubric.score_group(states)
            for state in states:
                await self.env.rubric.cleanup(state)

        asyncio.run(main())
        return [Scored(s.get("reward"), dict(s.get("metrics") or {})) for s in states]


def _said(error: Any) -> str:
    if isinstance(error, dict):  # verifiers' serialized error
        return f"{error.get('error', 'Error')}: {error.get('message', '')}".strip()
    if isinstance(error, BaseException):
        return _line(error)
    return str(error)[:200]


def rollout_input(row: dict[str, Any], system_prompt: str | None = None) -> dict[str, Any]:
    """A `verifiers` rollout input of a data row (environments/harness.py's `row`): the
    environment's own columns where the row came from its dataset (`ROW_KEY`), its
    metadata as `info` otherwise."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt and not (prompt and prompt[0].get("role") == "system"):
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    meta = row.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    own = json.loads(meta[ROW_KEY]) if ROW_KEY in meta else {"info": meta, "example_id": 0}
    answer = row.get("answer")
    return {
        **own,
        "prompt": prompt,
        "answer": answer if isinstance(answer, str) else json.dumps(answer),
    }


def data_file(cfg: RunConfig) -> str:
    """Where `data: environment` is written (and read by the trainer's batcher link)."""
    return str(Path(cfg.output_dir) / "environment-data" / "train.parquet")


def environment_data(cfg: RunConfig) -> str:
    """`data: environment`: the environment's dataset written as a parquet file
    (`data_file`; its path); refused in one line when the run is not kind verifiers or
    the environment has no dataset."""
    e = cfg.environment
    if e.kind != "verifiers":
        raise ConfigError(
            f"data: {ENV_DATA!r} names a verifiers environment's dataset; set"
            " environment.kind: verifiers (and environment.name)"
        )
    env = load_env(e.name, e.args)
    try:
        rows = env.get_dataset()
    except Exception as ex:
        raise ConfigError(
            f"data: environment.name={e.name} gives no dataset ({_line(ex)})"
        ) from None
    from async_grpo.data.forms import write_parquet

    d = cfg.dataset
    out = data_file(cfg)
    write_parquet(out, [_data_row(r, i, d.prompt_key, d.answer_key) for i, r in enumerate(rows)])
    return out


def _data_row(r: dict[str, Any], i: int, prompt_key: str, answer_key: str) -> dict[str, Any]:
    """A row of the environment's dataset in the run's column names; its other columns
    (`info`, `example_id`, ...) kept as JSON text (any shape round-trips through Arrow)
    under the metadata's `ROW_KEY`, handed back to the environment as they were."""
    own = {k: v for k, v in r.items() if k not in ("prompt", "answer", "question")}
    own.setdefault("example_id", i)
    prompt = r.get("prompt")
    if isinstance(prompt, list):
        prompt = [{"role": m.get("role"), "content": m.get("content")} for m in prompt]
    return {
        prompt_key: prompt if prompt is not None else r.get("question"),
        answer_key: r.get("answer") or "",
        "metadata": {ROW_KEY: json.dumps(own, default=str)},
    }
