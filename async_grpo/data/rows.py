"""Rows of any dataset into prompt columns, a batch at a time, each row checked.

In: a batch of the source's rows (columns as the file has them), the `dataset` config, the
tokenizer. Out: the columns of a prepared prompt file (`PREPARED`): the prompt as text,
the rendered text, its token ids, and the answer and metadata as JSON text (any JSON value
round-trips, whatever Arrow made of it). Every problem is one `DataError` naming
`FILE:ROW: column 'x'` (ROW 1-based within the split). Nothing from the data is evaluated.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from async_grpo.data.jsonl import DataError
from async_grpo.text import NOT_UNICODE, not_unicode

ROLES = ("system", "user", "assistant", "tool")
OPTIONAL = ("metadata", "prefill", "input_token_ids")  # read when the source has them


@dataclass
class RowSpec:
    """What the rows are read as: the `dataset` config's part that shapes each row."""

    where: str  # the file, for messages
    prompt_key: str = "input"
    answer_key: str = "answer"
    map_fn: Callable[[dict[str, Any]], Any] | None = None
    map_name: str = ""
    system_prompt: str | None = None
    chat: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 0


def import_map(spec: str) -> Callable[[dict[str, Any]], Any]:
    """`module:function` -> the function; a `DataError` naming `dataset.map` otherwise."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise DataError(f"dataset.map: expected module:function, got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise DataError(f"dataset.map: cannot import {module} ({e})") from None
    except AttributeError:
        raise DataError(f"dataset.map: {module} has no function {name!r}") from None
    if not callable(fn):
        raise DataError(f"dataset.map: {spec} is not callable")
    return fn


def source_rows(batch: dict[str, list], indices: list[int], spec: RowSpec) -> list[dict]:
    """Each row of the batch as {prompt, answer, metadata, prefill, input_token_ids, row}."""
    keys = list(batch)
    out = []
    for k, index in enumerate(indices):
        row = index + 1
        if spec.map_fn is None:
            item = {
                "prompt": batch[spec.prompt_key][k],
                "answer": batch[spec.answer_key][k],
                **{name: batch[name][k] for name in OPTIONAL if name in batch},
            }
            names = {"prompt": spec.prompt_key, "answer": spec.answer_key}
        else:
            item = _mapped({key: batch[key][k] for key in keys}, row, spec)
            names = {"prompt": "prompt", "answer": "answer"}
        out.append(_checked(item, row, names, spec))
    return out


def _mapped(source: dict[str, Any], row: int, spec: RowSpec) -> dict[str, Any]:
    loc = f"{spec.where}:{row}"
    try:
        item = spec.map_fn(source)
    except Exception as e:  # the user's function failed on this row: said with the row
        message = (str(e).splitlines() or [""])[0][:200]
        raise DataError(
            f"{loc}: dataset.map {spec.map_name} failed: {type(e).__name__}: {message}"
        ) from None
    if not isinstance(item, dict):
        raise DataError(
            f"{loc}: dataset.map {spec.map_name}: expected a dict with prompt and answer,"
            f" got {type(item).__name__}"
        )
    for key in ("prompt", "answer"):
        if key not in item:
            raise DataError(
                f"{loc}: column '{key}': missing from dataset.map {spec.map_name}'s dict"
            )
    unknown = sorted(set(item) - {"prompt", "answer", *OPTIONAL})
    if unknown:
        raise DataError(
            f"{loc}: column '{unknown[0]}': unknown in dataset.map {spec.map_name}'s dict"
            " (known: prompt, answer, metadata, prefill, input_token_ids)"
        )
    return item


def _checked(item: dict[str, Any], row: int, names: dict[str, str], spec: RowSpec) -> dict:
    loc = f"{spec.where}:{row}"
    prompt, answer = item["prompt"], item["answer"]
    pname, aname = names["prompt"], names["answer"]
    bad = not_unicode(item)
    if bad is not None:
        column = names.get(bad.split(".")[0].split("[")[0], bad)
        raise DataError(f"{loc}: column '{column}': {NOT_UNICODE}")
    if prompt is None:
        raise DataError(f"{loc}: column '{pname}': missing (null)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{loc}: column '{pname}': empty prompt")
        messages = None
    elif isinstance(prompt, list):
        messages = _messages(prompt, loc, pname)
        if not spec.chat:
            raise DataError(
                f"{loc}: column '{pname}': a list of messages needs prompt_format: chat"
                " (plain takes text only)"
            )
    else:
        raise DataError(
            f"{loc}: column '{pname}': expected a string or a list of {{role, content}}"
            f" messages, got {_kind(prompt)}"
        )
    if answer is None:
        raise DataError(f"{loc}: column '{aname}': missing (null)")
    metadata = item.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise DataError(f"{loc}: column 'metadata': expected an object, got {_kind(metadata)}")
    # Arrow gives every row every key any row has (null where a row lacks it): drop those
    metadata = {k: v for k, v in metadata.items() if v is not None}
    prefill = item.get("prefill") or ""
    if not isinstance(prefill, str):
        raise DataError(f"{loc}: column 'prefill': expected a string, got {_kind(prefill)}")
    ids = item.get("input_token_ids")
    if ids is not None and (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise DataError(f"{loc}: column 'input_token_ids': expected a non-empty list of token ids")
    return {
        "text": prompt if messages is None else messages[-1 - _last_user(messages)]["content"],
        "messages": messages,
        "answer": _json(answer, loc, aname),
        "metadata": _json(metadata, loc, "metadata"),
        "prefill": prefill,
        "input_token_ids": ids,
        "row": row,
        "prompt_name": pname,
    }


def _messages(prompt: list, loc: str, name: str) -> list[dict[str, str]]:
    if not prompt:
        raise DataError(f"{loc}: column '{name}': empty list of messages")
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(
                f"{loc}: column '{name}': message {i}: expected {{role, content}}, got {_kind(m)}"
            )
        if m["role"] not in ROLES:
            raise DataError(
                f"{loc}: column '{name}': message {i}: role {m['role']!r} (known: {', '.join(ROLES)})"
            )
        if not isinstance(m.get("content"), str):
            raise DataError(
                f"{loc}: column '{name}': message {i}: content: expected a string,"
                f" got {_kind(m.get('content'))}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise DataError(f"{loc}: column '{name}': no user turn among the messages")
    if not any(m["content"].strip() for m in out if m["role"] == "user"):
        raise DataError(f"{loc}: column '{name}': empty prompt (every user turn is empty)")
    return out


def _last_user(messages: list[dict[str, str]]) -> int:
    """How far from the end the last user turn is (0: it is the last message)."""
    return next(i for i, m in enumerate(reversed(messages)) if m["role"] == "user")


def _json(value: Any, loc: str, name: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise DataError(
            f"{loc}: column '{name}': expected JSON values (text, numbers, lists, objects),"
            f" got {_kind(value)} ({e})"
        ) from None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def encode(rows: list[dict], tokenizer: Any, spec: RowSpec) -> dict[str, list]:
    """The prepared columns of checked rows: rendered (the chat template with the turn
    opened, or the text as it is), tokenized in one call, the prefill's tokens after."""
    todo = [r for r in rows if r["input_token_ids"] is None]
    if todo and spec.chat:
        texts = _rendered(todo, tokenizer, spec)
        ids = tokenizer(texts, add_special_tokens=False).input_ids
    elif todo:
        texts = [r["text"] for r in todo]
        ids = tokenizer(texts).input_ids
    for r, text, tokens in zip(todo, texts if todo else [], ids if todo else [], strict=True):
        r["rendered"], r["input_token_ids"] = text, list(tokens)
    with_prefill = [r for r in todo if r["prefill"]]
    if with_prefill:
        extra = tokenizer([r["prefill"] for r in with_prefill], add_special_tokens=False).input_ids
        for r, tokens in zip(with_prefill, extra, strict=True):
            r["input_token_ids"] += tokens
            r["rendered"] += r["prefill"]
    for r in rows:
        n = len(r["input_token_ids"])
        if spec.max_model_len and n >= spec.max_model_len:
            raise DataError(
                f"{spec.where}:{r['row']}: column '{r['prompt_name']}': {n} prompt tokens leave"
                f" no room to generate in generation.max_model_len={spec.max_model_len}"
            )
    return {
        "input": [r["text"] for r in rows],
        "rendered": [r.get("rendered", "") for r in rows],
        "input_token_ids": [r["input_token_ids"] for r in rows],
        "answer": [r["answer"] for r in rows],
        "metadata": [r["metadata"] for r in rows],
        "prefill": [r["prefill"] for r in rows],
        "messages": [json.dumps(conversation(r, spec)) if spec.chat else "" for r in rows],
        "row": [r["row"] for r in rows],
    }


def _rendered(rows: list[dict], tokenizer: Any, spec: RowSpec) -> list[str]:
    """The rows through the chat template in one call; a row the template refuses (its
    own `raise_exception`, e.g. roles that must alternate) is one `DataError` naming it."""

    def render(chats: list) -> list[str]:
        return tokenizer.apply_chat_template(
            chats, add_generation_prompt=True, tokenize=False, **spec.template_kwargs
        )

    chats = [conversation(r, spec) for r in rows]
    try:
        return render(chats)
    except Exception:  # find the row: the template's own words, first line
        for r, chat in zip(rows, chats, strict=True):
            try:
                render([chat])
            except Exception as e:
                message = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise DataError(
                    f"{spec.where}:{r['row']}: column '{r['prompt_name']}': the model's chat"
                    f" template refuses these messages: {message}"
                ) from None
        raise


def conversation(row: dict, spec: RowSpec) -> list[dict[str, str]]:
    """The messages a row is rendered as: its own, or its text as one user turn, after
    `dataset.system_prompt` where the row has no system message of its own."""
    messages = row["messages"] or [{"role": "user", "content": row["text"]}]
    if spec.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": spec.system_prompt}, *messages]
    return messages
