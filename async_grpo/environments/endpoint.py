"""The generation pool over the OpenAI HTTP API, for agent harnesses written against it.

An unmodified `openai` client only changes its base URL to the rollout's:
`http://127.0.0.1:PORT/rollouts/<rollout id>/v1`. Served:

    POST /rollouts/<id>/v1/chat/completions   messages, tools -> a reply (tool_calls parsed)
    POST /rollouts/<id>/v1/completions        a text prompt -> its continuation
    GET  /rollouts/<id>/v1/models, /v1/models  the one model served

Every request names its rollout, and only rollouts the run opened are served (404
otherwise). Each rollout's tokens are kept by a `Trajectory` (trajectory.py): the reply is
generated from the kept ids, and the training sample is built from the sampled ids, never
from text.

Requests may narrow what the run samples (fewer tokens, stop strings, a seed) but not
change what the loss assumes: a `temperature` or `top_p` other than the run's, penalties,
logit biases, top-k or min-p, guided output (`response_format`, a required or named
`tool_choice`), beam search and streaming are refused with 400, as are `n` > 1 (each
sample of a group is its own rollout) and `top_logprobs`. The body is parsed by vLLM's own
`ChatCompletionRequest`, tool calls by vLLM's own tool parser (`tool_parser` names it, as
`vllm serve --tool-call-parser` does), so a client sees what a vLLM server would answer.

Errors are OpenAI's shape, `{"error": {"message", "type", "code"}}`: 400 a bad body, 401
without the run's token (when it has one), 404 an unknown rollout or model, 408 a body not
sent in time, 413 a body over the cap, 429 when `max_rollouts` rollouts are open, 503 when
no worker took the request in time. The server listens on loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from async_grpo.data.rows import ROLES
from async_grpo.environments.http import Refusal, authorised, json_body
from async_grpo.environments.trajectory import Trajectory
from async_grpo.inference.types import Completion, PoolUnavailable, SamplingSettings

_log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
# fields a request may not set to other than their defaults: they change the sampling
# distribution the loss assumes, or what is sent back (streams, alternatives)
REFUSED = (
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "top_k",
    "min_p",
    "response_format",
    "use_beam_search",
    "stream",
    "top_logprobs",
    "min_tokens",
    "ignore_eos",
    "prompt_logprobs",
    "logprob_token_ids",
    "stop_token_ids",
    "truncate_prompt_tokens",
)

Generate = Callable[[list[int], int, SamplingSettings], Awaitable[list[Completion]]]


class OpenAIEndpoint:
    """`generate(ids, n, sampling)` (the generation pool) served over HTTP on loopback.
    `sampling` is the run's: requests narrow it, never widen it."""

    def __init__(
        self,
        generate: Generate,
        tokenizer: Any,
        model: str,
        sampling: SamplingSettings,
        max_model_len: int,
        token: str | None = None,
        tool_parser: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        max_rollouts: int = 256,
        timeout_s: float = 30.0,
    ) -> None:
        self.generate, self.tokenizer, self.model = generate, tokenizer, model
        self.sampling, self.max_model_len, self.token = sampling, max_model_len, token
        self.template_kwargs = dict(template_kwargs or {})
        self.max_rollouts, self.timeout_s = max_rollouts, timeout_s
        self.parser = _tool_parser(tool_parser) if tool_parser else None
        self.rollouts: dict[str, Trajectory] = {}
        self._backends: dict[str, Generate] = {}  # a rollout's own `generate`, where given
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> str:
        """Listen on 127.0.0.1:`port` (0: a free one); the base URL."""
        await asyncio.to_thread(_import_vllm_parts)  # not on the event loop, at a request
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, keepalive_timeout=self.timeout_s, shutdown_timeout=5.0
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(
        self, rollout_id: str | None = None, generate: Generate | None = None
    ) -> tuple[str, str]:
        """A new rollout: its id and the base URL its client uses. `generate`: the
        rollout's own backend (its group's seeds, versions), else the endpoint's."""
        if len(self.rollouts) >= self.max_rollouts:
            raise Refusal(429, f"{self.max_rollouts} rollouts are open (max_rollouts)")
        rollout_id = rollout_id or uuid.uuid4().hex
        self.rollouts[rollout_id] = Trajectory(self.tokenizer, self._render)
        if generate is not None:
            self._backends[rollout_id] = generate
        return rollout_id, f"{self.url}/rollouts/{rollout_id}/v1"

    def close(self, rollout_id: str) -> Trajectory:
        """The rollout's tokens; its URL is served no more."""
        self._backends.pop(rollout_id, None)
        return self.rollouts.pop(rollout_id)

    async def _handle(self, request: web.Request) -> web.Response:
        try:
            if not authorised(request, self.token):
                raise Refusal(401, "missing or wrong token: send 'Authorization: Bearer <token>'")
            parts = request.path.strip("/").split("/")
            if parts[:1] == ["rollouts"] and len(parts) >= 3:
                rollout, route = parts[1], "/".join(parts[2:])
            else:
                rollout, route = None, "/".join(parts)
            if request.method == "GET" and route == "v1/models":
                return _json(200, self._models())
            served = {"v1/chat/completions": self._chat, "v1/completions": self._completion}
            if request.method == "POST" and route in served:
                trajectory = self.rollouts.get(rollout or "")
                if trajectory is None:
                    raise Refusal(404, f"unknown rollout {rollout!r}: the run serves its own")
                body = await json_body(request, MAX_BODY_BYTES, self.timeout_s)
                generate = self._backends.get(rollout or "", self.generate)
                return _json(200, await served[route](trajectory, generate, body))
            raise Refusal(404, f"{request.method} {request.path}: not served")
        except PoolUnavailable as e:  # no worker could take it in time: the client may retry
            r = Refusal(503, str(e))
        except Refusal as e:
            r = e
        except Exception as e:  # a failure of ours: said, not a bare 500 page
            _log.exception("endpoint: %s %s failed", request.method, request.path)
            r = Refusal(500, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        kind = "invalid_request_error" if r.status < 500 else "server_error"
        response = _json(
            r.status, {"error": {"message": r.message, "type": kind, "code": r.status}}
        )
        if r.status == 413:
            response.force_close()
        return response

    def _models(self) -> dict[str, Any]:
        entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "async-grpo"}
        return {"object": "list", "data": [entry]}

    def _request(self, body: dict[str, Any], kind: Any = None) -> Any:
        """The body as vLLM's request model (`kind`; ChatCompletionRequest by default),
        refused where it asks what the run cannot give."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            req = (kind or ChatCompletionRequest).model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise Refusal(400, f"{where or 'body'}: {first.get('msg', 'invalid')}") from None
        if req.model is not None and req.model != self.model:
            raise Refusal(404, f"model {req.model!r} is not served; this run serves {self.model!r}")
        for name in REFUSED:
            if name in req.model_fields_set and getattr(req, name) != _default(req, name):
                raise Refusal(400, f"{name}: not served (it changes what the loss assumes)")
        for name in ("temperature", "top_p"):
            value, run = getattr(req, name), getattr(self.sampling, name)
            if value is not None and value != run:
                raise Refusal(400, f"{name}: the run samples at {run}; the loss assumes it")
        if (req.n or 1) != 1:
            raise Refusal(400, "n: one reply a request (each sample of a group is a rollout)")
        if getattr(req, "tool_choice", None) not in (None, "none", "auto"):
            raise Refusal(400, "tool_choice: 'auto' or 'none' (guided calls are not served)")
        return req

    async def _chat(
        self, trajectory: Trajectory, generate: Generate, body: dict[str, Any]
    ) -> dict[str, Any]:
        req = self._request(body)
        for i, m in enumerate(body["messages"]):
            if m.get("role") not in ROLES:
                raise Refusal(
                    400, f"messages.{i}.role: {m.get('role')!r} (known: {', '.join(ROLES)})"
                )
        messages = [_message(m) for m in body["messages"]]
        tools = body.get("tools") if req.tools else None
        # a final assistant message continued (a prefill), as a vLLM server takes it
        opened = {
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
        }
        ids = trajectory.context_ids(messages, tools, **opened)
        # `max_tokens` read from the body: vLLM's model warns on reading its deprecated field
        limit = req.max_completion_tokens or body.get("max_tokens") or self.sampling.max_new_tokens
        c = await self._sample(trajectory, generate, ids, req, limit)
        content = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = c.finish_reason
        if self.parser is not None and req.tools and req.tool_choice != "none":
            parser = self.parser(self.tokenizer, req.tools)
            req = parser.adjust_request(req)  # tool tags may be special tokens: kept then
            text = self.tokenizer.decode(
                _without_eos(c.token_ids, self.tokenizer),
                skip_special_tokens=req.skip_special_tokens,
            )
            try:
                found = parser.extract_tool_calls(text, req)
            except Exception:  # the model's text broke the parser: it comes back as text
                found = None
            if found is not None and found.tools_called:
                message["content"] = found.content or None
                message["tool_calls"] = [t.model_dump() for t in found.tool_calls]
                finish = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        if req.logprobs:
            choice["logprobs"] = {"content": self._logprobs(c)}
        return self._answer("chat.completion", "chatcmpl", choice, len(ids), c)

    async def _completion(
        self, trajectory: Trajectory, generate: Generate, body: dict[str, Any]
    ) -> dict[str, Any]:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        req = self._request(body, CompletionRequest)
        for name in ("echo", "suffix", "allowed_token_ids"):
            if getattr(req, name, None):
                raise Refusal(400, f"{name}: not served")
        if not isinstance(req.prompt, str):
            raise Refusal(400, "prompt: one text a request (each sample of a group is a rollout)")
        ids = trajectory.text_ids(req.prompt)
        c = await self._sample(trajectory, generate, ids, req, req.max_tokens or 16)
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
            "finish_reason": c.finish_reason,
            "logprobs": None,
        }
        if req.logprobs is not None:
            tokens = [t["token"] for t in self._logprobs(c)]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": list(c.logprobs),
                "top_logprobs": None,
                "text_offset": offsets,
            }
        return self._answer("text_completion", "cmpl", choice, len(ids), c)

    async def _sample(
        self, trajectory: Trajectory, generate: Generate, ids: list[int], req: Any, limit: int
    ) -> Any:
        """One reply from the pool for `ids`, within the request's narrowing of the run's
        sampling; recorded in the trajectory."""
        room = self.max_model_len - len(ids)
        if room < 1:
            raise Refusal(400, f"the prompt is {len(ids)} tokens: no room to generate")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        sampling = replace(
            self.sampling,
            max_new_tokens=min(limit, self.sampling.max_new_tokens, room),
            seed=req.seed if req.seed is not None else self.sampling.seed,
            stop=tuple(stop),
        )
        (c,) = await generate(ids, 1, sampling)
        versions = c.token_versions or [c.policy_version] * len(c.token_ids)
        trajectory.record(c.token_ids, c.logprobs, versions, c.finish_reason == "length")
        return c

    def _answer(self, kind: str, prefix: str, choice: dict, n_prompt: int, c: Any) -> dict:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": len(c.token_ids),
                "total_tokens": n_prompt + len(c.token_ids),
            },
        }

    def _logprobs(self, c: Completion) -> list[dict[str, Any]]:
        out = []
        for token_id, logprob in zip(c.token_ids, c.logprobs, strict=True):
            text = self.tokenizer.decode([token_id])
            out.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [],
                }
            )
        return out

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **self.template_kwargs,
            )
        except Exception as e:  # the template's own refusal (roles must alternate, ...)
            message = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise Refusal(
                400, f"messages: the model's chat template refuses them: {message}"
            ) from None


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the chat template takes it: content parts joined into text."""
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {"role": m["role"], "content": content if content is not None else ""}
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    if "tool_calls" in out:  # templates take the arguments as an object
        out["tool_calls"] = [_call(t) for t in out["tool_calls"]]
    return out


def _call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(ValueError):  # malformed: rendered as the model wrote them
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


def _without_eos(ids: list[int], tokenizer: Any) -> list[int]:
    return ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids


def _default(req: Any, name: str) -> Any:
    return type(req).model_fields[name].get_default(call_default_factory=True)


def _import_vllm_parts() -> None:
    """vLLM's request models (its import takes seconds: once, before the first request)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: F401
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: F401


def tool_parser_names() -> set[str]:
    """The tool-call parsers this vLLM has (`vllm serve --tool-call-parser` names): the
    keys of its lazy table, read from its source, as preflight reads its models (importing
    vLLM takes seconds before Ray); tests/unit/test_harness.py checks both give the same."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    source = Path(spec.origin).parent / "tool_parsers" / "__init__.py"  # type: ignore[union-attr]
    table = "_TOOL_PARSERS_TO_REGISTER"
    for node in ast.parse(source.read_text()).body:
        named = isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == table for t in node.targets
        )
        if named and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return set(_imported_tool_parser_names())


def _imported_tool_parser_names() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def _tool_parser(name: str) -> Any:
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser(name)


def _json(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status)
