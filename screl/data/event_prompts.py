"""The report of ``screl events check`` and its prompt accounting: every prompt an ``admit`` names ends reserved
or dropped.

A prompt is *pending* from its admit until a ``reserve`` takes it (or a ``drop`` with its prompt id, at
shutdown, releases it). A ``spare`` batch goes into the replacement reserve; a spare leaves it through a
``replace`` (it becomes pending, for the dropped group's slot), an ``admit`` marked ``from_reserve``, or a
``drop`` with reason ``reserve_unused``. Checked only when the admits name their ``prompt_ids``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Violation:
    rule: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: [{self.rule}] {self.message}"


@dataclass
class EventCheckReport:
    """Outcome of ``check_events``: violations plus where every reserved group ended up."""

    events: int = 0
    violations: list[Violation] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    """Groups per final state: trained, evicted, dropped, filtered (dynamic sampling), replaced (dropped or
    filtered, its slot refilled by a spare), aborted, retried, inflight, ready (buffered), selected (open step),
    failed (awaiting retry), superseded (by a restore)."""
    prompts: dict[str, int] = field(default_factory=dict)
    """Prompt accounting: admitted, held as spares, replacements, dropped unreserved, spares unused."""
    sampler: str | None = None
    restores: int = 0
    notes: list[str] = field(default_factory=list)
    """What the check tolerated and why (a torn last line left by a killed writer)."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def format(self, max_violations: int = 50) -> str:
        head = f"{self.events} events, sampler {self.sampler or 'unknown (sampler rules not checked)'}"
        if self.restores:
            head += f", {self.restores} restore(s)"
        lines = [head, "groups: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()) if v)]
        if any(self.prompts.values()):
            lines.append("prompts: " + ", ".join(f"{k} {v}" for k, v in self.prompts.items() if v))
        lines += [f"note: {note}" for note in self.notes]
        if self.ok:
            lines.append("OK: no violations")
        else:
            lines.append(f"{len(self.violations)} violation(s):")
            lines += [f"  {v}" for v in self.violations[:max_violations]]
            if len(self.violations) > max_violations:
                lines.append(f"  ... and {len(self.violations) - max_violations} more")
        return "\n".join(lines)


PromptState = tuple[Counter[int], Counter[int]]
"""(pending, spares) at an anchor."""


class PromptLedger:
    """The pending and spare prompts of a log being checked; ``flag(rule, message)`` reports a violation."""

    def __init__(self, flag: Callable[[str, str], None]) -> None:
        self.flag = flag
        self.pending: Counter[int] = Counter()
        self.spares: Counter[int] = Counter()
        self.tracking = False
        self.counts = dict.fromkeys(("admitted", "spares", "replacements", "dropped_unreserved", "spares_unused"), 0)

    def _take(self, pool: Counter[int], prompt_id: int, what: str) -> None:
        if pool[prompt_id] <= 0:
            where = "held in the reserve" if pool is self.spares else "admitted and unreserved"
            self.flag("prompt-accounting", f"{what} prompt {prompt_id}, which is not {where}")
            return
        pool[prompt_id] -= 1

    def admit(self, prompt_ids: tuple[int, ...], from_reserve: bool) -> None:
        self.tracking = True
        for pid in prompt_ids:
            if from_reserve:
                self._take(self.spares, pid, "admit from the reserve of")
            self.pending[pid] += 1
        self.counts["admitted"] += len(prompt_ids)

    def hold(self, prompt_ids: tuple[int, ...]) -> None:
        self.spares.update(prompt_ids)
        self.counts["spares"] += len(prompt_ids)

    def replace(self, replacement: int) -> None:
        self._take(self.spares, replacement, "replace with")
        self.pending[replacement] += 1
        self.counts["replacements"] += 1

    def reserve(self, prompt_id: int) -> None:
        if self.tracking:
            self._take(self.pending, prompt_id, "reserve of")

    def drop(self, prompt_id: int, reason: str) -> None:
        """A prompt dropped before it was reserved: an unused spare, or an admitted one."""
        if reason == "reserve_unused":
            self._take(self.spares, prompt_id, "drop (unused) of spare")
            self.counts["spares_unused"] += 1
        elif self.tracking:
            self._take(self.pending, prompt_id, "drop before reservation of")
            self.counts["dropped_unreserved"] += 1

    def anchor(self) -> PromptState:
        return Counter(self.pending), Counter(self.spares)

    def rewind(self, state: PromptState | None) -> None:
        """A restore: the anchor's prompts carry over (a fresh start, None, carries none)."""
        self.pending, self.spares = (Counter(state[0]), Counter(state[1])) if state else (Counter(), Counter())

    def finish(self, final: bool) -> None:
        if not final:
            return
        for what, pool in (("admitted, never reserved", +self.pending), ("held as spares", +self.spares)):
            if pool:
                self.flag("unfinished", f"the run ended with prompts {sorted(pool.elements())} {what}")
