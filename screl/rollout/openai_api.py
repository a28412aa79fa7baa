"""The OpenAI-compatible request and response shapes of screl's policy server (``screl.rollout.server``).

Requests are validated by pydantic; a bad field becomes a 400 with an OpenAI-style error body naming it.
Responses follow OpenAI's chat and completion objects, plus what RL needs (``spec/vllm-rl-api.md`` §4):

* ``prompt_token_ids`` at the top level and ``token_ids`` on every choice (vLLM's ``return_token_ids``);
* ``weight_versions`` on every choice: the policy version that sampled each token;
* on a chat choice's message, NeMo-Gym's ``prompt_token_ids`` / ``generation_token_ids`` /
  ``generation_log_probs``: sent back unchanged on that message next turn, they make the server splice the
  past tokens verbatim instead of re-tokenizing the conversation.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from screl.rollout.engine import GenerationResult

__all__ = ["ChatRequest", "CompletionRequest", "api_error", "chat_response", "completion_response"]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    """None: the run's ``generation.temperature`` (the trainer's logprobs use it)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    session_id: str | None = None
    """Sticky routing to one worker, and the conversation the server records (also the ``X-Session-Id`` header)."""
    rollout: dict[str, Any] | None = None
    """What the request belongs to (``group``, ``sibling``, ``turn``): recorded with the turn."""

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported: send stream=false")
        return v

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only the sampled token's logprob is returned")

    @field_validator("messages")
    @classmethod
    def _roles(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(v):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"message {i} has no role")
        return v


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(..., min_length=1)
    logprobs: int | None = Field(None, ge=0, le=0, description="only the sampled token's logprob is returned")


def api_error(message: str, param: str | None = None, kind: str = "invalid_request_error",
              code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def _usage(prompt: list[int], results: list[GenerationResult]) -> dict[str, int]:
    done = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}


def _finish(result: GenerationResult, stopped: bool) -> Literal["stop", "length", "abort"]:
    return "stop" if stopped else result.finish_reason


def chat_response(model: str, tokenizer: Any, prompt: list[int], choices: list[tuple[GenerationResult, str, bool]],
                  logprobs: bool) -> dict[str, Any]:
    """A ``chat.completion``; ``choices`` holds (result, text, stopped at a stop string) per choice."""
    out = []
    for i, (r, text, stopped) in enumerate(choices):
        lp = None
        if logprobs:
            lp = {"content": [{"token": (tok := _token_text(tokenizer, t)), "logprob": p,
                               "bytes": list(tok.encode()), "top_logprobs": []}
                              for t, p in zip(r.token_ids, r.logprobs, strict=True)]}
        message = {"role": "assistant", "content": text, "prompt_token_ids": list(prompt),
                   "generation_token_ids": list(r.token_ids), "generation_log_probs": list(r.logprobs)}
        out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": _finish(r, stopped),
                    "token_ids": list(r.token_ids), "weight_versions": list(r.weight_versions)})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": _usage(prompt, [c[0] for c in choices]),
            "prompt_token_ids": list(prompt)}


def completion_response(model: str, tokenizer: Any, prompt: list[int],
                        choices: list[tuple[GenerationResult, str, bool]], logprobs: bool) -> dict[str, Any]:
    """A ``text_completion``; ``choices`` as in :func:`chat_response`."""
    out = []
    for i, (r, text, stopped) in enumerate(choices):
        lp = None
        if logprobs:
            tokens = [_token_text(tokenizer, t) for t in r.token_ids]
            offsets, at = [], 0
            for tok in tokens:
                offsets.append(at)
                at += len(tok)
            lp = {"tokens": tokens, "token_logprobs": list(r.logprobs), "top_logprobs": None, "text_offset": offsets}
        out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(r, stopped),
                    "token_ids": list(r.token_ids), "weight_versions": list(r.weight_versions)})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": _usage(prompt, [c[0] for c in choices]),
            "prompt_token_ids": list(prompt)}
