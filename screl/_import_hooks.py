"""One module's import, hooked: run inside a context, or followed by a callback on the module.

Used where screl imports a third-party package without a part it does not need in that process
(:mod:`screl.dataplane.lazy_dynamo`, :mod:`screl.lightning_import`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class _Loader(importlib.abc.Loader):
    """A module's own loader, with ``after`` called on the module once it ran, or its execution wrapped in
    ``around``."""

    def __init__(self, inner: importlib.abc.Loader, after: Callable[[ModuleType], None] | None = None,
                 around: Callable[[], Any] | None = None) -> None:
        self.inner, self.after, self.around = inner, after, around

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if self.around is not None:
            with self.around():
                self.inner.exec_module(module)
        else:
            self.inner.exec_module(module)
        if self.after is not None:
            self.after(module)


class OneModuleFinder(importlib.abc.MetaPathFinder):
    """Finds one module as the other finders do, giving it a loader that runs ``after`` (the module) once it ran
    or wraps its execution in ``around`` (a context manager factory); removes itself once used."""

    def __init__(self, name: str, **loader: Any) -> None:
        self.name, self.loader = name, loader

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, **self.loader)
                return spec
        return None


def hooked(name: str) -> bool:
    """Whether a :class:`OneModuleFinder` waits for ``name``."""
    return any(isinstance(f, OneModuleFinder) and f.name == name for f in sys.meta_path)
