"""A :class:`~screl.envs.DatasetTask` split as it is held: the Arrow table ``datasets`` memory-maps, the resolved
columns and the ids, from which prompt records are built as they are read (:class:`Records`), never all kept."""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

import numpy as np
import pyarrow as pa

from screl.envs.base import PromptRecord
from screl.envs.dataset_columns import (
    ID_KEY,
    KEY,
    Kind,
    Path,
    chat_messages,
    check_unique,
    column,
    first_missing,
    lookup,
    prompt_kind,
    resolve,
    row_ids,
    value_at,
)
from screl.envs.dataset_images import ROW_REF

BATCH = 1024
"""Rows read from the table at a time."""
Render = Callable[[list[dict[str, str]]], str]
"""A chat -> the prompt text (the policy tokenizer's chat template, the assistant's turn opened)."""


@dataclass(frozen=True)
class Columns:
    """The task's column arguments (dotted names allowed), as given."""

    prompt_column: str | None
    messages_column: str | None
    prompt_template: str | None
    answer_column: str | None
    id_column: str | None
    task_source_column: str | None
    image_column: str | None

    @property
    def prompt_knob(self) -> str:
        return ("messages_column" if self.messages_column is not None else
                "prompt_template" if self.prompt_template is not None else "prompt_column")

    def template_fields(self) -> list[str]:
        """The columns ``prompt_template`` names (``{question}``, ``{meta[level]}`` -> ``meta``)."""
        assert self.prompt_template is not None
        return [f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f]


