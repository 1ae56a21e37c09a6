"""Every exception class of the package reaches a caller through a real Ray actor as
itself: same class, same message, same attributes. Ray pickles an actor's exception to
its caller, which rebuilds it as `cls(*args)`; a class whose `args` differ from its
constructor's arguments arrives as Ray's UnserializableException instead (a run whose
environment raised ended that way). The classes are found in the source, so a new one
without an entry in EXAMPLES fails here."""

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "async_grpo"
BASES = ("Exception", "Error")  # run.Stopped, a KeyboardInterrupt, never leaves `run`

# constructor arguments of each class, and attributes the caller must get back
EXAMPLES: dict[str, tuple[tuple, dict]] = {
    "async_grpo.errors.UserError": (("data.jsonl:3: field 'input': missing",), {}),
    "async_grpo.errors.MachineError": (
        ("the local Ray head did not start in 3 tries; `ray start` said: ...",),
        {},
    ),
    "async_grpo.config.ConfigError": (("trainer.lr: must be > 0, got -1",), {}),
    "async_grpo.data.jsonl.DataError": (("a.jsonl:2: not JSON",), {}),
    "async_grpo.hooks.HookFailed": (("hook EventLog raised in after_step: KeyError",), {}),
    "async_grpo.trainer.push.GroupBroken": (("member gen-1 died",), {}),
    "async_grpo.pools.NodeLost": (("node 10.0.0.7 (3f2a9b1c) is gone",), {}),
    "async_grpo.placement.PlacementError": (("generation.cpus: cannot bind to cores 7",), {}),
    "async_grpo.preflight.family.TwinError": ((ValueError("head_dim is per layer"),), {}),
    "async_grpo.rewards.countdown.EquationError": (("uses 7 twice",), {}),
    "async_grpo.rewards.sandbox.SandboxError": (("could not import reward",), {}),
    "async_grpo.inference.supervisor.RestartLimit": (("pool 'verifier': too many",), {}),
    "async_grpo.inference.types.RequestError": (("prompt too long",), {}),
    "async_grpo.inference.types.PoolUnavailable": (("no generation workers",), {}),
    "async_grpo.batcher.channel.ChannelClosed": (("rank 1",), {}),
    "async_grpo.environments.pool.EnvironmentFailed": (
        ("timeout", "env step took over 5s", "env-1"),
        {"reason": "timeout", "worker": "env-1"},
    ),
    "async_grpo.environments.pool._NotMade": (("RuntimeError: no sandbox image",), {}),
    "async_grpo.environments.base.BadStep": (("step: returned int",), {}),
    "async_grpo.environments.harness.BadOutput": (("the reward is 'yes', not a number",), {}),
    "async_grpo.batcher.harness.HarnessStuck": (("4 rollouts blocked their threads",), {}),
    "async_grpo.environments.http.Refusal": (
        (503, "sessions: --max-sessions is 2"),
        {"status": 503, "message": "sessions: --max-sessions is 2"},
    ),
}


def _exception_classes() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b).endswith(BASES) for b in node.bases
            ):
                found.append(f"{module}.{node.name}")
    return found


def _load(qualname: str) -> type:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_exception_class_has_an_example():
    assert sorted(_exception_classes()) == sorted(EXAMPLES)


@pytest.fixture(scope="module")
def thrower():
    import ray

    from async_grpo.ray_utils import connect

    started = not ray.is_initialized()
    connect(None, num_cpus=1, object_store_bytes=80 << 20, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Thrower:
        def throw(self, qualname: str, args: tuple) -> None:
            import importlib  # by value: the worker cannot import this test module

            module, _, name = qualname.rpartition(".")
            raise getattr(importlib.import_module(module), name)(*args)

    yield Thrower.remote()
    if started:
        ray.shutdown()


@pytest.mark.parametrize("qualname", sorted(EXAMPLES))
def test_raised_in_an_actor_arrives_as_itself(thrower, qualname):
    import ray

    cls = _load(qualname)
    args, attrs = EXAMPLES[qualname]
    with pytest.raises(cls) as caught:
        ray.get(thrower.throw.remote(qualname, args), timeout=60)
    want = cls(*args)
    assert str(want) in str(caught.value)
    for name, value in attrs.items():
        assert getattr(caught.value, name) == value


def test_a_trainer_failure_is_one_line_naming_the_actors_own_error(thrower, tmp_path, monkeypatch):
    """A rank of `async-grpo run` that fails on an actor's error (here what vLLM's Gemma-2
    loader raised at a push) records the actor's own message as the run's one line, the
    traceback in its log; `run` prints that line, with the --resume hint only once a
    checkpoint exists."""
    import ray

    from async_grpo.cli import _trainer_failed
    from async_grpo.errors import EXIT_FILE_ENV
    from async_grpo.run import _trainer_died

    message = "There is no module or parameter named 'lm_head' in Gemma2ForCausalLM"
    with pytest.raises(RuntimeError) as caught:
        ray.get(thrower.throw.remote("builtins.RuntimeError", (message,)), timeout=60)
    exit_file = tmp_path / "trainer_exit"
    monkeypatch.setenv(EXIT_FILE_ENV, str(exit_file))
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "out"
    _trainer_failed(caught.value, str(out), verbose=False)
    monkeypatch.setenv("RANK", "0")
    _trainer_failed(ValueError("a later rank's failure"), str(out), verbose=False)
    log = out / "logs" / "trainer-rank1.log"
    assert "Traceback" in log.read_text() and message in log.read_text()
    line = _trainer_died(1, exit_file, str(out), "configs/arithmetic.yaml", ["x=1"])
    assert line == f"the trainer died (exit code 1): RuntimeError: {message} (traceback: {log})"
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest").write_text("step_3")
    line = _trainer_died(1, exit_file, str(out), "configs/arithmetic.yaml", ["x=1"])
    assert line.endswith(
        "continue from the last one with: async-grpo run configs/arithmetic.yaml x=1 --resume"
    )
