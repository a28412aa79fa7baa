"""The columns of a :class:`~screl.envs.DatasetTask` split as Arrow holds them, recognised by their type.

* A column name may be dotted into struct columns (verl's ``reward_model.ground_truth``); a column whose own name
  has a dot wins.
* The prompt column holds text (TRL's standard format) or a chat, a list of ``{role, content}`` messages (TRL's
  conversational format, verl's ``prompt``); anything else is refused naming the key, the row and the type.
* Ids are integers, strings (each mapped to a stable 63-bit integer, :func:`string_prompt_id`), or the row index.

Every per-row check here runs column-wide in Arrow (no Python loop over the rows).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

KEY = "data.init_args.task.init_args"
"""Where a DatasetTask's arguments sit in a run config (error messages name ``KEY.<argument>``)."""
ID_KEY = "dataset_id"
"""The metadata key of a string id's verbatim text (the prompt id is its :func:`string_prompt_id`)."""
Kind = Literal["text", "chat"]
Path = tuple[str, ...]


def string_prompt_id(value: str) -> int:
    """The prompt id of a string id: the first 8 bytes of the BLAKE2b digest of its UTF-8 text, sign bit cleared
    (the same in every process, run and machine)."""
    return int.from_bytes(hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest(), "big") & (2**63 - 1)


def column_names(schema: pa.Schema) -> list[str]:
    """Every column name, struct fields dotted (``reward_model.ground_truth``)."""
    out: list[str] = []

    def walk(prefix: str, dtype: pa.DataType) -> None:
        out.append(prefix)
        if pa.types.is_struct(dtype):
            for f in dtype:
                walk(f"{prefix}.{f.name}", f.type)

    for f in schema:
        walk(f.name, f.type)
    return out


def resolve(schema: pa.Schema, name: str, knob: str, where: str) -> Path:
    """The path of ``name`` into the schema (a column, then struct fields); KeyError names the key."""
    if name in schema.names:
        return (name,)
    parts = name.split(".")
    if parts[0] in schema.names:
        dtype = schema.field(parts[0]).type
        for part in parts[1:]:
            if not pa.types.is_struct(dtype) or dtype.get_field_index(part) < 0:
                break
            dtype = dtype.field(part).type
        else:
            return tuple(parts)
    raise KeyError(f"{KEY}.{knob}={name!r} is not a column of {where}; its columns: {sorted(column_names(schema))}")


def column(table: pa.Table, path: Path) -> pa.ChunkedArray:
    """The values at ``path`` (a struct field's values, for a dotted path)."""
    values = table.column(path[0])
    for field in path[1:]:
        values = pa.chunked_array([pc.struct_field(chunk, field) for chunk in values.chunks],
                                  type=values.type.field(field).type)
    return values


def value_at(row: Mapping[str, Any], path: Path) -> Any:
    """One row's value at ``path`` (None where a struct along it is null)."""
    value: Any = row.get(path[0])
    for field in path[1:]:
        value = value.get(field) if isinstance(value, Mapping) else None
    return value


def _sample(values: pa.ChunkedArray) -> tuple[int, Any]:
    """The first non-null row and its value (for an error message)."""
    index = pc.index(pc.is_valid(values), True).as_py()
    return (max(index, 0), values[index].as_py() if index >= 0 else None)


def prompt_kind(values: pa.ChunkedArray, knob: str, name: str, where: str) -> Kind:
    """``text`` or ``chat``, by the column's type; TypeError names the key, the row and the type."""
    dtype = values.type
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_null(dtype):
        return "text"
    if (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) and pa.types.is_struct(dtype.value_type):
        fields = {f.name: f.type for f in dtype.value_type}
        if "role" in fields and "content" in fields:
            if pa.types.is_string(fields["content"]) or pa.types.is_large_string(fields["content"]):
                return "chat"
            row, value = _sample(values)
            raise TypeError(f"{KEY}.{knob}={name!r}: the messages' content holds {fields['content']} (row {row} of"
                            f" {where}: {str(value)[:120]}); each message's content must be text")
    row, value = _sample(values)
    raise TypeError(f"{KEY}.{knob}={name!r} holds {dtype} values (row {row} of {where}: {str(value)[:120]}):"
                    " expected text (TRL's standard format) or a list of {role, content} messages (TRL's"
                    " conversational format); pick another column, or use prompt_template")