@dataclass
class Split:
    """One split read back: its table (memory-mapped), resolved columns and ids (None: the row index)."""

    name: str
    origin: str
    table: pa.Table
    kind: Kind | None
    prompt: Path | None
    answer: Path | None
    id: Path | None
    source: Path | None
    ids: np.ndarray | None = None
    order: np.ndarray | None = None
    strings: bool = False

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def where(self, index: int) -> str:
        return f"row {index} of {self.origin!r} (split {self.name!r})"

    def row_of(self, prompt_id: int) -> int | None:
        return lookup(self.ids, self.order, len(self), prompt_id)

    def ids_of(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.ids is None else self.ids[rows]


def open_split(name: str, origin: str, table: pa.Table, cols: Columns, key: str, check: bool) -> Split:
    """Resolve the columns against the split's schema, recognise the prompt's kind, read the ids; with ``check``,
    refuse a row without a prompt or an id, and a repeated id (each error names the key and the row)."""
    where = f"{origin!r} ({key}={name!r})"
    paths = {knob: resolve(table.schema, value, knob, where) if value is not None else None for knob, value in (
        ("prompt_column", cols.prompt_column if cols.prompt_template is None else None),
        ("messages_column", cols.messages_column), ("answer_column", cols.answer_column),
        ("id_column", cols.id_column), ("task_source_column", cols.task_source_column),
        ("image_column", cols.image_column))}
    prompt = paths["messages_column"] or paths["prompt_column"]
    kind: Kind | None = None
    if prompt is not None:
        name_given = str(cols.messages_column or cols.prompt_column)
        kind = prompt_kind(column(table, prompt), cols.prompt_knob, name_given, where)
        if cols.messages_column is not None and kind != "chat":
            raise TypeError(f"{KEY}.messages_column={cols.messages_column!r} holds text, not a list of {{role, content}}"
                            f" messages ({where}); use prompt_column for a text column")
    split = Split(name, origin, table, kind, prompt, paths["answer_column"], paths["id_column"],
                  paths["task_source_column"])
    if check:
        _check_prompts(split, cols, key)
    if split.id is not None:
        values = column(table, split.id)
        split.ids, split.strings = row_ids(values, "id_column", str(cols.id_column), where)
        split.order = check_unique(split.ids, values, split.strings, "id_column", str(cols.id_column), where)
    return split


def _check_prompts(split: Split, cols: Columns, key: str) -> None:
    """Every row has its prompt (a template's every column); the template names only columns the split has."""
    if len(split) == 0:
        raise ValueError(f"{KEY}.{key}={split.name!r} of {split.origin!r} has no rows")
    if split.prompt is not None:
        checks = [(".".join(split.prompt), column(split.table, split.prompt), split.kind)]
    else:
        fields = cols.template_fields()
        absent = [f for f in fields if f not in split.table.column_names]
        if absent:
            raise KeyError(f"{KEY}.prompt_template names the column {absent[0]!r}, which {split.origin!r} does not"
                           f" have; its columns: {sorted(split.table.column_names)}")
        checks = [(f, split.table.column(f), None) for f in dict.fromkeys(fields)]
    for name, values, kind in checks:
        missing = first_missing(values, kind)
        if missing is not None:
            raise ValueError(f"{split.where(missing[0])} has {missing[1]} {name!r} (the prompt, {KEY}."
                             f"{cols.prompt_knob}): every row needs one; fix or remove that row")


PROMPT_MESSAGES = "prompt_messages"
"""Metadata key of a chat prompt's messages (:mod:`screl.rewards` passes them as TRL's conversational ``prompts``)."""


def _take(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """The rows (ascending, often a contiguous run: a zero-copy slice then). Otherwise taken from the slice they
    span: a take over the whole table walks all its chunks (``datasets`` writes one per 1000 rows), 50 ms a call
    at a million rows."""
    if not len(rows):
        return table.slice(0, 0)
    lo, hi = int(rows.min()), int(rows.max())
    if hi - lo + 1 == len(rows):
        return table.slice(lo, len(rows))
    return table.slice(lo, hi - lo + 1).take(pa.array(rows - lo, type=pa.int64()))


def _chat(split: Split, cols: Columns, row: dict[str, Any], index: int) -> list[dict[str, str]]:
    assert split.prompt is not None
    return chat_messages(value_at(row, split.prompt), split.where(index), cols.prompt_knob)


def prompt_text(split: Split, cols: Columns, row: dict[str, Any], index: int, render: Render | None,
                templated: bool) -> str:
    """A row's prompt text: its text, its template filled, or its chat; rendered (``render``) when the run's
    policy is known, for a chat always, for text with ``templated`` (``chat_template: true``). A chat before that
    reads as its last user message."""
    if split.kind == "chat":
        chat = _chat(split, cols, row, index)
        if render is not None:
            return render(chat)
        return next((m["content"] for m in reversed(chat) if m["role"] == "user"), chat[-1]["content"])
    if split.prompt is not None:
        text = str(value_at(row, split.prompt))
    else:
        assert cols.prompt_template is not None
        text = cols.prompt_template.format(**row)
    return render([{"role": "user", "content": text}]) if render is not None and templated else text


def build_record(split: Split, cols: Columns, row: dict[str, Any], index: int, text: str) -> PromptRecord:
    """The prompt record of one row: every other column in its metadata, plus ``answer``, ``task_source``, the
    verbatim string id (``dataset_id``) and, with images, the row's reference."""
    meta = dict(row)
    if split.prompt is not None and len(split.prompt) == 1:
        meta.pop(split.prompt[0], None)
    if split.kind == "chat":  # what a TRL reward function receives as the prompt of conversational data
        meta[PROMPT_MESSAGES] = _chat(split, cols, row, index)
    if split.answer is not None:
        meta["answer"] = value_at(row, split.answer)
    if split.source is not None:
        meta["task_source"] = str(value_at(row, split.source))
    if split.strings and split.id is not None:
        meta[ID_KEY] = value_at(row, split.id)
    if cols.image_column is not None:
        meta.pop(cols.image_column, None)
        meta[ROW_REF] = {"split": split.name, "index": index}
    prompt_id = index if split.ids is None else int(split.ids[index])
    return PromptRecord(prompt_id=prompt_id, text=text, metadata=meta)


def prompt_keys(split: Split, cols: Columns, rows: np.ndarray) -> Iterator[tuple[int, Any, Any, Any]]:
    """``(prompt_id, task_source, agent, dataset_id)`` of these rows as :func:`build_record`'s metadata has them,
    reading only the columns they come from (no record, no prompt text)."""
    names = {p[0] for p in (split.id, split.source) if p is not None} | {"agent", "task_source", ID_KEY}
    dropped = {split.prompt[0] if split.prompt is not None and len(split.prompt) == 1 else None, cols.image_column}
    for index, row in iter_rows(split.table, rows, [c for c in split.table.column_names if c in names]):
        meta = {k: v for k, v in row.items() if k not in dropped}
        source = str(value_at(row, split.source)) if split.source is not None else meta.get("task_source")
        key = value_at(row, split.id) if split.strings and split.id is not None else meta.get(ID_KEY)
        yield (index if split.ids is None else int(split.ids[index]), source, meta.get("agent"), key)


def iter_rows(table: pa.Table, rows: np.ndarray, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row index, row) of ``rows``, read ``BATCH`` at a time (only ``columns``, when given)."""
    source = table.select(columns) if columns is not None else table
    for start in range(0, len(rows), BATCH):
        chunk = rows[start:start + BATCH]
        yield from zip((int(i) for i in chunk), _take(source, chunk).to_pylist(), strict=True)


def text_columns(split: Split, cols: Columns) -> list[str]:
    """The columns a prompt's text is made of."""
    return [split.prompt[0]] if split.prompt is not None else list(dict.fromkeys(cols.template_fields()))


class RecordSource(Protocol):
    """What :class:`Records` reads of its task."""

    path: str

    def selected(self, role: str) -> np.ndarray: ...

    def records(self, role: str, rows: np.ndarray) -> Iterator[PromptRecord]: ...


class Records(Sequence[PromptRecord]):
    """A task's prompts (``role``: ``train`` or ``val``), each built from its row when it is read: a million-row
    dataset is not held as a million records. Indexing, slicing, ``len`` and iteration as a list's."""

    def __init__(self, source: RecordSource, role: str) -> None:
        self._source, self._role = source, role

    def __len__(self) -> int:
        return len(self._source.selected(self._role))

    @overload
    def __getitem__(self, index: int) -> PromptRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[PromptRecord]: ...

    def __getitem__(self, index: int | slice) -> PromptRecord | list[PromptRecord]:
        rows = self._source.selected(self._role)
        if isinstance(index, slice):
            return list(self._source.records(self._role, rows[index]))
        if not -len(rows) <= index < len(rows):
            raise IndexError(f"prompt index {index} out of range ({len(rows)} prompts)")
        return next(self._source.records(self._role, rows[[index]]))

    def __iter__(self) -> Iterator[PromptRecord]:
        return self._source.records(self._role, self._source.selected(self._role))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self)} {self._role} prompts of {self._source.path!r}>"
