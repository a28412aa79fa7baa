"""Reading one split of a :class:`~screl.envs.DatasetTask` through Hugging Face ``datasets`` (a local file, format by
suffix; a local folder; a builder name with ``data_files``; or a hub dataset), with a clear error naming the file and
the line for a bad local text file, before ``datasets`` parses it."""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa

from screl.envs.dataset_columns import KEY
from screl.envs.tasks import json_object, text_lines

_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def load_table(path: str, split: str, data_files: Any, revision: str | None, name: str | None) -> pa.Table:
    """One split as an Arrow table: ``datasets`` memory-maps its cache file, so the rows are not held in memory."""
    ds = _load(path, split, data_files, revision, name)
    table: pa.Table = ds.with_format("arrow")[:]
    return table


def release_arrow_memory() -> None:
    """Give back the memory Arrow's allocator keeps after column-wide work (mimalloc and jemalloc hold freed pages
    for reuse: about 340 MB after a million-row split's checks, which the process would otherwise carry)."""
    pa.default_memory_pool().release_unused()


def _load(path: str, split: str, data_files: Any, revision: str | None, name: str | None) -> Any:
    """One split as a ``datasets.Dataset``: a local file (format by suffix), a local folder (``datasets``
    infers the format) or a hub dataset."""
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - the dev extra installs it
        raise ImportError("DatasetTask needs Hugging Face `datasets`: pip install 'screl[tasks]'") from err
    kwargs: dict[str, Any] = {"split": split, "revision": revision}
    if os.path.isfile(path):
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in _FORMATS:
            raise ValueError(f"{KEY}.path={path!r}: unknown file format {suffix!r}; use one of {sorted(_FORMATS)}"
                             " (or a folder, or data_files with the builder name as path)")
        if split != "train" and data_files is None:
            raise ValueError(f"{KEY}.split={split!r}: a single file has only the 'train' split; set split: train,"
                             " or give data_files: {split: file, ...}")
        if data_files is None:
            _check_text_file(path, _FORMATS[suffix])
        try:
            return datasets.load_dataset(_FORMATS[suffix], data_files=data_files or {"train": path}, **kwargs)
        except datasets.exceptions.DatasetGenerationError as err:  # its message is only "An error occurred..."
            cause = err.__cause__ or err.__context__ or err
            raise ValueError(f"{KEY}.path={path!r} cannot be read as {_FORMATS[suffix]}: {type(cause).__name__}:"
                             f" {cause}") from err
    if not os.path.exists(path) and (path.startswith((".", "/")) or os.path.splitext(path)[1] in _FORMATS):
        raise FileNotFoundError(f"{KEY}.path={path!r} does not exist (a local file or folder, or a hub name)")
    try:
        return datasets.load_dataset(path, name, data_files=data_files, **kwargs)
    except ValueError as err:  # an unknown split: name the key
        raise ValueError(f"{KEY}.split={split!r} cannot be read from {path!r}: {err}") from err


def _check_text_file(path: str, fmt: str) -> None:
    """A local JSON Lines or CSV file, line by line, before ``datasets`` parses it (its errors name neither the file
    nor the row): empty, bytes that are not UTF-8, a JSON line that does not parse. ValueError names the line."""
    if fmt not in ("json", "csv") or path.lower().endswith(".json"):
        if os.path.getsize(path) == 0:
            raise ValueError(f"{KEY}.path={path!r} is empty (0 bytes): no prompts to train on")
        return
    rows = 0
    for number, line in text_lines(path, lambda n: f"{KEY}.path={path!r}: line {n}"):
        rows += 1
        if fmt == "json":
            json_object(line, f"{KEY}.path={path!r}: line {number} (row {rows - 1})")
    if rows == 0 or (fmt == "csv" and rows == 1):
        raise ValueError(f"{KEY}.path={path!r} has no rows" + (" (only a header)" if rows else " (it is empty)")
                         + ": no prompts to train on")
