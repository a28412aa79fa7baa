"""The core's prompts column-wise: a million prompts held as a few arrays, not a million objects.

:class:`~screl.data.core.RolloutCore` needs of each training prompt its id and the keys its recovery is routed by
(``task_source``, ``agent``) or its events name (a string id's text). Held as :class:`CorePrompt` objects in a dict
that is about 250 bytes a prompt; here it is about 40 (ids, their sorted order, two small codes, the string ids'
UTF-8 bytes), and a prompt's :class:`CorePrompt` is built when it is looked up.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

import numpy as np

from screl.data.core_types import CorePrompt

__all__ = ["PromptTable"]


class _Codes:
    """One optional text per row as a small code (0: none) into its distinct values."""

    def __init__(self) -> None:
        self.names: list[str | None] = [None]
        self._index: dict[str | None, int] = {None: 0}
        self.codes = array("i")

    def add(self, value: str | None) -> None:
        code = self._index.get(value)
        if code is None:
            code = self._index[value] = len(self.names)
            self.names.append(value)
        self.codes.append(code)

    def freeze(self) -> np.ndarray:
        out = np.frombuffer(self.codes, dtype=np.int32).copy()
        self.codes = array("i")
        return out


class PromptTable:
    """The training prompts in the task's order: ``len``, iteration over the ids, ``in``, and ``table[prompt_id]``
    (its :class:`CorePrompt`; KeyError for an id the task does not have)."""

    def __init__(self, prompts: Iterable[CorePrompt]) -> None:
        ids = array("q")  # raw values while reading: no Python object per prompt
        sources, agents = _Codes(), _Codes()
        keys, offsets, keyed = bytearray(), array("q", [0]), bytearray()
        for p in prompts:
            ids.append(p.prompt_id)
            sources.add(p.task_source)
            agents.add(p.agent)
            if p.key is not None:
                keys += p.key.encode("utf-8")
            offsets.append(len(keys))
            keyed.append(p.key is not None)
        self.ids = np.frombuffer(ids, dtype=np.int64).copy()
        del ids
        self._order = np.argsort(self.ids, kind="stable")
        self._sorted = self.ids[self._order]
        repeated = np.flatnonzero(self._sorted[1:] == self._sorted[:-1])
        if repeated.size:
            raise ValueError(f"prompt id {int(self._sorted[repeated[0]])} appears twice in the task's prompts")
        self._sources, self._source_names = sources.freeze(), sources.names
        self._agents, self._agent_names = agents.freeze(), agents.names
        any_key = any(keyed)
        self._keyed = np.frombuffer(keyed, dtype=bool).copy() if any_key else None  # a key: its offsets' bytes
        self._keys, self._offsets = bytes(keys), np.frombuffer(offsets, dtype=np.int64).copy() if any_key else None

    def __len__(self) -> int:
        return len(self.ids)

    def nbytes(self) -> int:
        """The bytes the table holds."""
        arrays = (self.ids, self._order, self._sorted, self._sources, self._agents, self._keyed, self._offsets)
        return sum(a.nbytes for a in arrays if a is not None) + len(self._keys)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids.tolist())

    def _row(self, prompt_id: int) -> int:
        i = int(np.searchsorted(self._sorted, prompt_id))
        if i == len(self._sorted) or int(self._sorted[i]) != prompt_id:
            raise KeyError(prompt_id)
        return int(self._order[i])

    def __contains__(self, prompt_id: object) -> bool:
        try:
            self._row(int(prompt_id))  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError):
            return False
        return True

    def _key(self, row: int) -> str | None:
        if self._keyed is None or self._offsets is None or not self._keyed[row]:
            return None
        return self._keys[int(self._offsets[row]):int(self._offsets[row + 1])].decode("utf-8")

    def __getitem__(self, prompt_id: int) -> CorePrompt:
        row = self._row(int(prompt_id))
        return CorePrompt(int(self.ids[row]), self._source_names[int(self._sources[row])],
                          self._agent_names[int(self._agents[row])], self._key(row))
