"""The policy server's app in this process, in front of a real :class:`~screl.rollout.worker.GenerationWorker` (the
torch engine and its batching decode thread, a tiny model) also in this process: only Ray's hop between the server
and the worker is left out (:class:`InProcess`). Built in a tenth of a second; calls go through Starlette's
``TestClient`` (ASGI)."""

from __future__ import annotations

import asyncio
from typing import Any

from screl.models import TinyCausalLM
from screl.rollout.server.server import PolicyServer
from screl.rollout.worker import GenerationWorker

POLICY = TinyCausalLM(hidden_size=32, num_layers=1)


class InProcess:
    """A worker handle whose ``.method.remote(...)`` runs the method in the caller's event loop (Ray's actor call
    without Ray): the server awaits what it returns, as it awaits an ``ObjectRef``."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                return method(*args, **kwargs)

        return _Method


def build_worker() -> GenerationWorker:
    worker = GenerationWorker(POLICY)
    asyncio.run(worker.update_weights([POLICY.build_model().eval().state_dict()], 0))
    return worker


def build_server(worker: GenerationWorker | None = None, **kwargs: Any) -> PolicyServer:
    kwargs.setdefault("max_tokens", 8)
    return PolicyServer([InProcess(worker or build_worker())], POLICY, **kwargs)
