"""Every row of a large dataset checked before a run starts, without reading it into Python.

Rendering a million prompts through the chat template and tokenizing them costs minutes
(docs/data.md); reading each row into Python to check it costs seconds. `screen` reads the
columns with Arrow compute instead and returns two arrays, one entry per row:

- `suspect`: the row might break a rule of `rows.source_rows` (a null, an empty prompt, a
  message without role or content, an unknown role, no user turn with text, a value JSON
  cannot hold, text that is not UTF-8, a column of a type the screen does not know, a
  conversation the chat template refuses). Suspects go through the exact check in Python,
  which raises the row's one-line error or clears it; a row the screen does not suspect
  passes that check for certain.
- `bound`: at least as many tokens as the row's prompt will have: the bytes of its
  rendered text (no tokenizer here makes a token of less than one byte of text; a test
  holds every tokenizer the project ships to it), plus `SLACK`. A row whose bound reaches
  the context is rendered and tokenized exactly before the run.

The rendered text's bytes come from the conversation's shape (its roles in order): each
shape is rendered once with empty contents and once with markers, which gives the
template's own bytes and how many times it repeats a message's content.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from async_grpo.data.rows import OPTIONAL, ROLES, RowSpec, conversation

# a character `str.strip()` keeps (RE2: \s is ASCII, \pZ the Unicode separators)
NONSPACE = r"[^\s\x0b\x1c-\x1f\x85\pZ]"
SLACK = 16  # tokens: a template's branches on content, a tokenizer's leading space
BATCH_ROWS = 65536


def screen(table: Any, spec: RowSpec, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """(`suspect`, `bound`) for every row of the pyarrow `table` (module docstring)."""
    import pyarrow as pa

    n = table.num_rows
    read = [spec.prompt_key, spec.answer_key, *(c for c in OPTIONAL if c in table.column_names)]
    try:
        for name in read:
            table.column(name).validate(full=True)
    except pa.ArrowInvalid:  # bytes that are not UTF-8: the exact check names the row
        return np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64)
    shapes = Shapes(spec, tokenizer)
    suspect, bound, start = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64), 0
    for batch in table.select(read).to_batches(max_chunksize=BATCH_ROWS):
        end = start + batch.num_rows
        suspect[start:end], bound[start:end] = _batch(batch, spec, shapes)
        start = end
    return suspect, bound


class Shapes:
    """A conversation shape (roles joined by commas) -> (template bytes, content repeats),
    rendered once each; None for a shape the chat template refuses."""

    def __init__(self, spec: RowSpec, tokenizer: Any) -> None:
        self.spec, self.tokenizer, self.known = spec, tokenizer, {}
        plain = tokenizer("").input_ids if not spec.chat else []
        self.plain_specials = len(plain) + 1  # BOS/EOS, a leading space

    def __call__(self, key: str) -> tuple[int, int] | None:
        if key not in self.known:
            self.known[key] = self._probe(key.split(",")) if key else None
        return self.known[key]

    def _probe(self, roles: list[str]) -> tuple[int, int] | None:
        markers = [f"QzMark{i}Zq" for i in range(len(roles))]
        try:
            marked, empty = (
                self._render(
                    [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
                )
                for contents in (markers, [""] * len(roles))
            )
        except Exception:  # the template refuses it (e.g. roles that must alternate)
            return None
        repeats = max(marked.count(m) for m in markers)
        own = len(marked.encode()) - sum(marked.count(m) * len(m) for m in markers)
        return max(own, len(empty.encode())), max(repeats, 1)

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(
            conversation({"messages": messages, "text": ""}, self.spec),
            add_generation_prompt=True,
            tokenize=False,
            **self.spec.template_kwargs,
        )


def _batch(batch: Any, spec: RowSpec, shapes: Shapes) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa
    import pyarrow.compute as pc

    m = batch.num_rows
    names = batch.schema.names
    prompt = batch.column(names.index(spec.prompt_key))
    suspect = _null(prompt)
    if _is_text(prompt.type):
        suspect |= ~_np(pc.match_substring_regex(prompt, NONSPACE))
        content = _np(pc.binary_length(prompt), 0).astype(np.int64)
        keys = None
    elif _is_messages(prompt.type) and spec.chat:
        suspect, content, keys = _messages(prompt, suspect)
    else:  # a type the screen does not read, or messages with prompt_format: plain
        return np.ones(m, dtype=bool), np.zeros(m, dtype=np.int64)
    if not spec.chat:
        bound = content + shapes.plain_specials
    else:
        bound = _templated(content, keys, shapes, suspect)
    answer = batch.column(names.index(spec.answer_key))
    suspect |= _null(answer) | _unsafe(answer)
    if "metadata" in names:
        metadata = batch.column(names.index("metadata"))
        known = pa.types.is_struct(metadata.type) or pa.types.is_null(metadata.type)
        suspect |= _unsafe(metadata) if known else True
    if "prefill" in names:
        prefill = batch.column(names.index("prefill"))
        if not (_is_text(prefill.type) or pa.types.is_null(prefill.type)):
            suspect |= True
        else:
            bound = bound + _np(pc.binary_length(prefill), 0).astype(np.int64) + 1
    if "input_token_ids" in names:
        ids = batch.column(names.index("input_token_ids"))
        given, good, length = _token_ids(ids)
        suspect |= given & ~good
        bound = np.where(given, length, bound)
    return suspect, bound + SLACK


def _messages(prompt: Any, suspect: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
    """Rows of {role, content} messages: suspects, content bytes, and each row's shape."""
    import pyarrow as pa
    import pyarrow.compute as pc

    m = len(prompt)
    lengths = _np(pc.list_value_length(prompt), 0)
    flat = pc.list_flatten(prompt)
    parents = _np(pc.list_parent_indices(prompt))
    role, text = pc.struct_field(flat, "role"), pc.struct_field(flat, "content")
    known = pc.is_in(role, value_set=pa.array(ROLES))
    bad = _null(flat) | _null(role) | _null(text) | ~_np(known)
    has_text = _np(pc.and_(pc.equal(role, "user"), pc.match_substring_regex(text, NONSPACE)))
    suspect = suspect | (lengths == 0)
    suspect |= np.bincount(parents, weights=bad, minlength=m) > 0
    suspect |= np.bincount(parents, weights=has_text, minlength=m) == 0
    content = np.bincount(parents, weights=_np(pc.binary_length(text), 0), minlength=m)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
    roles = pa.ListArray.from_arrays(offsets, pc.fill_null(role, "?"))
    return suspect, content.astype(np.int64), pc.binary_join(roles, ",")


