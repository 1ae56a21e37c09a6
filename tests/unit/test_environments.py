"""Environments without Ray: the built-ins, the name registry, the instance pool (all or
nothing, capacity, timeouts, garbage, leaks) and the server-backed kind against a local
HTTP server."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from async_grpo.config import ConfigError, EnvironmentConfig
from async_grpo.environments import Environment, StepResult, Task, environment, get_environment
from async_grpo.environments.calculator import Calculator
from async_grpo.environments.guess import GuessNumber
from async_grpo.environments.http import make_server
from async_grpo.environments.pool import EnvironmentFailed, EnvironmentWorker
from async_grpo.errors import UserError
from async_grpo.preflight.settings import load_config


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_calculator_answers_tool_calls_and_scores_the_final_answer():
    env = Calculator()
    env.reset(Task("What is 347 * 29?", "10063"))
    r = env.step("Let me compute. <calc>347 * 29</calc>")
    assert (r.observation, r.reward, r.done, r.info) == ("10063", 0.0, False, {"tool_calls": 1.0})
    assert env.step("<calc>(7 - 1) / 4</calc>").observation == "1.5"
    assert env.step("The answer is 10063.") == StepResult("", 1.0, True, {"tool_calls": 0.0})
    env.reset(Task("q", 12))
    assert env.step("It is 13").reward == 0.0


@pytest.mark.parametrize(
    "call", ["__import__('os').system('true')", "2 ** 100", "1 / 0", "9" * 300, "(" * 80 + "1"]
)
def test_calculator_never_evaluates_what_the_safe_parser_refuses(call):
    env = Calculator()
    env.reset(Task("q", "1"))
    r = env.step(f"<calc>{call}</calc>")
    assert r.observation.startswith("error:") and r.reward == 0.0 and not r.done


def test_guess_number_rewards_finding_it_and_using_the_replies():
    env = GuessNumber()
    env.reset(Task("guess", 7, {"low": 1, "high": 10}))
    assert env.step("5").observation == "higher"  # consistent: +0.1
    assert env.step("3").reward == 0.0  # below what "higher" allowed
    assert env.step("9") == StepResult("lower", 0.1, False, {"guesses": 1.0})
    assert env.step("my guess: 7") == StepResult("", 1.0, True, {"guesses": 1.0})
    with pytest.raises(ValueError, match="not in 1..10"):
        env.reset(Task("guess", 11))


@environment("test_echo")
class Echo(Environment):
    max_turns = 2

    def step(self, action: str) -> StepResult:
        return StepResult(f"you said {action}", 1.0, "bye" in action)


def test_environments_are_found_by_name_and_by_module_path():
    assert get_environment("calculator") is Calculator
    assert get_environment("test_echo") is Echo
    assert get_environment("async_grpo.environments.guess:GuessNumber") is GuessNumber
    with pytest.raises(UserError, match="unknown; known environments: .*calculator"):
        get_environment("nope")
    with pytest.raises(UserError, match="not an Environment subclass"):
        get_environment("async_grpo.environments.calculator:show")
    with pytest.raises(UserError, match="already registered"):
        environment("test_echo")(type("Other", (Echo,), {}))


def test_config_refuses_environment_runs_that_cannot_work(tmp_path):
    cfg = load_config(None, ["environment.name=calculator", "generation.max_model_len=512"])
    assert cfg.environment.name == "calculator"
    with pytest.raises(UserError, match="unknown"):
        load_config(None, ["environment.name=nope"])
    with pytest.raises(ConfigError, match="environment.capacity"):
        load_config(None, ["environment.name=calculator", "environment.capacity=2"])
    with pytest.raises(ConfigError, match="max_episode_tokens: 2000 leaves no room"):
        load_config(None, ["environment.name=calculator", "environment.max_episode_tokens=2000"])
    with pytest.raises(ConfigError, match="environment.url: set environment.name"):
        load_config(None, ["environment.url=http://x"])


@environment("test_flaky")
class Flaky(Environment):
    """reset fails for the instance numbered `fail_at`; close may fail too."""

    made = 0
    closed = 0
    fail_at = 2
    close_fails = False

    def __init__(self) -> None:
        type(self).made += 1
        self.number = type(self).made

    def reset(self, task: Task) -> None:
        if self.number == self.fail_at:
            raise RuntimeError("no room in the sandbox")

    def step(self, action: str) -> StepResult:
        if action == "hang":
            time.sleep(4.0)
        if action == "raise":
            raise KeyError("boom")
        if action == "garbage":
            return {"observation": 1}  # type: ignore[return-value]
        if action == "nan":
            return StepResult("x", float("nan"), False)
        return StepResult("ok", 0.0, False)

    def close(self) -> None:
        type(self).closed += 1
        if self.close_fails:
            raise OSError("close failed too")


def _worker(capacity=8, timeout=0.5) -> EnvironmentWorker:
    cfg = EnvironmentConfig(name="test_flaky", capacity=capacity, step_timeout_s=timeout)
    return EnvironmentWorker(cfg, "env-test")


@pytest.fixture
def flaky(monkeypatch):
    for k, v in {"made": 0, "closed": 0, "fail_at": 2, "close_fails": False}.items():
        monkeypatch.setattr(Flaky, k, v)
    return Flaky


@pytest.mark.parametrize("close_fails", [False, True])
def test_a_group_is_acquired_whole_or_not_at_all(flaky, close_fails):
    flaky.fail_at, flaky.close_fails = 3, close_fails
    w = _worker()
    with pytest.raises(EnvironmentFailed, match="RuntimeError: no room in the sandbox") as e:
        _run(w.acquire([Task("q", 1)] * 4))
    assert e.value.reason == "acquire"
    # the resets run at once: all four were made, and each is closed, the failed one too
    assert w.live() == 0 and flaky.made == 4 and flaky.closed == 4
    assert w.stats()["env/close_failures"] == (4 if close_fails else 0)
    flaky.fail_at = 0
    ids = _run(w.acquire([Task("q", 1)] * 4))  # nothing half-acquired is left behind
    assert len(set(ids)) == 4 and w.live() == 4


@environment("test_unmakeable")
class Unmakeable(Environment):
    def __init__(self) -> None:
        raise ImportError("no module named 'sandbox'")

    def step(self, action: str) -> StepResult:
        return StepResult("", 0.0, True)


@environment("test_slow_reset")
class SlowReset(Environment):
    def reset(self, task: Task) -> None:
        time.sleep(1.0)

    def step(self, action: str) -> StepResult:
        return StepResult("", 0.0, True)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("test_unmakeable", "environment 'test_unmakeable' could not be instantiated: ImportError: no module named 'sandbox'"),
        ("test_flaky", "environment 'test_flaky': reset raised RuntimeError: no room in the sandbox"),
        ("test_slow_reset", "environment 'test_slow_reset': reset hung past environment.step_timeout_s (0.3 s)"),
    ],
)  # fmt: skip
def test_a_group_that_cannot_be_made_says_what_the_environment_did(flaky, name, said):
    """The line a run stops with when no group can be made (async_grpo/cause.py)."""
    flaky.fail_at = 1
    cfg = EnvironmentConfig(name=name, capacity=4, step_timeout_s=0.3)

    async def acquire() -> EnvironmentFailed:
        try:
            await EnvironmentWorker(cfg, "env-7").acquire([Task("q", 1)] * 2)
        except EnvironmentFailed as e:
            await asyncio.sleep(1.0)  # a hung reset's thread ends while the loop runs
            return e

    e = _run(acquire())
    assert (str(e), e.reason, e.worker) == (said, "acquire", "env-7")


def test_over_capacity_is_a_refusal_and_release_frees_room(flaky):
    flaky.fail_at = 0
    w = _worker(capacity=4)
    first = _run(w.acquire([Task("q", 1)] * 3))
    with pytest.raises(EnvironmentFailed, match="2 environment instances requested, 1 of 4 free"):
        _run(w.acquire([Task("q", 1)] * 2))
    assert w.live() == 3
    assert _run(w.release(first + ["unknown"])) == 3
    assert w.live() == 0 and len(_run(w.acquire([Task("q", 1)] * 4))) == 4


@pytest.mark.parametrize(
    ("action", "reason"),
    [("hang", "timeout"), ("raise", "error"), ("garbage", "bad_output"), ("nan", "bad_output")],
)
def test_a_step_that_hangs_raises_or_returns_garbage_fails_with_its_reason(flaky, action, reason):
    flaky.fail_at = 0
    w = _worker(timeout=1.0)  # the fine step has 1 s (a loaded machine), the hang 4 s
    (iid,) = _run(w.acquire([Task("q", 1)]))
    assert _run(w.step(iid, "fine")).observation == "ok"

    async def timed_step():  # timed inside the loop: asyncio.run then waits for the thread
        t0 = time.monotonic()
        try:
            await w.step(iid, action)
        except EnvironmentFailed as e:
            return e, time.monotonic() - t0

    failure, took = _run(timed_step())
    assert failure.reason == reason and took < 3.0  # a hang ends at its timeout
    _run(w.release([iid]))
    assert w.live() == 0
    with pytest.raises(EnvironmentFailed, match="no live instance"):
        _run(w.step(iid, "fine"))


def test_the_server_backed_kind_runs_episodes_against_a_local_server():
    server = make_server("calculator")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        cfg = EnvironmentConfig(name="calculator", url=url, capacity=4)
        w = EnvironmentWorker(cfg)

        async def episode():
            a, b = await w.acquire([Task("What is 12 * 34?", "408")] * 2)
            assert len(server.sessions) == 2
            assert (await w.step(a, "<calc>12 * 34</calc>")).observation == "408"
            final = await w.step(a, "It is 408.")
            wrong = await w.step(b, "It is 407.")
            await w.release([a, b])
            return final, wrong

        final, wrong = _run(episode())
        assert (final.reward, final.done, wrong.reward) == (1.0, True, 0.0)
        assert server.sessions == {} and w.live() == 0  # closed on the server too
        bad = EnvironmentConfig(name="calculator", url=url + "/missing", capacity=4)
        with pytest.raises(EnvironmentFailed, match="HTTP 400"):
            _run(EnvironmentWorker(bad).acquire([Task("q", 1)]))
    finally:
        server.shutdown()
        server.server_close()
