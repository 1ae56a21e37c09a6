"""Prompts by index from any dataset, every row checked before the run.

`prepare_table` reads the rows (data/forms.py) and checks every one before a run starts:
- rows read by column name (`dataset.prompt_key`, `dataset.answer_key`) are screened by
  Arrow (data/screen.py): the suspects and the rows that might not fit the context get the
  exact check in Python (data/rows.py); the table is the source itself (`SourceTable`), a
  prompt rendered and tokenized when it is drawn. A million rows are ready in seconds.
- rows shaped by `dataset.map` go through the function, are checked and tokenized a batch
  at a time and written once as an Arrow file in the `datasets` cache, named by a hash of
  everything that shapes it (the source's fingerprint, the tokenizer's files, the settings,
  the map function's source): a second start opens that file (`PromptTable`).

Both are read-only sequences of `Prompt`s: `table[i]` reads row i, `len(table)` is the row
count, and they pickle as their arguments (a Ray actor that receives one opens the same
rows). The sampler, the curriculum and exact resume address prompts by index, so they work
the same on any form and any size.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_grpo.data.jsonl import DataError, Prompt

if TYPE_CHECKING:
    from async_grpo.config import DatasetConfig

PREPARED_VERSION = 2  # bump when the prepared columns or their meaning change
BATCH_ROWS = 1000
TOKENIZER_FILES = ("tokenizer", "chat_template", "special_tokens", "vocab", "merges", "added")


class PromptTable:
    """A prepared prompt file as a sequence of `Prompt`s (the first `limit` rows when set)."""

    def __init__(self, path: str | Path, source: str = "", limit: int | None = None) -> None:
        from datasets import Dataset

        self.path, self.source, self.limit = str(path), source, limit
        self.rows = Dataset.from_file(self.path)  # memory-mapped, nothing read yet
        self._len = len(self.rows) if limit is None else min(limit, len(self.rows))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Prompt:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if start != 0 or step != 1:
                raise TypeError("a PromptTable slices as [:n] only")
            return self._head(stop)
        if not -self._len <= index < self._len:
            raise IndexError(f"prompt {index} of {self._len}")
        return self._read(index % self._len)

    def _read(self, index: int) -> Prompt:
        return _prompt(self.rows[index])

    def _head(self, n: int) -> PromptTable:
        return PromptTable(self.path, self.source, n)

    def texts(self) -> Any:
        """Each prompt's text (`Prompt.input`) as a pyarrow array, without reading the rows."""
        return self.column("input")

    def gives_ids(self) -> Any:
        """Whether any prompt came with its own token ids (no rendered text)."""
        import pyarrow.compute as pc

        return bool(pc.any(pc.equal(self.column("rendered"), "")).as_py())

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(self._len))

    def column(self, name: str) -> Any:
        """One prepared column as a pyarrow ChunkedArray (input, rendered, row, ...)."""
        return self.rows.data.column(name).slice(0, self._len)

    def __reduce__(self) -> tuple:
        return (PromptTable, (self.path, self.source, self.limit))

    def __repr__(self) -> str:
        return f"PromptTable({self.source or self.path}, {self._len} prompts)"


