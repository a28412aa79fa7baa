"""Helpers shared by the checkpoint tests: fault-injecting file wrappers and a tree picture."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any

from screl.checkpoint import CheckpointStore


class FailingFile:
    """A writable file that raises ``OSError`` once ``limit`` bytes have been written (after writing them)."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner = inner
        self.limit = limit
        self.written = 0

    def write(self, data: bytes) -> int:
        room = self.limit - self.written
        if len(data) > room:
            self.inner.write(data[:room])
            self.written = self.limit
            raise OSError("injected failure: device full")
        self.written += len(data)
        return int(self.inner.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> FailingFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.inner.__exit__(exc_type, exc, tb)


def failing_open(store: CheckpointStore, match: str, limit: int) -> Callable[..., Any]:
    """A replacement for ``store.fs.open`` that fails writes to paths containing ``match`` after ``limit``
    bytes."""
    real_open = store.fs.open

    def open_(path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and match in str(path):
            return FailingFile(f, limit)
        return f

    return open_


def tree(store: CheckpointStore) -> dict[str, str]:
    """Every file under the root with the SHA-256 of its content (plus local directories)."""
    out = {}
    for name in store.files(""):
        out[name] = hashlib.sha256(store.fs.cat_file(store.path(name))).hexdigest()
    if store.atomic_rename:
        for dirpath, dirnames, _ in os.walk(store.root):
            for d in dirnames:
                out[os.path.relpath(os.path.join(dirpath, d), store.root) + "/"] = "dir"
    return out


def put(store: CheckpointStore, relpath: str, data: bytes) -> None:
    """Write one raw file under the store root (parents created), bypassing every writer."""
    path = store.path(relpath)
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)
