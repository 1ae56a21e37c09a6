"""The server-backed kind: the environment lives in another process behind HTTP.

`serve(name, host, port)` hosts any registered environment (`async-grpo env-server NAME`);
each episode is a session on the server, made by `POST /reset`, driven by `POST /step` and
ended by `POST /close`, JSON in and out:

    /reset {"task": {"input", "answer", "metadata"}, "session"?: id} -> {"session": id}
    /step  {"session": id, "action": str}            -> {"observation", "reward", "done", "info"}
    /close {"session": id}                           -> {"closed": bool}

A client may name the session (16-64 letters, digits, `-`, `_`): it can then close it even
when the reset's answer never reaches it (a timeout). Errors answer {"error": "..."}: 400 a
bad request, 401 a missing or wrong token, 404 an unknown session, 408 a body not sent in
time, 409 a session id in use, 413 a body over 1 MiB, 500 the environment raised, 503 the
session cap is reached.

The server runs one asyncio loop. `async def` environment methods run on it (so an
episode's asyncio objects live from `reset` to `close`); plain methods run in a bounded
thread pool. A lock per session runs its requests one at a time. Sessions idle longer
than `session_ttl_s` are closed. With a token (`--token-file` or `ASYNC_GRPO_ENV_TOKEN`)
every request must send `Authorization: Bearer <token>`; a server reachable from other
machines must have one.

`HttpEnvironment` is the client, an `Environment` like any other, so the environment
workers host it unchanged (`environment.url`). It sends `ASYNC_GRPO_ENV_TOKEN` when set.
The server's answers are untrusted: they are type-checked like an in-process step's.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import ipaddress
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from async_grpo import background
from async_grpo.environments.base import BadStep, Environment, StepResult, Task, checked
from async_grpo.environments.registry import get_environment
from async_grpo.errors import UserError
from async_grpo.text import read_text

MAX_BODY_BYTES = 1 << 20
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
TOKEN_ENV = "ASYNC_GRPO_ENV_TOKEN"
MIN_TOKEN_CHARS = 16
_NO_TOKEN = f"missing or wrong token: send 'Authorization: Bearer <token>' ({TOKEN_ENV})"
_log = logging.getLogger(__name__)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is answered as the error it is: following it would send the bearer
    token (and the episode) to whatever address the answer names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        return None  # urllib then raises HTTPError with the 3xx code


_OPENER = urllib.request.build_opener(_NoRedirects)


class HttpEnvironment(Environment):
    """One session on an environment server at `url` (`token`: ASYNC_GRPO_ENV_TOKEN if set)."""

    def __init__(self, url: str, timeout_s: float = 10.0, token: str | None = None) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.token = token or os.environ.get(TOKEN_ENV, "").strip() or None
        self.session: str | None = None
        self._proposed: str | None = None  # the id this client gave its session
        self._closed = False  # close() came, maybe while reset was still waiting
        self._lock = threading.Lock()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers=headers
        )
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                raw = response.read(MAX_BODY_BYTES + 1)[:MAX_BODY_BYTES]
        except urllib.error.HTTPError as e:
            if 300 <= e.code < 400:
                where = e.headers.get("Location", "")[:200]
                raise RuntimeError(
                    f"{self.url}{path}: HTTP {e.code} redirect to {where!r} refused (the"
                    " token is sent to environment.url only)"
                ) from None
            detail = e.read(500).decode(errors="replace")
            raise RuntimeError(f"{self.url}{path}: HTTP {e.code}: {detail}") from None
        try:
            answer = json.loads(raw)
        except ValueError as e:  # not JSON, or bytes that are not UTF-8
            raise BadStep(f"{self.url}{path}: answered {type(e).__name__}: {e}") from None
        if not isinstance(answer, dict):
            raise BadStep(f"{self.url}{path}: answered {type(answer).__name__}, not an object")
        return answer

    def reset(self, task: Task) -> None:
        # the session's id is ours, so close() can end it even if this answer never comes
        self._proposed = uuid.uuid4().hex
        session = self._post("/reset", {"task": asdict(task), "session": self._proposed})
        session = session.get("session")
        if not isinstance(session, str) or not session:
            raise ValueError(f"{self.url}/reset: session {session!r} is not a non-empty string")
        with self._lock:
            self.session, closed = session, self._closed
        if closed:  # the worker gave up on this reset (its timeout) and closed us already
            self._post("/close", {"session": session})

    def step(self, action: str) -> StepResult:
        a = self._post("/step", {"session": self.session, "action": action})
        return StepResult(a.get("observation"), a.get("reward"), a.get("done"), a.get("info", {}))

    def close(self) -> None:
        with self._lock:
            self._closed, session = True, self.session or self._proposed
        if session is not None:
            self._post("/close", {"session": session})


class Refusal(Exception):
    """A request answered with `status` and {"error": message}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status, self.message = status, message


