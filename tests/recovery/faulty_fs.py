"""``faultyfs://``: the local filesystem of a disk that fills up while a chosen file is written, for a real
``screl fit`` in a subprocess (``python -c`` registers it, then runs ``screl.cli.main``: :data:`FIT`).

``SCREL_TEST_ENOSPC_AT`` is an ``fnmatch`` pattern on the path: the first file opened for writing whose path matches
gets half of its first write written, then ``OSError(ENOSPC)``, as ``write(2)`` on a full disk; later files write normally
(the space freed by the failed save's cleanup). Unset: a plain local disk.
"""

from __future__ import annotations

import errno
import fnmatch
import os
from typing import Any

from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faultyfs"
ENV = "SCREL_TEST_ENOSPC_AT"
FIT = ("import sys, fsspec; fsspec.register_implementation('faultyfs', 'tests.recovery.faulty_fs.FaultyFileSystem'); "
       "from screl.cli import main; sys.exit(main())")
"""``python -c FIT fit --config X``: ``screl fit`` with the protocol registered."""


class FaultyFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)
    root_marker = "/"
    fired = False

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        return super()._strip_protocol(path[len(f"{PROTOCOL}://"):] if path.startswith(f"{PROTOCOL}://") else path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        pattern = os.environ.get(ENV)
        if pattern and not FaultyFileSystem.fired and ("w" in mode or "a" in mode) and fnmatch.fnmatch(path, pattern):
            FaultyFileSystem.fired = True
            return _FillsUp(f, path)
        return f


class _FillsUp:
    def __init__(self, inner: Any, path: str) -> None:
        self.inner, self.path = inner, path

    def write(self, data: bytes) -> int:
        self.inner.write(data[: len(data) // 2])  # what fits, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> _FillsUp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)
