"""The process that runs ``math-verify`` for :class:`screl.envs.MathVerify` (``python -m`` this module).

Protocol: one JSON line in per batch, ``[[gold, completion], ...]``; one JSON line out per item, in order,
``[index, "ok", parsable, correct]`` or ``[index, "error", message]``; a first line ``["ready"]`` once the
imports are done. math-verify's own timeouts are off (they use ``signal.alarm``): the parent kills this process
when an item runs past its timeout and starts another.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

_GSM8K_MARK = "####"


def answer_text(text: str, gold: bool) -> str:
    """The part of ``text`` that holds the answer: after the last ``####`` (GSM8K) if there is one; a gold answer
    without LaTeX delimiters is wrapped in ``$...$`` so it parses as LaTeX (``\\frac{1}{2}``) or a number."""
    if _GSM8K_MARK in text:
        tail = text.rsplit(_GSM8K_MARK, 1)[1].strip()
        text = tail.splitlines()[0] if tail else tail
    if gold and "$" not in text and "\\boxed" not in text and text.strip():
        text = f"${text.strip()}$"
    return text


def main() -> None:  # pragma: no cover - runs in the child process (tests drive it through MathVerify)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing but the protocol on the pipe
    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeout is off
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    golds: dict[str, Any] = {}

    def judge(gold: str, completion: str) -> list[Any]:
        target = golds.get(gold)
        if target is None:
            target = parse(answer_text(gold, True), extraction_config=config, parsing_timeout=None)
            if not target:
                raise ValueError(f"the reference answer {gold[:80]!r} does not parse")
            if len(golds) > 4096:
                golds.clear()
            golds[gold] = target
        pred = parse(answer_text(completion, False), extraction_config=config, parsing_timeout=None)
        if not pred:
            return ["ok", False, False]
        return ["ok", True, bool(verify(target, pred, timeout_seconds=None))]

    out.write(json.dumps(["ready"]) + "\n")
    for line in sys.stdin:
        for i, (gold, completion) in enumerate(json.loads(line)):
            try:
                result = judge(str(gold), str(completion))
            except Exception as err:  # noqa: BLE001 - reported to the parent: a data failure
                result = ["error", f"{type(err).__name__}: {err}"[:300]]
            out.write(json.dumps([i, *result]) + "\n")


if __name__ == "__main__":
    main()