@dataclass
class _Session:
    """One episode on the server; `lock` runs its requests one at a time."""

    env: Environment | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)


class EnvironmentServer:
    """Sessions of one environment class behind an aiohttp app on its own loop.

    The socket is bound on construction (`server_address` is known at once);
    `serve_forever` runs the loop in the calling thread until `shutdown` (from another
    thread). `sessions` is only changed on the server's loop.
    """

    def __init__(
        self,
        env_cls: type[Environment],
        sock: socket.socket,
        token: str | None,
        max_sessions: int,
        session_ttl_s: float,
        timeout_s: float,
        threads: int,
    ) -> None:
        self.env_cls, self._sock, self.token = env_cls, sock, token
        self.max_sessions, self.session_ttl_s = max_sessions, session_ttl_s
        self.timeout_s = timeout_s
        self.server_address: tuple[str, int] = sock.getsockname()[:2]
        self.sessions: dict[str, _Session] = {}
        self.expired = 0  # sessions closed for being idle
        self.close_failures = 0  # close() calls that raised (each also logged)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="env-server")
        self._routes = {"/reset": self._reset, "/step": self._step, "/close": self._close}
        self._state = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = self._entered = False
        self._finished = threading.Event()

    def serve_forever(self) -> None:
        """Answer requests in this thread until `shutdown`."""
        with self._state:
            self._entered = True
        try:
            asyncio.run(self._serve())
        finally:
            self._finished.set()

    def shutdown(self) -> None:
        """Stop `serve_forever` and wait for it to return (at once if it never ran)."""
        with self._state:
            self._stopping = True
            loop, stop, entered = self._loop, self._stop, self._entered
        if loop is not None and stop is not None and not self._finished.is_set():
            loop.call_soon_threadsafe(stop.set)
        if entered:
            self._finished.wait()

    def server_close(self) -> None:
        self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _serve(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{path:.*}", self._handle)
        # keepalive_timeout also drops a connection that has not sent a whole request in
        # time; lingering_time bounds reading what is left of a refused body
        runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=self.timeout_s,
            lingering_time=self.timeout_s,
            shutdown_timeout=5.0,
        )
        await runner.setup()
        await web.SockSite(runner, self._sock).start()
        with self._state:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            if self._stopping:
                self._stop.set()
        sweeper = background.start(self._sweep(), "environment server: idle-session sweep")
        try:
            await self._stop.wait()
        finally:
            sweeper.cancel()
            await runner.cleanup()
            # closed but left listed: the table shows what the clients left open
            await asyncio.gather(*(self._close_quietly(s.env) for s in self.sessions.values()))

    async def _handle(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return _answer(401, {"error": _NO_TOKEN})
        if request.method != "POST":
            return _answer(405, {"error": f"{request.method} {request.path}: only POST is served"})
        route = self._routes.get(request.path)
        if route is None:
            return _answer(
                400, {"error": f"unknown path {request.path}; expected {list(self._routes)}"}
            )
        try:
            return _answer(200, await route(await self._body(request)))
        except Refusal as r:
            response = _answer(r.status, {"error": r.message})
            if r.status in (408, 413):
                response.force_close()  # the rest of the body is not read
            return response

    def _authorised(self, request: web.Request) -> bool:
        return authorised(request, self.token)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return await json_body(request, MAX_BODY_BYTES, self.timeout_s)

    async def _reset(self, body: dict[str, Any]) -> dict[str, Any]:
        fields = body.get("task")
        if not isinstance(fields, dict):
            raise Refusal(400, '/reset: expected {"task": {"input", "answer", "metadata"}}')
        try:
            task = Task(**fields)
        except TypeError as e:
            raise Refusal(400, f"/reset: bad task: {e}") from None
        if len(self.sessions) >= self.max_sessions:
            raise Refusal(
                503,
                f"session cap reached: {len(self.sessions)} open, --max-sessions is"
                f" {self.max_sessions}; close sessions or raise the cap",
            )
        session_id = body.get("session") or uuid.uuid4().hex  # the client's own id, if sent
        if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
            raise Refusal(400, f"/reset: session id {session_id!r}: expected {SESSION_ID.pattern}")
        if session_id in self.sessions:
            raise Refusal(409, f"/reset: session {session_id!r} exists already")
        session = _Session()
        async with session.lock:
            self.sessions[session_id] = session  # holds its place against the cap
            try:
                session.env = await self._call(self.env_cls)
                await self._call(session.env.reset, task)
            except BaseException:
                del self.sessions[session_id]
                if session.env is not None:
                    await self._close_quietly(session.env)
                raise
            session.last_used = time.monotonic()
        return {"session": session_id}

    async def _step(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id, action = body.get("session"), body.get("action")
        if not isinstance(action, str):
            raise Refusal(400, f"/step: action is {type(action).__name__}, expected a string")
        session = self._session(session_id)
        session.last_used = time.monotonic()
        async with session.lock:
            if self.sessions.get(session_id) is not session:
                raise Refusal(404, f"session {session_id!r} was closed")
            result = await self._call(session.env.step, action)
            session.last_used = time.monotonic()
        try:
            return asdict(checked(result, f"{self.env_cls.__name__}.step"))
        except ValueError as e:
            raise Refusal(500, f"{type(e).__name__}: {e}") from None

    async def _close(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = body.get("session")
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            return {"closed": False}
        async with session.lock:  # a running step ends first
            if self.sessions.get(session_id) is not session:
                return {"closed": False}
            del self.sessions[session_id]
        await self._call(session.env.close)
        return {"closed": True}

    def _session(self, session_id: Any) -> _Session:
        """The live session `session_id`'s record (404 if none)."""
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.env is None:
            raise Refusal(404, f"unknown session {session_id!r}")
        return session

    async def _call(self, fn: Any, *args: Any) -> Any:
        """An environment call: awaited on this loop if async, else in the thread pool.
        What it raises is answered 500 "Type: message"."""
        try:
            if inspect.iscoroutinefunction(fn):
                out = await fn(*args)
            else:
                out = await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
            return await out if inspect.isawaitable(out) else out
        except Exception as e:
            raise Refusal(500, f"{type(e).__name__}: {e}") from None

    async def _close_quietly(self, env: Environment | None) -> None:
        """Close `env` within `timeout_s`; a failure is counted and logged, not raised."""
        if env is None:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._call(env.close)
        except (Refusal, TimeoutError) as e:
            self.close_failures += 1
            why = e.message if isinstance(e, Refusal) else f"took over {self.timeout_s:g}s"
            _log.warning("env-server: %s.close() failed: %s", self.env_cls.__name__, why)

    async def _sweep(self) -> None:
        """Close the sessions idle for over `session_ttl_s` (a running one is never idle)."""
        while True:
            await asyncio.sleep(min(self.session_ttl_s / 2, 60.0))
            cutoff = time.monotonic() - self.session_ttl_s
            idle = [
                k for k, s in self.sessions.items() if s.last_used < cutoff and not s.lock.locked()
            ]
            closing = [self.sessions.pop(k).env for k in idle]
            self.expired += len(idle)
            await asyncio.gather(*(self._close_quietly(env) for env in closing))


def authorised(request: web.Request, token: str | None) -> bool:
    """Whether the request sends `Authorization: Bearer <token>` (any request, without one)."""
    if token is None:
        return True
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {token}".encode())


async def json_body(request: web.Request, max_bytes: int, timeout_s: float) -> dict[str, Any]:
    """The request's body as a JSON object; `Refusal` 413 over `max_bytes`, 408 not sent
    within `timeout_s`, 400 not a JSON object."""
    if (request.content_length or 0) > max_bytes:
        raise Refusal(413, f"body of {request.content_length} bytes is over {max_bytes}")
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise Refusal(413, f"body is over {max_bytes} bytes") from None
    except TimeoutError:
        raise Refusal(408, f"body not received within {timeout_s:g}s") from None
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise Refusal(400, f"body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise Refusal(400, f"body is a JSON {type(body).__name__}, expected an object")
    return body


def _answer(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status)


def read_token(token_file: str | None) -> str | None:
    """The shared token: the file's text if given, else ASYNC_GRPO_ENV_TOKEN, else None."""
    if token_file is not None:
        try:
            token, where = read_text(token_file).strip(), f"--token-file {token_file}"
        except OSError as e:
            raise UserError(f"--token-file {token_file}: cannot read it ({e.strerror})") from None
    else:
        token, where = os.environ.get(TOKEN_ENV, "").strip(), TOKEN_ENV
        if not token:
            return None
    if (
        len(token) < MIN_TOKEN_CHARS
        or not (token.isascii() and token.isprintable())
        or " " in token
    ):
        raise UserError(
            f"{where}: expected a token of at least {MIN_TOKEN_CHARS} printable ASCII characters"
            f" without spaces, got {len(token)} characters"
            " (make one with: python -c 'import secrets; print(secrets.token_hex(16))')"
        )
    return token


def make_server(
    name: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    token: str | None = None,
    max_sessions: int = 1024,
    session_ttl_s: float = 3600.0,
    timeout_s: float = 30.0,
    threads: int = 16,
) -> EnvironmentServer:
    """A server for environment `name`, its socket bound (port 0: a free one; see
    `server_address`). `timeout_s` bounds how long a client may take to send a request;
    `threads` is the pool that runs plain (not async) environment methods."""
    if token is None and not _is_loopback(host):
        raise UserError(
            f"env-server: --host {host} is reachable from other machines and no token is set;"
            f" expected --token-file PATH or {TOKEN_ENV} (or a loopback --host such as 127.0.0.1)"
        )
    if max_sessions < 1 or threads < 1:
        raise UserError(
            f"env-server: --max-sessions and --threads must be >= 1, got {max_sessions}, {threads}"
        )
    if not (session_ttl_s > 0 and timeout_s > 0):
        raise UserError(
            f"env-server: --session-ttl-s and --timeout-s must be > 0,"
            f" got {session_ttl_s:g}, {timeout_s:g}"
        )
    env_cls = get_environment(name)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise UserError(f"env-server: cannot listen on {host}:{port} ({e.strerror})") from None
    return EnvironmentServer(env_cls, sock, token, max_sessions, session_ttl_s, timeout_s, threads)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or "" (every interface)
        return False


def serve(name: str, host: str = "127.0.0.1", port: int = 8765, **options: Any) -> None:
    """Serve environment `name` until interrupted (`options`: those of `make_server`)."""
    server = make_server(name, host, port, **options)
    guard = "token required" if server.token else "no token: this machine only"
    print(
        f"environment {name!r} served at http://{host}:{server.server_address[1]} ({guard})",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
