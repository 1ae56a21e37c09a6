"""The server-backed kind: the environment lives in another process behind HTTP.

`serve(name, port)` hosts any registered environment (`async-grpo env-server NAME`); each
episode is a session on the server, made by `POST /reset`, driven by `POST /step` and
ended by `POST /close`, JSON in and out:

    /reset {"task": {"input", "answer", "metadata"}} -> {"session": id}
    /step  {"session": id, "action": str}            -> {"observation", "reward", "done", "info"}
    /close {"session": id}                           -> {"closed": bool}

`HttpEnvironment` is the client, an `Environment` like any other, so the environment
workers host it unchanged (`environment.url`). The server's answers are untrusted: they
are type-checked like an in-process step's.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from async_grpo.environments.base import Environment, StepResult, Task
from async_grpo.environments.registry import get_environment

MAX_BODY_BYTES = 1 << 20


class HttpEnvironment(Environment):
    """One session on an environment server at `url`."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.session: str | None = None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read(MAX_BODY_BYTES + 1)[:MAX_BODY_BYTES])
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.url}{path}: HTTP {e.code}: {e.read(500).decode()}") from None
        if not isinstance(answer, dict):
            raise ValueError(f"{self.url}{path}: answered {type(answer).__name__}, not an object")
        return answer

    def reset(self, task: Task) -> None:
        self.session = str(self._post("/reset", {"task": asdict(task)}).get("session"))

    def step(self, action: str) -> StepResult:
        a = self._post("/step", {"session": self.session, "action": action})
        return StepResult(a.get("observation"), a.get("reward"), a.get("done"), a.get("info", {}))

    def close(self) -> None:
        if self.session is not None:
            self._post("/close", {"session": self.session})


class EnvironmentServer(ThreadingHTTPServer):
    """Sessions of one environment class, keyed by id (a lock guards the table)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], env_cls: type[Environment]) -> None:
        super().__init__(address, _Handler)
        self.env_cls = env_cls
        self.sessions: dict[str, Environment] = {}
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: EnvironmentServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        try:
            size = int(self.headers.get("Content-Length", 0))
            if size > MAX_BODY_BYTES:
                raise ValueError(f"body of {size} bytes is over {MAX_BODY_BYTES}")
            body = json.loads(self.rfile.read(size) or b"{}")
            out = self._answer(self.path, body)
            self._send(200, out)
        except KeyError as e:
            self._send(404, {"error": f"unknown session {e}"})
        except Exception as e:
            self._send(400, {"error": f"{type(e).__name__}: {e}"})

    def _answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        s = self.server
        if path == "/reset":
            env = s.env_cls()
            _sync(env.reset(Task(**body["task"])))
            session = uuid.uuid4().hex
            with s.lock:
                s.sessions[session] = env
            return {"session": session}
        if path == "/step":
            with s.lock:
                env = s.sessions[body["session"]]
            return asdict(_sync(env.step(str(body["action"]))))
        if path == "/close":
            with s.lock:
                env = s.sessions.pop(body["session"], None)
            if env is not None:
                _sync(env.close())
            return {"closed": env is not None}
        raise ValueError(f"unknown path {path}")

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _sync(value: Any) -> Any:
    """An async environment's result, run to completion in this handler thread."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def make_server(name: str, host: str = "127.0.0.1", port: int = 0) -> EnvironmentServer:
    """A server for environment `name` (port 0: a free one; see `server_address`)."""
    return EnvironmentServer((host, port), get_environment(name))


def serve(name: str, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve environment `name` until interrupted."""
    server = make_server(name, host, port)
    print(f"environment {name!r} served at http://{host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
