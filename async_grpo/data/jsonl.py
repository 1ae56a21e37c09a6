"""Load and validate prompt JSONL files; every problem names the file, line and field."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_grpo.errors import UserError
from async_grpo.text import NOT_UNICODE, not_unicode, text_lines


class DataError(UserError):
    """A data file that does not match the schema: `FILE:LINE: field 'x': problem`."""


@dataclass
class Prompt:
    """One training prompt. `input_token_ids`, when present, is the full templated prompt."""

    input: str
    answer: Any
    input_token_ids: list[int] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    line: int = 0  # 1-based line in the source file, for error messages
    prefill: str = ""  # text the model's turn starts with (part of the prompt, not sampled)
    messages: list[dict[str, Any]] | None = None  # the conversation rendered (chat rows)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"input": self.input, "answer": self.answer}
        if self.input_token_ids is not None:
            row["input_token_ids"] = self.input_token_ids
        if self.metadata:
            row["metadata"] = self.metadata
        if self.prefill:
            row["prefill"] = self.prefill
        return row


_KNOWN = {"input", "answer", "input_token_ids", "metadata", "prefill"}


def parse_line(text: str, where: str, lineno: int) -> Prompt:
    """Validate one JSONL line; raise `DataError` naming `where:lineno` and the field."""
    loc = f"{where}:{lineno}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{loc}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"{loc}: expected a JSON object, got {type(row).__name__}")
    bad = not_unicode(row)
    if bad is not None:
        raise DataError(f"{loc}: field '{bad}': {NOT_UNICODE}")
    for key in ("input", "answer"):
        if key not in row:
            raise DataError(f"{loc}: field '{key}': missing (required: input, answer)")
    unknown = sorted(set(row) - _KNOWN)
    if unknown:
        raise DataError(
            f"{loc}: field '{unknown[0]}': unknown (known: {', '.join(sorted(_KNOWN))})"
        )
    if not isinstance(row["input"], str) or not row["input"].strip():
        raise DataError(f"{loc}: field 'input': expected a non-empty string")
    ids = row.get("input_token_ids")
    if ids is not None and (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise DataError(f"{loc}: field 'input_token_ids': expected a non-empty list of token ids")
    meta = row.get("metadata", {})
    if not isinstance(meta, dict):
        raise DataError(f"{loc}: field 'metadata': expected an object")
    prefill = row.get("prefill", "")
    if not isinstance(prefill, str):
        raise DataError(f"{loc}: field 'prefill': expected a string")
    return Prompt(row["input"], row["answer"], ids, meta, lineno, prefill)


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read every line of a prompt JSONL (blank lines are skipped); fail on the first bad one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    prompts = []
    for lineno, text in enumerate(text_lines(path), start=1):
        if text.strip():
            prompts.append(parse_line(text, str(path), lineno))
    if not prompts:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return prompts


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows atomically (temp file + rename): a failure leaves no half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n
