"""What an engine built on :class:`~screl.rollout.engines.request_loop.RequestLoop` answers by asking its loop: the
protocol's request control (generate, partial tokens, abort, pause, resume, stand-down, wake). One copy for every such engine; an
engine adds to a method (the torch engine's continuous KV cache at stand-down) by overriding it."""

from __future__ import annotations

from collections.abc import Sequence

from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, PauseMode
from screl.rollout.engines.request_loop import RequestLoop


class LoopEngine:
    """The protocol's request control, forwarded to ``self.loop``."""

    loop: RequestLoop

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate all requests, ``max_batch_size`` at a time; results in request order."""
        return self.loop.generate(requests)

    def partial_tokens(self, request_ids: Sequence[str]) -> dict[str, list[int]]:
        """Each in-flight request's tokens so far (``EngineCapabilities.streams_tokens``)."""
        return self.loop.partial_tokens(request_ids)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Finish these in-flight requests at the next step with their partial tokens."""
        self.loop.abort(request_ids)

    def pause(self, mode: PauseMode = "keep", timeout: float | None = None) -> None:
        """Stop generating until :meth:`resume` (see the protocol); returns when no batch is decoding.

        Raises:
            TimeoutError: the engine did not become quiet within ``timeout`` seconds (it stays paused).
        """
        self.loop.pause(mode, timeout)

    def resume(self) -> None:
        """Let waiting and parked ``generate`` calls continue."""
        self.loop.resume()

    @property
    def paused(self) -> bool:
        """Whether the engine is paused."""
        return self.loop.paused

    def stand_down(self, timeout: float | None = None, drain: bool = False) -> None:
        """Pause in ``keep`` mode and free the KV caches of the parked batches (colocated generation, while the
        trainer trains the module this engine decodes with); returns when no forward pass runs. The parked
        requests re-prefill under the weights of the :meth:`wake` (their tokens after it carry its version).
        ``drain``: pause in ``wait`` mode instead (the drain gate): the requests in flight finish first."""
        self.loop.stand_down(timeout, drain)

    def wake(self) -> None:
        """End a :meth:`stand_down`: parked batches re-prefill and decode on."""
        self.loop.wake()

    @property
    def stood_down(self) -> bool:
        """Whether the engine is stood down."""
        return self.loop.stood_down

    @property
    def busy_s(self) -> float:
        """Seconds the engine has had a call decoding, over its life (:attr:`RequestLoop.busy_s`)."""
        return self.loop.busy_s

    @property
    def tokens_out(self) -> int:
        """Tokens the engine has returned, over its life (:attr:`RequestLoop.tokens_out`)."""
        return self.loop.tokens_out
