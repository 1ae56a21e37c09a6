"""Text that crosses into the project: files a user hands us, strings an environment sends.

Every file the CLI and a run read as text (data, held-out data, YAML configs, metrics and
timelines) goes through `text_lines` or `read_text`: bytes that are not UTF-8 are a
`UserError` naming the file, the line and the byte, never a `UnicodeDecodeError`.
Parsed values (a JSON row, a YAML tree) can still hold a lone surrogate (the escape
`"\\ud800"`); `not_unicode` finds it. Untrusted strings at run time (an environment's
observation) are made valid with `valid_text`, which says how many code points it replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from async_grpo.errors import UserError

REPLACEMENT = "\ufffd"
NOT_UNICODE = "not valid Unicode (a lone surrogate such as \\ud800)"  # what `not_unicode` finds


def text_lines(path: str | Path) -> Iterator[str]:
    """The lines of a UTF-8 file, each with its `\\n` (only `\\n` ends a line), read one at
    a time; a line that is not UTF-8 raises `UserError("FILE:LINE: not UTF-8: ...")`."""
    offset = 0
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{path}:{lineno}: not UTF-8: byte 0x{raw[e.start]:02x} at column"
                    f" {e.start + 1} (byte {offset + e.start} of the file); expected UTF-8 text"
                ) from None
            offset += len(raw)


def read_text(path: str | Path) -> str:
    """The whole of a UTF-8 file; bytes that are not UTF-8 raise `UserError` as in
    `text_lines`."""
    return "".join(text_lines(path))


def not_unicode(value: Any, where: str = "") -> str | None:
    """Where the first string in `value` (dicts and lists nested, keys included) that is
    not valid Unicode (it holds a lone surrogate) is, as `where.key[index]`; None if all
    are valid."""
    if isinstance(value, str):
        return None if _encodes(value) else where
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and not _encodes(key):
                return inner
            found = not_unicode(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = not_unicode(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def valid_text(text: str) -> tuple[str, int]:
    """(`text` as valid Unicode, how many code points were replaced): each lone surrogate
    becomes U+FFFD; a high surrogate followed by a low one (a UTF-16 pair split in two
    code points) becomes the character the pair stands for."""
    if _encodes(text):
        return text, 0
    fixed = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return fixed, fixed.count(REPLACEMENT) - text.count(REPLACEMENT)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
