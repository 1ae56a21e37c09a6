"""Open the rows of `data` / `eval.data` with the `datasets` library, whatever form they ship in.

A file by its suffix (`.jsonl`/`.json`, `.parquet`, `.csv`), a folder written by
`Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or any other folder of data files
(parquet shards, with splits named as the hub names them: `train-00000-of-00002.parquet`,
`data/test-*.parquet`). The result is a memory-mapped `datasets.Dataset` (Arrow files in the
datasets cache, or the saved folder itself): nothing here holds the rows in memory.
There is no hub access (`HF_HUB_OFFLINE=1`): a path that does not exist is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_grpo.data.jsonl import DataError, parse_line
from async_grpo.text import NOT_UNICODE, not_unicode, text_lines

# file suffix -> the datasets builder that reads it
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def quiet_datasets() -> None:
    """No progress bars or logs from `datasets` (it logs a file it cannot parse before it
    raises; the raise becomes our one line): a refusal stays one line on stderr."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)


def open_rows(path: str | Path, split: str | None = None) -> Any:
    """The rows at `path` as a `datasets.Dataset` (`split` picks one of several); one-line
    `DataError` for a path that is not there, a form no builder reads, or a file it cannot."""
    import datasets

    quiet_datasets()
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"{path}: no such file or folder; datasets are read from local copies only (no"
            " hub access here): download it and point to the local file or folder"
        )
    try:
        if path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        else:
            builder = BUILDERS.get(path.suffix.lower())
            if builder is None:
                known = ", ".join(sorted(BUILDERS))
                raise DataError(f"{path}: unknown data file form (known suffixes: {known})")
            loaded = datasets.load_dataset(builder, data_files=str(path))
    except (DataError, KeyboardInterrupt):
        raise
    except Exception as e:  # the library's failure, said in one line (a JSON file by its line)
        raise _unreadable(path, e) from None
    return _pick_split(path, loaded, split)


def _pick_split(path: Path, loaded: Any, split: str | None) -> Any:
    """A Dataset as it is (a `split` named for it must be its own); of a DatasetDict the
    split named, else its only one, else `train`."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        if split is not None and loaded.split is not None and str(loaded.split) != split:
            raise DataError(f"{path}: dataset.split={split}: the dataset is split {loaded.split}")
        return loaded
    names = list(loaded)
    if split is None:
        split = names[0] if len(names) == 1 else "train" if "train" in names else None
        if split is None:
            raise DataError(f"{path}: several splits ({', '.join(names)}): set dataset.split")
    if split not in loaded:
        raise DataError(f"{path}: dataset.split={split}: no such split (has: {', '.join(names)})")
    return loaded[split]


def _unreadable(path: Path, error: Exception) -> DataError:
    """A JSON Lines file is read again line by line to name the line at fault (bad bytes,
    bad JSON); otherwise the library's own message, its first line."""
    if path.is_file() and path.suffix.lower() in (".jsonl", ".json", ".csv"):
        found = _first_bad_line(path, _json_lines(path))
        if found is not None:
            return found
    first = (str(error).strip().splitlines() or [""])[0][:300]
    form = BUILDERS.get(path.suffix.lower(), "data") if path.is_file() else "a dataset folder"
    return DataError(f"{path}: cannot be read as {form}: {type(error).__name__}: {first}")


def _json_lines(path: Path) -> bool:
    """Whether a .json/.jsonl file holds one object per line (not one JSON array)."""
    if path.suffix.lower() == ".csv":
        return False
    with path.open("rb") as f:
        return f.read(4096).lstrip()[:1] != b"["


def _first_bad_line(path: Path, json_lines: bool) -> DataError | None:
    """The first line of `path` that is not UTF-8 (or, `json_lines`, not a JSON object of
    valid Unicode), as a `DataError`."""
    import json

    from async_grpo.errors import UserError

    try:
        for lineno, text in enumerate(text_lines(path), start=1):
            if not text.strip() or not json_lines:
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                parse_line(text, str(path), lineno)  # raises, naming the line and column
            if not isinstance(row, dict):
                return DataError(
                    f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}"
                )
            bad = not_unicode(row)
            if bad is not None:
                return DataError(f"{path}:{lineno}: field '{bad}': {NOT_UNICODE}")
    except DataError as e:
        return e
    except UserError as e:  # text that is not UTF-8, by line and byte
        return DataError(str(e))
    return None


def not_utf8(where: str, source: Any, indices: list[int]) -> DataError:
    """The first text that is not UTF-8 among rows `indices` of `source`: by line and byte
    in a text file, else by row and column."""
    path = Path(where)
    if path.is_file() and path.suffix.lower() in (".jsonl", ".json", ".csv"):
        found = _first_bad_line(path, False)
        if found is not None:
            return found
    for i in indices:
        for name in source.column_names:
            try:
                source.data.column(name)[i].as_py()
            except UnicodeDecodeError as e:
                return DataError(f"{where}:{i + 1}: column '{name}': not UTF-8 ({e.reason})")
    return DataError(f"{where}: text that is not UTF-8 in rows {indices[0] + 1}-{indices[-1] + 1}")


def write_parquet(path: str | Path, rows: list[dict[str, Any]]) -> int:
    """Write rows as one parquet file through `datasets` (a temp file renamed into place:
    a failure leaves no half-written file); the row count."""
    import os
    import tempfile

    from datasets import Dataset

    quiet_datasets()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        Dataset.from_list(rows).to_parquet(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(rows)