class SourceTable(PromptTable):
    """The source's own rows as prompts (checked whole by `prepare_table` before the run),
    each rendered and tokenized when it is read: nothing is prepared ahead or written.
    Pickles as its arguments, with the tokenizer it was given (`_portable`: where it
    pickles); the process that unpickles it opens the same rows."""

    def __init__(
        self,
        path: str | Path,
        model_dir: str | Path,
        max_model_len: int,
        format: str,
        dataset: DatasetConfig,
        limit: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        from async_grpo.data.forms import open_rows

        self.args = (str(path), str(model_dir), max_model_len, format, dataset)
        self.path = self.source = str(path)
        self.limit = limit
        self._given = self._tokenizer = tokenizer  # only a given one travels when pickled
        self.rows = open_rows(path, dataset.split)
        self.spec = row_spec(path, dataset, format, max_model_len)
        self._len = len(self.rows) if limit is None else min(limit, len(self.rows))

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from async_grpo.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.args[1])
        return self._tokenizer

    def _read(self, index: int) -> Prompt:
        from async_grpo.data.rows import encode, source_rows

        rows = source_rows(self.rows[index : index + 1], [index], self.spec)
        return _prompt({k: v[0] for k, v in encode(rows, self.tokenizer, self.spec).items()})

    def _head(self, n: int) -> PromptTable:
        return SourceTable(*self.args, limit=n, tokenizer=self._given)

    def texts(self) -> Any:
        """The prompt column's text, or each conversation's last user turn."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        column = self.rows.data.column(self.spec.prompt_key).slice(0, self._len)
        column = column.combine_chunks()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            return column
        flat = pc.list_flatten(column)
        parents = pc.list_parent_indices(column).to_numpy()
        user = np.flatnonzero(pc.fill_null(pc.equal(pc.struct_field(flat, "role"), "user"), False))
        last = np.full(len(column), -1)
        last[parents[user]] = user  # in order: the last user turn of each row stays
        content = pc.struct_field(flat, "content")
        return pc.take(content, pa.array(last, mask=last < 0))

    def gives_ids(self) -> bool:
        names = self.rows.column_names
        if "input_token_ids" not in names:
            return False
        return self.rows.data.column("input_token_ids").null_count < len(self.rows)

    def column(self, name: str) -> Any:
        if name == "row":
            import pyarrow as pa

            return pa.chunked_array([pa.array(range(1, self._len + 1), pa.int64())])
        return self.rows.data.column(name).slice(0, self._len)

    def __reduce__(self) -> tuple:
        return (SourceTable, (*self.args, self.limit, self._given))

    def __repr__(self) -> str:
        return f"SourceTable({self.source}, {self._len} prompts)"


def _portable(tokenizer: Any) -> Any:
    """`tokenizer` where it pickles, else None (the reader then loads it by path). A fast
    tokenizer pickles: the process that reads the rows (the batcher) then never imports
    `AutoTokenizer`, whose import brings transformers' model classes and torch's compiler
    (AMX Xeon: 1.1 s to unpickle SmolLM2's, 5.0 s to import and load it)."""
    import pickle

    if tokenizer is None:
        return None
    try:
        pickle.dumps(tokenizer)
    except Exception:  # a tokenizer class that does not pickle: loaded by path instead
        return None
    return tokenizer


def _prompt(r: dict[str, Any]) -> Prompt:
    """A prepared row (the columns `rows.encode` makes) as a `Prompt`."""
    return Prompt(
        input=r["input"],
        answer=json.loads(r["answer"]),
        input_token_ids=list(r["input_token_ids"]),
        metadata=json.loads(r["metadata"]),
        line=r["row"],
        prefill=r["prefill"],
        messages=json.loads(r["messages"]) if r.get("messages") else None,
    )


def row_spec(path: str | Path, d: DatasetConfig, format: str, max_model_len: int) -> Any:
    """The `dataset` settings that shape each row, as `rows.RowSpec`."""
    from async_grpo.data.rows import RowSpec, import_map

    return RowSpec(
        where=str(path),
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        map_fn=import_map(d.map) if d.map else None,
        map_name=d.map or "",
        system_prompt=d.system_prompt,
        chat=format == "chat",
        template_kwargs=dict(d.chat_template_kwargs),
        max_model_len=max_model_len,
    )


def prepare_table(
    path: str | Path,
    model_dir: str | Path,
    max_model_len: int,
    format: str = "chat",
    dataset: DatasetConfig | None = None,
) -> PromptTable:
    """Every row of `path` checked; the first bad row raises a one-line `DataError`
    (`FILE:ROW: column 'x'`). Rows read by column name are screened by Arrow
    (data/screen.py) and become a `SourceTable`; rows shaped by `dataset.map` go through
    the function, are tokenized and are written once (a `PromptTable` of that file)."""
    from async_grpo.config import DatasetConfig
    from async_grpo.data.forms import open_rows
    from async_grpo.models import load_tokenizer

    d = dataset or DatasetConfig()
    source = open_rows(path, d.split)
    spec = row_spec(path, d, format, max_model_len)
    if len(source) == 0:
        raise DataError(f"{path}: no prompts (the dataset is empty)")
    if spec.map_fn is None:
        _check_columns(path, source, spec)
    tokenizer = load_tokenizer(model_dir)
    if spec.chat and not tokenizer.chat_template:
        raise DataError(
            f"model {model_dir}: no chat template for prompt_format: chat; set"
            " prompt_format=plain to use the prompts as plain text (base models)"
        )
    if spec.map_fn is None:
        _check_rows(source, tokenizer, spec)
        return SourceTable(
            path, model_dir, max_model_len, format, d, tokenizer=_portable(tokenizer)
        )
    out = _cache_dir() / f"prompts-{_key(source, model_dir, max_model_len, format, d)}.arrow"
    if not out.is_file():
        _write(source, tokenizer, spec, out)
    return PromptTable(out, str(path))


def _check_rows(source: Any, tokenizer: Any, spec: Any) -> None:
    """Every row screened by Arrow; the suspects, and the rows that might not fit the
    context, checked (and rendered and tokenized) exactly, in order."""
    import numpy as np

    from async_grpo.data.forms import not_utf8
    from async_grpo.data.rows import encode, source_rows
    from async_grpo.data.screen import screen

    if source._indices is not None:  # a selection of rows: the screen reads whole columns
        source = source.flatten_indices()
    suspect, bound = screen(source.data.table, spec, tokenizer)
    if spec.max_model_len:
        suspect |= bound >= spec.max_model_len
    todo = np.flatnonzero(suspect)
    for k in range(0, len(todo), BATCH_ROWS):
        indices = todo[k : k + BATCH_ROWS].tolist()
        try:
            rows = source_rows(source[indices], indices, spec)
        except UnicodeDecodeError:  # Arrow holds the bytes as they were: name the row
            raise not_utf8(spec.where, source, indices) from None
        encode(rows, tokenizer, spec)


def _check_columns(path: str | Path, source: Any, spec: Any) -> None:
    """The columns the rows are read from exist (one check for the whole file)."""
    columns = source.column_names
    for role, key in (("prompt_key", spec.prompt_key), ("answer_key", spec.answer_key)):
        if key not in columns:
            raise DataError(
                f"{path}:1: column '{key}': missing (dataset.{role}; the columns:"
                f" {', '.join(columns)})"
            )


def _write(source: Any, tokenizer: Any, spec: Any, out: Path) -> None:
    """Run the rows through `rows.encode` a batch at a time into `out` (written whole or
    not at all: `datasets` writes a temporary file and renames it)."""
    from datasets import Features, List, Value

    from async_grpo.data.forms import not_utf8
    from async_grpo.data.rows import encode, source_rows

    features = Features(
        {
            "input": Value("string"),
            "rendered": Value("string"),
            "input_token_ids": List(Value("int32")),
            "answer": Value("string"),
            "metadata": Value("string"),
            "prefill": Value("string"),
            "messages": Value("string"),
            "row": Value("int64"),
        }
    )

    def prepared(batch: Any, indices: list[int]) -> dict[str, list]:
        try:
            rows = source_rows(batch, indices, spec)
        except UnicodeDecodeError:  # Arrow holds the bytes as they were: name the row
            raise not_utf8(spec.where, source, indices) from None
        return encode(rows, tokenizer, spec)

    out.parent.mkdir(parents=True, exist_ok=True)
    source.map(
        prepared,
        batched=True,
        batch_size=BATCH_ROWS,
        with_indices=True,
        remove_columns=source.column_names,
        features=features,
        cache_file_name=str(out),
        load_from_cache_file=False,
        new_fingerprint=out.stem,
        desc="preparing prompts",
    )


def _cache_dir() -> Path:
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "async_grpo_prompts"


def _key(source: Any, model_dir: str | Path, max_model_len: int, format: str, d: Any) -> str:
    """A hash of every input that shapes the prepared file."""
    h = hashlib.sha256()
    settings = {
        "version": PREPARED_VERSION,
        "source": source._fingerprint,
        "rows": len(source),
        "max_model_len": max_model_len,
        "format": format,
        "dataset": {k: v for k, v in vars(d).items() if k != "split"},
    }
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file() and f.name.startswith(TOKENIZER_FILES):
            h.update(f.name.encode() + f.read_bytes())
    if d.map:  # the function's own source: an edited map prepares again
        from async_grpo.data.rows import import_map

        fn = import_map(d.map)
        try:
            h.update(inspect.getsource(inspect.getmodule(fn)).encode())
        except (OSError, TypeError):  # no source to read (a built-in): its name is the key
            h.update(d.map.encode())
    return h.hexdigest()[:32]
