"""Prepared prompts: every row of a dataset checked and tokenized once, kept on disk.

`prepare_table` reads the rows (data/forms.py), checks and tokenizes them a batch at a time
with the fast tokenizer (data/rows.py) and writes the result as one Arrow file in the
`datasets` cache, named by a hash of everything that shapes it (the source's fingerprint,
the tokenizer's files, the `dataset` settings, the format and the context length): a second
start with the same inputs opens the file instead of tokenizing again.

`PromptTable` is that file as a read-only sequence of `Prompt`s, memory-mapped: `table[i]`
reads row i, `len(table)` is the row count, and it pickles as its path (a Ray actor that
receives it opens the same file). The sampler, the curriculum and exact resume address
prompts by index, so they work the same on any form and any size.
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

PREPARED_VERSION = 1  # bump when the prepared columns or their meaning change
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
            return PromptTable(self.path, self.source, stop)
        if not -self._len <= index < self._len:
            raise IndexError(f"prompt {index} of {self._len}")
        r = self.rows[index % self._len]
        return Prompt(
            input=r["input"],
            answer=json.loads(r["answer"]),
            input_token_ids=r["input_token_ids"],
            metadata=json.loads(r["metadata"]),
            line=r["row"],
            prefill=r["prefill"],
        )

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(self._len))

    def column(self, name: str) -> Any:
        """One prepared column as a pyarrow ChunkedArray (input, rendered, row, ...)."""
        return self.rows.data.column(name).slice(0, self._len)

    def __reduce__(self) -> tuple:
        return (PromptTable, (self.path, self.source, self.limit))

    def __repr__(self) -> str:
        return f"PromptTable({self.source or self.path}, {self._len} prompts)"


def prepare_table(
    path: str | Path,
    model_dir: str | Path,
    max_model_len: int,
    format: str = "chat",
    dataset: DatasetConfig | None = None,
) -> PromptTable:
    """Every row of `path` checked and tokenized (or the file a previous call wrote for the
    same inputs); the first bad row raises a one-line `DataError` (`FILE:ROW: column 'x'`)."""
    from transformers import AutoTokenizer

    from async_grpo.config import DatasetConfig
    from async_grpo.data.forms import open_rows
    from async_grpo.data.rows import RowSpec, import_map

    d = dataset or DatasetConfig()
    source = open_rows(path, d.split)
    spec = RowSpec(
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
    if len(source) == 0:
        raise DataError(f"{path}: no prompts (the dataset is empty)")
    if spec.map_fn is None:
        _check_columns(path, source, spec)
    out = _cache_dir() / f"prompts-{_key(source, model_dir, max_model_len, format, d)}.arrow"
    if not out.is_file():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if spec.chat and not tokenizer.chat_template:
            raise DataError(
                f"model {model_dir}: no chat template for prompt_format: chat; set"
                " prompt_format=plain to use the prompts as plain text (base models)"
            )
        _write(source, tokenizer, spec, out)
    return PromptTable(out, str(path))


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
