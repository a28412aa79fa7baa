"""Fault injection for tests of the failure handling: the real torch engine with a fault at a true edge.

It lives in the package, not under ``tests/``, so that every Ray worker and ``screl fit`` subprocess can import
it by class path (``generation.backend: screl.rollout.faults.HangsOnceEngine``) whatever cluster it joins."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from screl.rollout.engines.protocol import GenerationRequest, GenerationResult
from screl.rollout.engines.torch_engine import TorchGenerationEngine


class HangsOnceEngine(TorchGenerationEngine):
    """The torch engine, except that the first ``generate`` call of the process hangs until one of its requests
    is aborted, then returns them all aborted with no tokens (a wedged engine that only an abort frees)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._hung = False
        self._freed = threading.Event()
        self._hanging: set[str] = set()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if self._hung:
            return super().generate(requests)
        self._hung = True
        self._hanging = {r.request_id for r in requests}
        self._freed.wait()
        return [GenerationResult(r.request_id, list(r.prompt_token_ids), [], [], "abort", [], self.version,
                                 self.version) for r in requests]

    def abort(self, request_ids: Sequence[str]) -> None:
        if self._hanging & set(request_ids):
            self._freed.set()
        super().abort(request_ids)
