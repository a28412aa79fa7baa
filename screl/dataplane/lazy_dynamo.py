"""Import TransferQueue without importing ``torch._dynamo``.

TransferQueue imports tensordict, and tensordict marks a few functions for ``torch.compile`` at import
(``torch.compiler.allow_in_graph``, ``assume_constant_result``), which imports ``torch._dynamo``: about 1.3
CPU-seconds in every process that holds a TQ client, the TransferQueue host and the rollout controller among them,
which never compile anything.

:func:`install` (screl.dataplane's import) wraps tensordict's first import in :func:`deferred_allow_in_graph`,
which lets it happen without Dynamo: both return their function unchanged (as
Dynamo's do), and the functions are marked with Dynamo's own when, and if, something imports it later in the
process, so a ``torch.compile`` there treats them exactly as it would have. Where Dynamo is already imported (a
trainer process: Lightning imports it) nothing changes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from screl._import_hooks import OneModuleFinder, hooked

DYNAMO = "torch._dynamo"
TENSORDICT = "tensordict"

_LOCK = threading.Lock()
DEFERRED = ("allow_in_graph", "assume_constant_result")
"""The ``torch.compiler`` markers deferred: each returns its function, and Dynamo's own marks it."""
_pending: list[tuple[str, Callable[..., Any]]] = []  # (marker, function) while Dynamo was not imported


def _register_pending(dynamo: ModuleType) -> None:
    with _LOCK:
        pending, _pending[:] = list(_pending), []
    for marker, fn in pending:
        getattr(dynamo, marker)(fn)


def install() -> None:
    """tensordict's first import in this process (if it is still to come) runs under
    :func:`deferred_allow_in_graph`. Imports nothing."""
    if TENSORDICT not in sys.modules and not hooked(TENSORDICT):
        sys.meta_path.insert(0, OneModuleFinder(TENSORDICT, around=deferred_allow_in_graph))


def _deferred(marker: str) -> Callable[[Any], Any]:
    """``torch.compiler.<marker>`` as tensordict binds it: Dynamo's own once Dynamo is imported, else the function
    unchanged and marked when Dynamo is."""

    def mark(fn: Any) -> Any:
        dynamo = sys.modules.get(DYNAMO)
        if dynamo is not None and hasattr(dynamo, marker):
            return getattr(dynamo, marker)(fn)
        if marker == "allow_in_graph" and isinstance(fn, (list, tuple)):
            return [mark(f) for f in fn]
        if not callable(fn):
            raise AssertionError(f"{marker} expects a callable")
        with _LOCK:
            _pending.append((marker, fn))
        return fn

    return mark


@contextmanager
def deferred_allow_in_graph() -> Iterator[None]:
    """Within the block, ``torch.compiler``'s markers defer to Dynamo's first import (see the module)."""
    import torch.compiler

    if DYNAMO in sys.modules:
        yield
        return
    real = {marker: getattr(torch.compiler, marker) for marker in DEFERRED}
    for marker in DEFERRED:
        setattr(torch.compiler, marker, _deferred(marker))
    try:
        yield
    finally:
        for marker, fn in real.items():
            setattr(torch.compiler, marker, fn)
        if DYNAMO in sys.modules:  # something in the block imported it after all
            _register_pending(sys.modules[DYNAMO])
        elif _pending and not hooked(DYNAMO):
            sys.meta_path.insert(0, OneModuleFinder(DYNAMO, after=_register_pending))


def pending() -> list[tuple[str, Callable[..., Any]]]:
    """The functions marked and not yet registered (empty once Dynamo is imported)."""
    with _LOCK:
        return list(_pending)
