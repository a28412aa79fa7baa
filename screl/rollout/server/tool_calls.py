"""OpenAI function calling on the policy server: the tools a request offers, its ``tool_choice``, and the parsers that
turn a reply's text into ``message.tool_calls`` (docs/agents.md, "Function calling").

``generation.http_server.tool_parser`` picks the parser by model family: ``hermes`` (``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` blocks, as Hermes and Qwen 2.5/3 are taught; vLLM's ``hermes``), ``compact`` (the
character tokenizer's, which can write neither ``<`` nor ``{``: ``=3+4``, or ``=calculator 3+4`` with several tools;
the text after ``=`` is the tool's first parameter), ``auto`` (default: ``compact`` for the character tokenizer,
``hermes`` otherwise), or your own :class:`ToolParser` as ``package.module:Class`` (or ``package.module.Class``).

``tool_choice``: ``auto`` parses the reply; ``none`` parses nothing; ``required`` and a named function write the
parser's :meth:`~ToolParser.opener` (``<tool_call>\\n``, ``=``) into the prompt so the model writes the rest: those
tokens are prompt tokens of the turn, never trained on. Invariant: a reply that looks like a call but does not parse
(bad JSON, an unknown tool, an unclosed block) is returned as content with ``finish_reason: stop`` and a
``tool_call_error`` saying why, so the agent may mask the rollout (``screl.rollout.workflows.agent.AgentResult``).
"""

from __future__ import annotations

import importlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from screl.rollout.moved import refuse_moved

__all__ = ["TOOL_PARSERS", "CompactToolParser", "HermesToolParser", "ParsedCall", "ParsedReply", "ToolChoice",
           "ToolParser", "ToolSpec", "new_call_id", "resolve_tool_parser"]


@dataclass(frozen=True)
class ToolSpec:
    """A function the request offers: its name and JSON-schema parameters."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def first_parameter(self) -> str | None:
        """The parameter the compact syntax fills: the first required one, else the first declared."""
        props = list((self.parameters.get("properties") or {}).keys())
        required = [p for p in self.parameters.get("required") or [] if p in props]
        return (required or props or [None])[0]

    def as_chat_tool(self) -> dict[str, Any]:
        """The chat-completions form (``{"type": "function", "function": {...}}``), as chat templates take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is ``auto``, ``none`` or ``required``; ``name`` is set for a named function (mode ``required``)."""

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """A JSON object, as OpenAI sends it (a string)."""


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    calls: tuple[ParsedCall, ...] = ()
    error: str | None = None
    """Why call-like text did not parse (it is then returned as content)."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(Protocol):
    """Turns a reply's text into tool calls; ``opener`` is the text that starts a call (prefilled for
    ``tool_choice: required`` or a named function)."""

    def opener(self, tools: Sequence[ToolSpec], name: str | None) -> str: ...

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> ParsedReply: ...


def _known(name: str, tools: Sequence[ToolSpec]) -> bool:
    return any(t.name == name for t in tools)


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2.5 and 3)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def opener(self, tools: Sequence[ToolSpec], name: str | None) -> str:
        if name is None:
            return f"{self.OPEN}\n"
        return f'{self.OPEN}\n{{"name": {json.dumps(name)}, "arguments": '

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> ParsedReply:
        if self.OPEN not in text:
            return ParsedReply(text)
        calls, outside, at = [], [], 0
        while (start := text.find(self.OPEN, at)) >= 0:
            outside.append(text[at:start])
            end = text.find(self.CLOSE, start)
            if end < 0:
                return ParsedReply(text, error="a <tool_call> block is not closed")
            body = text[start + len(self.OPEN):end]
            at = end + len(self.CLOSE)
            try:
                call = json.loads(body)
                name, args = call["name"], call.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(name, str) or not isinstance(args, dict):
                    raise TypeError("name must be a string and arguments an object")
            except (ValueError, KeyError, TypeError) as err:
                return ParsedReply(text, error=f"a <tool_call> block does not parse: {err}")
            if tools and not _known(name, tools):
                return ParsedReply(text, error=f"the reply calls {name!r}, which the request does not offer")
            calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        outside.append(text[at:])
        content = "".join(outside).strip()
        return ParsedReply(content or None, tuple(calls))


class CompactToolParser:
    """The character tokenizer's calls: ``=args`` (one tool), ``=name args`` (several), one call per ``=``."""

    def opener(self, tools: Sequence[ToolSpec], name: str | None) -> str:
        if name is not None and len(tools) > 1:
            return f"={name} "
        return "="

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> ParsedReply:
        stripped = text.strip()
        if not stripped.startswith("="):
            return ParsedReply(text)
        if not tools:
            return ParsedReply(text, error="a call (=) but the request offers no tools")
        calls = []
        for segment in stripped.split("=")[1:]:
            segment = segment.strip()
            if len(tools) == 1:
                tool, value = tools[0], segment
            else:
                name, _, value = segment.partition(" ")
                match = [t for t in tools if t.name == name]
                if not match:
                    return ParsedReply(text, error=f"the call names {name!r}, which the request does not offer")
                tool = match[0]
            param = tool.first_parameter
            args = {param: value.strip()} if param is not None else {}
            calls.append(ParsedCall(tool.name, json.dumps(args, ensure_ascii=False)))
        return ParsedReply(None, tuple(calls))


TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "compact": CompactToolParser}
"""Built-in parsers by name."""

_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*[.:][A-Za-z_]\w*$")


def resolve_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """The parser ``name`` stands for (``auto`` looks at the tokenizer); ValueError names the knob and the fix."""
    key = "generation.http_server.tool_parser"
    if name == "auto":
        from screl.models.tokenizer import CHARS

        vocab: dict[str, int] = getattr(tokenizer, "get_vocab", dict)()
        name = "compact" if vocab and set(vocab) <= {*CHARS, "<pad>", "<eos>", "<bos>"} else "hermes"
    if name in TOOL_PARSERS:
        parser: ToolParser = TOOL_PARSERS[name]()
        return parser
    refuse_moved(name, key)
    if not _CLASS_PATH.match(name):
        raise ValueError(f"{key}={name!r} is neither a built-in parser ({['auto', *TOOL_PARSERS]}) nor a class path "
                         "'package.module:Class'")
    module, _, cls = name.replace(":", ".").rpartition(".")
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{key}={name!r} cannot be imported ({type(err).__name__}: {err})") from err
    if not all(callable(getattr(found, m, None)) for m in ("opener", "parse")):
        raise ValueError(f"{key}={name!r} does not implement ToolParser (opener and parse)")
    instance: ToolParser = found()
    return instance
