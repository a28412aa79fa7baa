"""An engine failure on one policy-server request (``screl.rollout.server.server``): that request's answer alone.
Any other error while serving it (a tokenizer's, a chat template's) is answered the same way (``server_error``).

The generation worker's engine may fail a request (a prompt it cannot hold, an out-of-memory, a tokenizer error),
or the worker may die (Ray restarts it). The request gets a 500 (``engine_error``) or, when retrying later can
succeed, a 503 with ``Retry-After`` (``engine_out_of_memory``, ``worker_unavailable``), each with OpenAI's error
body naming what failed; every other request goes on (the worker's decode queue decodes the calls of a failed
batch again one by one, :mod:`screl.rollout.decode_queue`, so only the one that fails alone fails). Under training,
the agent's client raises on it and the rollout is a data failure, resampled within
``async_rl.rollout_failure.max_data_attempts`` like any other.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from screl.rollout.server.openai_api import api_error

__all__ = ["EngineFailure"]

_OUT_OF_MEMORY = frozenset({"MemoryError", "OutOfMemoryError"})
_WORKER_LOST = frozenset({"RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
                          "NodeDiedError"})


class EngineFailure(Exception):
    """The engine failed this request (``args[0]``: the error): its status, code and message."""

    def __init__(self, err: BaseException, stage: str = "the engine") -> None:
        super().__init__(err)
        kinds = {c.__name__ for c in type(err).__mro__}  # a RayTaskError subclasses the remote error's class
        if kinds & _WORKER_LOST:
            self.status, self.code = 503, "worker_unavailable"
            self.why = "the generation worker serving it died (Ray restarts it); retry"
        elif kinds & _OUT_OF_MEMORY:
            self.status, self.code = 503, "engine_out_of_memory"
            self.why = f"{stage} ran out of memory on it; retry later, or ask for fewer tokens"
        else:
            self.status, self.code = 500, "engine_error" if stage == "the engine" else "server_error"
            self.why = f"{stage} failed on it"
        cause = getattr(err, "cause", None) or err  # a RayTaskError's: the error the worker raised
        detail = str(cause).strip().splitlines()
        self.detail = f"{type(cause).__name__}: {detail[-1] if detail else ''}"[:500]

    def message(self) -> str:
        return f"{self.why} ({self.detail}); the server serves other requests as before"

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(api_error(self.message(), kind="server_error", code=self.code), status_code=self.status,
                            headers=headers)

    def event(self) -> dict[str, object]:
        """The error as a stream's last event (the stream's 200 is sent already)."""
        return api_error(self.message(), kind="server_error", code=self.code)
