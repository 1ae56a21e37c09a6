"""The environment server against hostile and concurrent clients, on a real socket: body
caps, the token, slow clients, one step at a time per session, async environments on one
loop, the session cap and idle expiry, and the CLI's refusal to serve openly without a
token."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from async_grpo.environments import Environment, StepResult, Task, environment
from async_grpo.environments.http import TOKEN_ENV, HttpEnvironment, make_server, read_token
from async_grpo.errors import UserError

TOKEN = "0123456789abcdef0123456789abcdef"
TASK = {"input": "q", "answer": "1", "metadata": {}}


@contextlib.contextmanager
def running(name: str = "calculator", **options):
    server = make_server(name, **options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        assert not thread.is_alive()


def post(server, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*server.server_address, timeout=5)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def status_of(sock: socket.socket) -> int:
    """The status code of the answer read from `sock`."""
    reply = b""
    while b"\r\n" not in reply:
        chunk = sock.recv(4096)
        assert chunk, f"closed without an answer after {reply!r}"
        reply += chunk
    return int(reply.split(b" ", 2)[1])


def test_the_wire_protocol_and_its_errors():
    with running("guess_number") as server:
        status, answer = post(server, "/reset", {"task": {**TASK, "answer": 3}})
        assert status == 200 and answer["session"] in server.sessions
        session = answer["session"]
        status, answer = post(server, "/step", {"session": session, "action": "5"})
        assert status == 200 and set(answer) == {"observation", "reward", "done", "info"}
        assert (answer["observation"], answer["done"]) == ("lower", False)
        assert post(server, "/reset", b"{not json")[0] == 400
        assert post(server, "/reset", [1, 2])[1]["error"].startswith("body is a JSON list")
        assert post(server, "/reset", {"task": {"input": "q"}})[0] == 400  # no answer
        assert post(server, "/step", {"session": session, "action": 5})[0] == 400
        assert post(server, "/step", {"session": "nope", "action": "1"})[0] == 404
        assert post(server, "/missing", {})[0] == 400
        status, answer = post(server, "/reset", {"task": {**TASK, "answer": 99}})
        assert status == 500 and answer["error"].startswith("ValueError: guess_number: secret")
        assert post(server, "/close", {"session": session}) == (200, {"closed": True})
        assert post(server, "/close", {"session": session}) == (200, {"closed": False})
        assert server.sessions == {}  # the failed reset left nothing behind


def test_a_client_may_name_its_session():
    """A client that names its session can close it even when the reset's answer was lost
    (the environment worker's timeout): the id is checked and never shared."""
    with running("guess_number") as server:
        named = {"task": {**TASK, "answer": 3}, "session": "client-chosen-id-0001"}
        assert post(server, "/reset", named) == (200, {"session": "client-chosen-id-0001"})
        status, answer = post(server, "/reset", named)
        assert status == 409 and "exists already" in answer["error"]
        for bad in ("short", "x" * 65, "../../etc/passwd-0000", 12345678901234567):
            assert post(server, "/reset", {**named, "session": bad})[0] == 400, bad
        assert post(server, "/close", {"session": "client-chosen-id-0001"})[1]["closed"]
        assert server.sessions == {}


def test_a_negative_content_length_is_refused_and_the_server_answers_after():
    with running() as server:
        big = b"x" * 3_000_000
        head = b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"
        with socket.create_connection(server.server_address, timeout=5) as c:
            c.sendall(head + big[:65536])
            assert status_of(c) == 400
            with pytest.raises(OSError):  # the connection is dropped, the body not taken
                c.sendall(big)
                c.sendall(big)
        assert post(server, "/reset", {"task": TASK})[0] == 200


def test_a_body_over_the_cap_is_refused_whether_announced_or_chunked():
    with running(timeout_s=1.0) as server:
        with socket.create_connection(server.server_address, timeout=5) as c:
            c.sendall(b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n")
            assert status_of(c) == 413  # refused on the header, before any body
        chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"  # 64 KiB chunks, never ended
        with socket.create_connection(server.server_address, timeout=5) as c:
            c.sendall(b"POST /reset HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            c.sendall(b"10000\r\n{" + b" " * 0xFFFF + b"\r\n" + chunk * 20)  # 1.3 MiB
            assert status_of(c) == 413
        assert post(server, "/reset", {"task": TASK})[0] == 200
        assert len(server.sessions) == 1


def test_only_requests_with_the_token_are_answered(monkeypatch):
    with running(token=TOKEN) as server:
        assert post(server, "/reset", {"task": TASK})[0] == 401
        wrong = {"Authorization": f"Bearer {TOKEN[:-1]}x"}
        assert post(server, "/reset", {"task": TASK}, wrong)[0] == 401
        assert post(server, "/reset", {"task": TASK}, {"Authorization": TOKEN})[0] == 401
        assert server.sessions == {}
        right = {"Authorization": f"Bearer {TOKEN}"}
        assert post(server, "/reset", {"task": TASK}, right)[0] == 200

        url = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        with pytest.raises(RuntimeError, match="HTTP 401"):
            HttpEnvironment(url).reset(Task("What is 2 + 2?", "4"))
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        env = HttpEnvironment(url)
        env.reset(Task("What is 2 + 2?", "4"))
        assert env.step("<calc>2 + 2</calc>").observation == "4"
        env.close()
        assert len(server.sessions) == 1  # the raw request's session


def test_token_sources_and_their_checks(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert read_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, f" {TOKEN}\n")
    assert read_token(None) == TOKEN
    (tmp_path / "t").write_text("short\n")
    with pytest.raises(UserError, match="at least 16"):
        read_token(str(tmp_path / "t"))
    with pytest.raises(UserError, match="cannot read"):
        read_token(str(tmp_path / "missing"))
    (tmp_path / "t").write_bytes(b"0123456789abcdef\xff\n")
    with pytest.raises(UserError, match=r"t:1: not UTF-8: byte 0xff at column 17"):
        read_token(str(tmp_path / "t"))
    with pytest.raises(UserError, match="no token is set"):
        make_server("calculator", "0.0.0.0")
    make_server("calculator", "0.0.0.0", token=TOKEN).server_close()


def test_slow_and_silent_clients_do_not_hold_the_server_and_are_dropped():
    with running(timeout_s=1.0) as server:
        t0 = time.monotonic()
        silent = socket.create_connection(server.server_address, timeout=5)
        slow = socket.create_connection(server.server_address, timeout=5)
        slow_body = socket.create_connection(server.server_address, timeout=5)
        slow_body.sendall(b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        stop = threading.Event()

        def trickle():  # one header line each 0.1 s, the request never ends
            while not stop.wait(0.1):
                try:
                    slow.sendall(b"X-Pad: 1\r\n")
                except OSError:  # dropped
                    return

        slow.sendall(b"POST /reset HTTP/1.1\r\nHost: x\r\n")
        threading.Thread(target=trickle, daemon=True).start()
        try:
            for _ in range(5):  # answered at once meanwhile
                t = time.monotonic()
                assert post(server, "/reset", {"task": TASK})[0] == 200
                assert time.monotonic() - t < 0.5  # not held till the 1 s timeout
            assert status_of(slow_body) == 408
            assert silent.recv(1) == b""  # dropped by the server
            dropped_silent = time.monotonic() - t0
            with contextlib.suppress(ConnectionResetError):  # dropped, lines unread
                assert slow.recv(1) == b""
            dropped_slow = time.monotonic() - t0
        finally:
            stop.set()
            for s in (silent, slow, slow_body):
                s.close()
        assert 0.9 < dropped_silent < 3.0 and 0.9 < dropped_slow < 3.0


SPANS: list[tuple[str, float, float]] = []
STEPPING = threading.Event()


@environment("test_env_server_slow_steps")
class SlowSteps(Environment):
    def reset(self, task: Task) -> None:
        self.name = task.input

    def step(self, action: str) -> StepResult:
        t0 = time.monotonic()
        STEPPING.set()
        time.sleep(0.3)
        SPANS.append((action, t0, time.monotonic()))
        return StepResult("", 0.0, False)

    def close(self) -> None:
        SPANS.append((f"close {self.name}", time.monotonic(), time.monotonic()))


def _in_threads(server, calls: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    """`calls` posted at once, each from its own thread; the answers in order."""
    answers: list = [None] * len(calls)

    def call(i: int) -> None:
        answers[i] = post(server, *calls[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return answers


def test_steps_of_one_session_run_one_at_a_time_and_close_waits_for_them():
    SPANS.clear()
    with running("test_env_server_slow_steps") as server:
        a = post(server, "/reset", {"task": {**TASK, "input": "a"}})[1]["session"]
        b = post(server, "/reset", {"task": {**TASK, "input": "b"}})[1]["session"]
        steps = [
            ("/step", {"session": s, "action": x}) for s, x in [(a, "a1"), (a, "a2"), (b, "b")]
        ]
        assert [status for status, _ in _in_threads(server, steps)] == [200, 200, 200]
        spans = {name: (start, end) for name, start, end in SPANS}
        first, second = sorted([spans["a1"], spans["a2"]])
        assert second[0] >= first[1]  # one after the other: 0.6 s for the two
        assert spans["b"][0] < first[1]  # the other session's step ran beside the first

        SPANS.clear()
        STEPPING.clear()
        step: list[tuple[int, dict]] = []
        stepper = threading.Thread(
            target=lambda: step.append(post(server, "/step", {"session": a, "action": "a3"}))
        )
        stepper.start()
        assert STEPPING.wait(5)  # the step is running
        assert post(server, "/close", {"session": a}) == (200, {"closed": True})
        stepper.join(5)
        assert step[0][0] == 200
        spans = {name: (start, end) for name, start, end in SPANS}
        assert spans["close a"][0] >= spans["a3"][1]  # close waited for the step


@environment("test_env_server_async")
class LoopBound(Environment):
    """Made in reset, used in step: a queue and a task that must live on one loop."""

    async def reset(self, task: Task) -> None:
        self.loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue[str] = asyncio.Queue()
        self.outbox: asyncio.Queue[str] = asyncio.Queue()
        self.echo = asyncio.create_task(self._echo())

    async def _echo(self) -> None:
        while True:
            self.outbox.put_nowait((await self.inbox.get()).upper())

    async def step(self, action: str) -> StepResult:
        if asyncio.get_running_loop() is not self.loop:
            return StepResult("another loop", 0.0, True)
        await self.inbox.put(action)
        return StepResult(await asyncio.wait_for(self.outbox.get(), 2), 1.0, False)

    async def close(self) -> None:
        self.echo.cancel()


def test_an_async_environment_keeps_its_loop_from_reset_to_step():
    with running("test_env_server_async") as server:
        env = HttpEnvironment(f"http://127.0.0.1:{server.server_address[1]}")
        env.reset(Task("q", "a"))
        assert env.step("hi").observation == "HI"
        assert env.step("there") == StepResult("THERE", 1.0, False, {})
        env.close()
        assert server.sessions == {} and server.close_failures == 0


def test_resets_over_the_session_cap_get_503():
    with running(max_sessions=2) as server:
        first = post(server, "/reset", {"task": TASK})[1]["session"]
        assert post(server, "/reset", {"task": TASK})[0] == 200
        status, answer = post(server, "/reset", {"task": TASK})
        assert status == 503 and "--max-sessions is 2" in answer["error"]
        assert post(server, "/close", {"session": first})[1] == {"closed": True}
        assert post(server, "/reset", {"task": TASK})[0] == 200
        assert len(server.sessions) == 2


CLOSED: list[str] = []


@environment("test_env_server_counted")
class CountedCloses(Environment):
    def reset(self, task: Task) -> None:
        self.name = task.input

    def step(self, action: str) -> StepResult:
        return StepResult("ok", 0.0, False)

    def close(self) -> None:
        CLOSED.append(self.name)


def test_an_idle_session_expires_and_is_closed_while_a_busy_one_stays():
    CLOSED.clear()
    with running("test_env_server_counted", session_ttl_s=0.4) as server:
        idle = post(server, "/reset", {"task": {**TASK, "input": "idle"}})[1]["session"]
        busy = post(server, "/reset", {"task": {**TASK, "input": "busy"}})[1]["session"]
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:  # the busy one steps each 0.1 s
            assert post(server, "/step", {"session": busy, "action": "x"})[0] == 200
            time.sleep(0.1)
        assert idle not in server.sessions and busy in server.sessions
        assert CLOSED == ["idle"] and server.expired == 1
        assert post(server, "/step", {"session": idle, "action": "x"})[0] == 404


@environment("test_env_server_lone_surrogate")
class LoneSurrogate(Environment):
    def step(self, action: str) -> StepResult:
        return StepResult("6\ud800", 0.0, False)


class NotUtf8(http.server.BaseHTTPRequestHandler):
    """A server that answers a step with bytes that are not UTF-8."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        answers = {"/reset": b'{"session": "s"}', "/close": b'{"closed": true}'}
        body = answers.get(self.path, b'{"observation": "caf\xe9", "reward": 0, "done": false}')
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_observations_that_are_not_unicode_cross_the_wire_or_are_bad_output():
    """A lone surrogate crosses as a JSON escape and comes out as it went in (the batcher
    replaces it where the observation enters the episode: test_episodes); an answer whose
    bytes are not UTF-8 is the step's bad_output."""
    from async_grpo.config import EnvironmentConfig
    from async_grpo.environments.pool import EnvironmentFailed, EnvironmentWorker

    with running("test_env_server_lone_surrogate") as server:
        env = HttpEnvironment(f"http://127.0.0.1:{server.server_address[1]}")
        env.reset(Task("q", "a"))
        assert env.step("x").observation == "6\ud800"
        env.close()
    raw = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotUtf8)
    threading.Thread(target=raw.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{raw.server_address[1]}"
    worker = EnvironmentWorker(EnvironmentConfig(name="calculator", url=url, step_timeout_s=5))

    async def step() -> EnvironmentFailed:
        (iid,) = await worker.acquire([Task("q", "a")])
        with pytest.raises(EnvironmentFailed) as failed:
            await worker.step(iid, "x")
        await worker.release([iid])
        return failed.value

    try:
        failed = asyncio.run(step())
    finally:
        raw.shutdown()
        raw.server_close()
    assert failed.reason == "bad_output" and "UnicodeDecodeError" in str(failed)
    assert worker.live() == 0


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "async_grpo.cli", "env-server", "calculator", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, env=env)


def test_the_cli_refuses_to_serve_other_machines_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    r = _cli("--host", "0.0.0.0", "--port", "0", env=env)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "--host 0.0.0.0" in lines[0] and TOKEN_ENV in lines[0] and "--token-file" in lines[0]
    (tmp_path / "token").write_text("short")
    r = _cli("--host", "0.0.0.0", "--port", "0", "--token-file", str(tmp_path / "token"), env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "at least 16" in r.stderr


def test_a_redirect_is_refused_and_the_token_stays_home(monkeypatch):
    """A server that answers 301, 302, 303, 307 or 308 pointing at another address: the
    client fails the call naming the redirect, and the other address sees no request (the
    token would have gone with it)."""
    seen: list[dict] = []

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            seen.append(dict(self.headers))
            self.send_response(200)
            self.end_headers()

        do_GET = do_POST  # noqa: N815

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    target = f"http://127.0.0.1:{other.server_address[1]}/reset"
    codes = iter([301, 302, 303, 307, 308])

    class Redirecting(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(next(codes))
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    try:
        for code in (301, 302, 303, 307, 308):
            env = HttpEnvironment(f"http://127.0.0.1:{server.server_address[1]}")
            with pytest.raises(RuntimeError, match=f"HTTP {code} redirect to .* refused"):
                env.reset(Task("What is 2 + 2?", "4"))
    finally:
        for s in (server, other):
            s.shutdown()
            s.server_close()
    assert seen == []
