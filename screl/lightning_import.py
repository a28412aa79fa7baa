"""``screl check`` imports Lightning without what parsing and the rules never use.

``import lightning.pytorch`` cost a ``screl check`` about 2 of its 5 CPU-seconds in two parts that a command which
parses a config and runs no model never uses:

* ``torch._dynamo`` (and sympy with it), about 1.1 CPU-s. Lightning imports it in two ways:
  ``from torch._dynamo import OptimizedModule`` (``lightning.fabric.wrappers``,
  ``lightning.pytorch.utilities.compile``) and ``@torch.compiler.disable`` on a method of its logger connector's
  ``_ResultCollection``.
* torchmetrics' BERTScore and InfoLM, which import transformers' ``AutoModel`` (transformers' model index: about
  0.6 CPU-s), and its plots, which import matplotlib (about 0.25): Lightning imports all of torchmetrics.

Within :func:`lean_lightning_import` (the CLI imports Lightning within it through :func:`import_lightning`, for
``check`` only):

* ``torch._dynamo`` is a stand-in module whose ``OptimizedModule`` is :class:`OptimizedModule`: ``isinstance`` with
  it is Dynamo's own once Dynamo is imported, and False before (no compiled module exists then). Any other name
  taken from the stand-in imports the real ``torch._dynamo`` on the spot and goes on with it.
* ``torch.compiler.disable`` returns its function unchanged while Dynamo is not imported, so the methods Lightning
  marks that way are left unmarked: nothing compiles in a ``check``.
* torchmetrics, if its first import comes in the block, sees transformers and matplotlib as absent: in that process
  it has no ``bert_score``, ``infolm`` or ``.plot()``.

The stand-in and ``torch.compiler.disable`` are undone when the block ends. ``screl fit`` and every other command
import Lightning as it is. Should a Lightning import a Dynamo submodule at import (which the stand-in, not a
package, cannot serve), :func:`import_lightning` imports it again in full, so a ``check`` is slower but never broken
by it (``tests/test_lazy_exports.py`` fails on it, naming ``torch._dynamo``).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from screl._import_hooks import OneModuleFinder

log = logging.getLogger(__name__)

DYNAMO = "torch._dynamo"
TORCHMETRICS_IMPORTS = "torchmetrics.utilities.imports"
TORCHMETRICS_ABSENT = ("_TRANSFORMERS_GREATER_EQUAL_4_4", "_MATPLOTLIB_AVAILABLE")
"""torchmetrics' requirement flags that a lean import sets to absent (BERTScore and InfoLM; plots)."""


class _DynamoStandIn(ModuleType):
    """``torch._dynamo`` while it is deferred: ``OptimizedModule`` only; any other name imports the real one. It is
    not a package (no ``__path__``, which ``from torch._dynamo import OptimizedModule`` looks up first): a submodule
    imported within the block fails as ``ModuleNotFoundError`` naming it (the tests' ``screl check`` would)."""

    def __getattr__(self, name: str) -> Any:
        if name == "__path__":
            raise AttributeError(name)
        if sys.modules.get(DYNAMO) is self:
            del sys.modules[DYNAMO]
        return getattr(importlib.import_module(DYNAMO), name)


def _real_dynamo() -> ModuleType | None:
    module = sys.modules.get(DYNAMO)
    return None if module is None or isinstance(module, _DynamoStandIn) else module


class _DeferredClass(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        dynamo = _real_dynamo()
        return dynamo is not None and isinstance(obj, dynamo.OptimizedModule)

    def __subclasscheck__(cls, sub: type) -> bool:
        dynamo = _real_dynamo()
        return dynamo is not None and issubclass(sub, dynamo.OptimizedModule)


class OptimizedModule(metaclass=_DeferredClass):
    """What Lightning's ``OptimizedModule`` names when it was imported within :func:`lean_lightning_import`:
    ``isinstance``/``issubclass`` with it are with ``torch._dynamo.OptimizedModule`` once Dynamo is imported."""


def _torchmetrics_without_extras(module: ModuleType) -> None:
    for flag in TORCHMETRICS_ABSENT:
        getattr(module, flag).available = False  # a RequirementCache: evaluated once, here answered


LIGHTNING_MODULES = ("lightning.pytorch", "lightning.pytorch.cli")


def import_lightning(lean: bool, modules: Sequence[str] = LIGHTNING_MODULES) -> None:
    """Import ``modules`` (Lightning and its CLI), within :func:`lean_lightning_import` where ``lean``; a lean
    import that fails on a ``torch._dynamo`` submodule is done again in full."""
    try:
        with lean_lightning_import(lean):
            for name in modules:
                importlib.import_module(name)
    except ModuleNotFoundError as err:
        if not lean or not (err.name or "").startswith(DYNAMO + "."):
            raise
        log.info("screl: Lightning imported in full: it imports %s at import", err.name)
        for name in modules:
            importlib.import_module(name)


@contextmanager
def lean_lightning_import(active: bool = True) -> Iterator[None]:
    """Imports within the block see the stand-ins above (see the module); nothing changes where ``active`` is
    False, and Dynamo's part does not where Dynamo is already imported."""
    if not active:
        yield
        return
    finder = None
    if TORCHMETRICS_IMPORTS not in sys.modules:
        finder = OneModuleFinder(TORCHMETRICS_IMPORTS, after=_torchmetrics_without_extras)
        sys.meta_path.insert(0, finder)
    try:
        with _dynamo_deferred():
            yield
    finally:
        if finder is not None and finder in sys.meta_path:  # the finder removes itself once used
            sys.meta_path.remove(finder)


@contextmanager
def _dynamo_deferred() -> Iterator[None]:
    if DYNAMO in sys.modules:
        yield
        return
    import torch.compiler

    real_disable = torch.compiler.disable

    def disable(fn: Callable[..., Any] | None = None, recursive: bool = True, **kwargs: Any) -> Any:
        if _real_dynamo() is not None:
            return real_disable(fn, recursive, **kwargs)
        return fn if fn is not None else (lambda f: f)

    stand_in = _DynamoStandIn(DYNAMO)
    stand_in.OptimizedModule = OptimizedModule  # type: ignore[attr-defined]
    sys.modules[DYNAMO] = stand_in
    torch.compiler.disable = disable  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compiler.disable = real_disable
        if sys.modules.get(DYNAMO) is stand_in:
            del sys.modules[DYNAMO]
