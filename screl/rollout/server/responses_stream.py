"""``stream: true`` on ``/v1/responses``: OpenAI's Responses API events, as the OpenAI Agents SDK's streamed runs
(``Runner.run_streamed``) read them.

The stream opens with ``response.created`` and ``response.in_progress`` (the response without output). A reply
whose text may stream (no tools that could be called: :mod:`screl.rollout.server.live_text`) adds its message item
and its ``output_text`` part at its first text, then sends ``response.output_text.delta`` events as the engine
produces tokens. When the reply is done come the rest: the message's remaining delta and its ``output_text.done``,
``content_part.done`` and ``output_item.done``; each function call as ``output_item.added``,
``function_call_arguments.delta`` and ``.done``, ``output_item.done``; then ``response.completed`` (or
``response.incomplete`` at ``max_output_tokens``) carrying the whole response object, RL fields included, exactly
as the plain request returns it. An engine failure ends the stream with an ``error`` event. Every event carries its
``sequence_number``; no ``[DONE]`` marker (OpenAI sends none on this route).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from screl.rollout.server.live_text import rest
from screl.rollout.server.openai_api import Reply
from screl.rollout.server.openai_stream import sse
from screl.rollout.server.responses_api import ResponseIds, ResponsesRequest, response_head, response_object
from screl.rollout.server.tool_calls import ToolChoice

__all__ = ["ResponsesStream"]


class ResponsesStream:
    """The events of one streamed response (a :class:`~screl.rollout.server.openai_stream.StreamFormat`).

    Args:
        model: The model name the response carries.
        body: The request.
        choice: Its tool choice.
        prompt: The prompt's token ids.
        live: Whether the reply's text may stream before it is done.
        keep: Called with the final response object and its reply (the server stores it for
            ``previous_response_id``).
    """

    done = ""

    def __init__(self, model: str, body: ResponsesRequest, choice: ToolChoice, prompt: list[int], live: bool,
                 keep: Callable[[dict[str, Any], Reply], None]) -> None:
        self.model, self.body, self.choice, self.prompt, self.live, self.keep = model, body, choice, prompt, live, keep
        self.ids = ResponseIds()
        self._seq = itertools.count()
        self._message_open = False
        head = response_head(model, body, choice, self.ids)
        self.opening = sse(self._event("response.created", response=head)) + \
            sse(self._event("response.in_progress", response=head))

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._seq), **fields}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.ids.message, "output_index": 0, "content_index": 0}

    def _open_message(self) -> list[dict[str, Any]]:
        if self._message_open:
            return []
        self._message_open = True
        item = {"type": "message", "id": self.ids.message, "role": "assistant", "status": "in_progress",
                "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", part=part, **self._where())]

    def delta(self, i: int, text: str) -> list[dict[str, Any]]:
        """The reply's text so far grew by ``text``."""
        return [*self._open_message(),
                self._event("response.output_text.delta", delta=text, logprobs=[], **self._where())]

    def closing(self, replies: list[Reply], sent: list[str]) -> Iterator[dict[str, Any]]:
        """The reply is done: the rest of its items, then the whole response."""
        [reply] = replies
        final = response_object(self.model, self.body, self.prompt, reply, self.choice, self.ids)
        self.keep(final, reply)
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                yield from self._close_message(item, sent[0])
            else:
                yield from self._function_call(index, item)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=final)

    def _close_message(self, item: dict[str, Any], sent: str) -> Iterator[dict[str, Any]]:
        [part] = item["content"]
        yield from self._open_message()
        remainder = rest(sent, part["text"])
        if remainder:
            yield self._event("response.output_text.delta", delta=remainder, logprobs=[], **self._where())
        yield self._event("response.output_text.done", text=part["text"], logprobs=[], **self._where())
        yield self._event("response.content_part.done", part=part, **self._where())
        yield self._event("response.output_item.done", output_index=0, item=item)

    def _function_call(self, index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        where = {"item_id": item["id"], "output_index": index}
        yield self._event("response.output_item.added", output_index=index,
                          item={**item, "arguments": "", "status": "in_progress"})
        yield self._event("response.function_call_arguments.delta", delta=item["arguments"], **where)
        yield self._event("response.function_call_arguments.done", arguments=item["arguments"], **where)
        yield self._event("response.output_item.done", output_index=index, item=item)

    def failure(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An engine failure: the stream's last event."""
        err = error["error"]
        return [self._event("error", code=err.get("code"), message=err["message"], param=err.get("param"))]