def _templated(content: np.ndarray, keys: Any, shapes: Shapes, suspect: np.ndarray) -> np.ndarray:
    """Bytes of each row's rendered text: its shape's template bytes plus its content as
    many times as the template repeats it; a row of a refused shape is made a suspect
    (in `suspect`, in place)."""
    import pyarrow.compute as pc

    if keys is None:  # a string prompt: one user turn
        found = shapes("user")
        if found is None:
            suspect |= True
        own, repeats = found or (0, 1)
        return own + repeats * content
    coded = pc.dictionary_encode(keys)
    found = [shapes(k) for k in coded.dictionary.to_pylist()]
    index = _np(coded.indices)
    refused = np.array([f is None for f in found])
    own = np.array([f[0] if f else 0 for f in found], dtype=np.int64)
    repeats = np.array([f[1] if f else 1 for f in found], dtype=np.int64)
    suspect |= refused[index]
    return own[index] + repeats[index] * content


def _token_ids(ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows that give their own token ids, whether those are a non-empty list of
    non-negative integers, and their count."""
    import pyarrow as pa
    import pyarrow.compute as pc

    m = len(ids)
    if pa.types.is_null(ids.type):
        return np.zeros(m, dtype=bool), np.ones(m, dtype=bool), np.zeros(m, dtype=np.int64)
    given = ~_null(ids)
    if not (_is_list(ids.type) and pa.types.is_integer(ids.type.value_type)):
        return given, np.zeros(m, dtype=bool), np.zeros(m, dtype=np.int64)
    length = _np(pc.list_value_length(ids), 0).astype(np.int64)
    values = pc.list_flatten(ids)
    negative = _null(values) | _np(pc.less(values, 0))
    parents = _np(pc.list_parent_indices(ids))
    good = (length > 0) & (np.bincount(parents, weights=negative, minlength=m) == 0)
    return given, good, length


def _unsafe(values: Any) -> np.ndarray:
    """Rows whose value JSON might not hold (NaN or infinity, bytes, dates, ...): the exact
    check decides."""
    import pyarrow as pa
    import pyarrow.compute as pc

    m, t = len(values), values.type
    if _is_text(t) or pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_null(t):
        return np.zeros(m, dtype=bool)
    if pa.types.is_floating(t):
        return ~_np(pc.is_finite(values), True)
    if pa.types.is_struct(t):
        out = np.zeros(m, dtype=bool)
        for i in range(t.num_fields):
            out |= _unsafe(pc.struct_field(values, [i]))
        return out
    if _is_list(t):
        inner = _unsafe(pc.list_flatten(values))
        parents = _np(pc.list_parent_indices(values))
        return np.bincount(parents, weights=inner, minlength=m) > 0
    return np.ones(m, dtype=bool)


def _is_text(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_messages(t: Any) -> bool:
    """A list of structs with text `role` and `content` fields (others may sit beside)."""
    import pyarrow as pa

    if not _is_list(t) or not pa.types.is_struct(t.value_type):
        return False
    fields = {f.name: f.type for f in t.value_type}
    return all(k in fields and _is_text(fields[k]) for k in ("role", "content"))


def _null(values: Any) -> np.ndarray:
    return _np(values.is_null())


def _np(values: Any, null: Any = False) -> np.ndarray:
    """A pyarrow array as numpy, nulls as `null`."""
    import pyarrow.compute as pc

    if values.null_count:
        values = pc.fill_null(values, null)
    return values.to_numpy(zero_copy_only=False)