def first_missing(values: pa.ChunkedArray, kind: Kind | None) -> tuple[int, str] | None:
    """The first row whose value is null (``no``) or, for a prompt, empty (``an empty``); None if none."""
    missing = pc.is_null(values)
    if kind is not None and not pa.types.is_null(values.type):
        size = pc.utf8_length(pc.utf8_trim_whitespace(values)) if kind == "text" else pc.list_value_length(values)
        missing = pc.or_(missing, pc.fill_null(pc.equal(size, 0), False))
    index = pc.index(missing, True).as_py()
    if index < 0:
        return None
    return index, "no" if values[index].as_py() is None else "an empty"


def row_ids(values: pa.ChunkedArray, knob: str, name: str, where: str) -> tuple[np.ndarray, bool]:
    """(the id of every row as int64, whether they came from strings); integers as they are."""
    dtype = values.type
    text = pa.types.is_string(dtype) or pa.types.is_large_string(dtype)
    if not (text or pa.types.is_integer(dtype)):
        row, value = _sample(values)
        raise TypeError(f"{KEY}.{knob}={name!r} holds {value!r} (row {row} of {where}, type {dtype}): ids must be"
                        " integers or strings; use such a column, or null for the row index")
    missing = first_missing(values, None)
    if missing is not None:
        raise ValueError(f"{KEY}.{knob}={name!r}: row {missing[0]} of {where} has no id; every row needs one")
    if not text:
        return values.to_numpy().astype(np.int64), False
    ids = np.empty(len(values), dtype=np.int64)
    offset = 0
    for chunk in values.chunks:
        ids[offset:offset + len(chunk)] = [string_prompt_id(v) for v in chunk.to_pylist()]
        offset += len(chunk)
    return ids, True


def check_unique(ids: np.ndarray, values: pa.ChunkedArray, strings: bool, knob: str, name: str,
                 where: str) -> np.ndarray:
    """The rows in id order (for ``np.searchsorted(ids, id, sorter=order)``); a repeated id is refused naming both
    rows, and two strings that map to one prompt id naming both strings."""
    order = np.argsort(ids, kind="stable")
    ranked = ids[order]
    repeats = np.flatnonzero(ranked[1:] == ranked[:-1])
    if repeats.size:  # the first row (in the split's order) whose id an earlier row has
        k = int(repeats[np.argmin(order[repeats + 1])])
        first, second = int(order[np.searchsorted(ranked, ranked[k])]), int(order[k + 1])
        a, b = values[first].as_py(), values[second].as_py()
        if a == b:
            raise ValueError(f"{KEY}.{knob}={name!r}: id {a!r} appears twice in {where}: rows {first} and {second};"
                             " ids must be unique")
        raise ValueError(f"{KEY}.{knob}={name!r}: the string ids {a!r} (row {first}) and {b!r} (row {second}) of"
                         f" {where} map to the same prompt id {int(ranked[k])} (a 63-bit hash collision);"
                         " rename one of them")
    return order


def lookup(ids: np.ndarray | None, order: np.ndarray | None, count: int, prompt_id: int) -> int | None:
    """The row holding ``prompt_id`` (the row index itself without an id column), or None."""
    if ids is None or order is None:
        return prompt_id if 0 <= prompt_id < count else None
    k = int(np.searchsorted(ids, prompt_id, sorter=order))
    return int(order[k]) if k < len(order) and ids[order[k]] == prompt_id else None


def chat_messages(value: Sequence[Mapping[str, Any]], where: str, knob: str) -> list[dict[str, str]]:
    """A row's chat as plain messages, less a last assistant turn (the reference completion, not the prompt)."""
    chat = []
    for k, m in enumerate(value):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"{where}: message {k} of {KEY}.{knob} is {dict(m)!r}; every message needs a text role"
                            " and content")
        chat.append({"role": role, "content": content})
    if chat and chat[-1]["role"] == "assistant":
        chat.pop()
    if not chat:
        raise ValueError(f"{where}: {KEY}.{knob} holds no message before the assistant's; every row needs a prompt")
    return chat
