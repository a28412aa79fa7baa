"""A task for a real instruct model on a laptop: addition with a strict answer format.

An instruct model asked "What is 3 + 4? Reply with the number only." answers in a sentence ("The answer is 7.").
``StrictAnswer`` pays 1.0 for the sum in the required form, and less the more words surround it: a completion
that contains the sum earns ``partial`` plus a share of the rest that shrinks with every extra character, down
to ``partial`` at ``brevity_chars`` extra characters. Its reward starts low and rises as the policy learns to
answer tersely: the learning signal a 135M model gets on a laptop within a few dozen GRPO steps.
"""

from __future__ import annotations

import re
from typing import Literal

from screl.envs.base import PromptRecord
from screl.envs.tasks import _Arithmetic

_QUESTIONS = {
    "number": "What is {a} + {b}? Reply with the number only.",
    "tag": "What is {a} + {b}? Reply with the answer inside <answer></answer> and nothing else.",
}


class StrictAnswer(_Arithmetic):
    """Single-digit addition, rewarded for the answer alone.

    Args:
        form: ``number`` (the completion is the sum, nothing else) or ``tag`` (``<answer>sum</answer>``, nothing
            else). Surrounding whitespace is ignored.
        partial: The reward of a completion that contains the sum but not in that form, at ``brevity_chars`` or more
            extra characters (0 and ``brevity_chars: 0``: pass/fail).
        brevity_chars: Extra characters around the sum over which the reward falls from 1 to ``partial``
            (0: ``partial`` for any completion that is not exact).
        holdout: Prompts kept back from training for validation (``val_prompts()``).
    """

    def __init__(self, form: Literal["number", "tag"] = "number", partial: float = 0.2, brevity_chars: int = 0,
                 holdout: int = 0) -> None:
        if form not in _QUESTIONS:
            raise ValueError(f"StrictAnswer(form={form!r}) must be one of {sorted(_QUESTIONS)}")
        if not 0.0 <= partial < 1.0:
            raise ValueError(f"StrictAnswer(partial={partial!r}) must be in [0, 1)")
        if brevity_chars < 0:
            raise ValueError(f"StrictAnswer(brevity_chars={brevity_chars!r}) must be >= 0")
        super().__init__(holdout, question=_QUESTIONS[form])
        self.form, self.partial, self.brevity_chars = form, partial, brevity_chars

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """1.0 for the sum alone in the required form; if the sum appears otherwise, ``partial`` plus
        ``(1 - partial) * (1 - extra / brevity_chars)`` for ``extra`` characters beyond the exact form (at least
        ``partial``); else 0."""
        answer = str(int(prompt.metadata["a"]) + int(prompt.metadata["b"]))
        text = completion.strip()
        target = answer if self.form == "number" else f"<answer>{answer}</answer>"
        if text == target:
            return 1.0
        if not re.search(rf"(?<!\d){answer}(?!\d)", text):
            return 0.0
        if not self.brevity_chars:
            return self.partial
        extra = max(len(text) - len(target), 1)
        return self.partial + (1.0 - self.partial) * max(0.0, 1.0 - extra / self.brevity_chars)
