"""The state an event-log audit replays, and how a ``restore`` rewinds it.

:class:`ReplayState` holds every reserved group's status and stamps, the sampler cursor, the open train steps,
the prompt ledger and the *anchors*: the group states captured at each checkpoint or snapshot of the newest
steps. A ``restore`` at step R resumes the anchor it names (by ``mutation_version``): later history is void,
steps >= R no longer count as trained, and groups open at the crash are superseded unless the restore lists
them. The per-event rules that advance this state live in :mod:`screl.data.event_check`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from screl.data.buffer import GroupSlot
from screl.data.event_prompts import EventCheckReport, PromptLedger, PromptState, Violation
from screl.data.events import CheckpointEvent, RestoreEvent, SnapshotEvent
from screl.data.sampler_api import StalenessSampler
from screl.data.sampler_config import SamplerConfig
from screl.data.sampler_factory import sampler_rules

__all__ = ["ReplayGroup", "ReplayState"]

_LIVE = ("inflight", "ready")
_OPEN = ("inflight", "ready", "selected", "failed")
_MAX_ANCHORS = 8  # steps whose checkpoints/snapshots are remembered as restore points (the newest ones)

_AnchorState = tuple[str, int | None, int | None, int | None]  # status, trained step, target step, end weight


@dataclass
class ReplayGroup:
    """One reserved group as the log has told it so far."""

    prompt_id: int
    start_weight: int
    target_step: int | None
    order: int
    status: str = "inflight"
    end_weight: int | None = None
    selected_at: int | None = None
    trained_step: int | None = None


class ReplayState:
    """The replayed run: groups, cursor, open steps, prompts and restore anchors; violations go to ``report``."""

    def __init__(self, cfg: SamplerConfig | None, max_buffered_rollouts: int | None) -> None:
        self.cfg = cfg
        # the sampler's own rules; None (no config) or not ``audited``: sampler rules are not checked
        rules = sampler_rules(cfg) if cfg is not None else None
        self.rules: StalenessSampler | None = rules if rules is not None and rules.audited else None
        self.cap = max_buffered_rollouts
        self.report = EventCheckReport(sampler=cfg.name if cfg else None)
        self.groups: dict[str, ReplayGroup] = {}
        self.version = 0
        self.cursor: int | None = -1
        self.order = 0
        self.open_steps: dict[int, list[str]] = {}
        self.pending_retry: dict[int, list[str]] = {}
        # step -> its captures in log order: (mutation version, group states, (pending prompts, spares))
        self.anchors: dict[int, list[tuple[int | None, dict[str, _AnchorState], PromptState]]] = {}
        self.prompts = PromptLedger(self.flag)
        self.reopened: set[str] = set()  # groups generating at the last restore's anchor (redispatched, not new)
        self.line = 0

    def flag(self, rule: str, message: str) -> None:
        self.report.violations.append(Violation(rule, self.line, message))

    def group(self, gid: str, event: str, allowed: Sequence[str]) -> ReplayGroup | None:
        g = self.groups.get(gid)
        if g is None:
            self.flag("unknown-group", f"{event} of group {gid!r} that was never reserved")
            return None
        if g.status not in allowed:
            rule = "trained-twice" if g.status == "trained" else f"{event}-state"
            self.flag(rule, f"{event} of group {gid!r} which is {g.status} (expected {' or '.join(allowed)})")
            return None
        return g

    def live(self) -> list[tuple[str, ReplayGroup]]:
        return sorted(((k, g) for k, g in self.groups.items() if g.status in _LIVE), key=lambda p: p[1].order)

    @staticmethod
    def slot(gid: str, g: ReplayGroup, ready: bool | None = None) -> GroupSlot:
        """The group as its sampler saw it in the buffer."""
        is_ready = g.status == "ready" if ready is None else ready
        return GroupSlot(gid, g.prompt_id, g.start_weight, g.end_weight, g.target_step, is_ready)

    # ------------------------------------------------------------------ anchors and restores

    def on_anchor(self, e: CheckpointEvent | SnapshotEvent) -> None:
        if e.step != self.version:
            self.flag("anchor-step", f"{e.name} at step {e.step} while {self.version} steps are done")
        state = {k: (g.status, g.trained_step, g.target_step, g.end_weight) for k, g in self.groups.items()}
        self.anchors.setdefault(e.step, []).append((e.mutation_version, state, self.prompts.anchor()))
        while len(self.anchors) > _MAX_ANCHORS:
            del self.anchors[min(self.anchors)]

    def _restored_anchor(
        self, e: RestoreEvent
    ) -> tuple[dict[str, _AnchorState], PromptState | None] | None:
        """The anchor a restore resumed from: the step's capture with the restore's mutation version (a
        checkpoint, or a snapshot that was published), else the step's latest. Later anchors of that step are
        void (e.g. a snapshot captured, then killed before it was published). A fresh start resumes from the
        empty state: no capture before it was ever published, so all of them are void."""
        if (e.extra or {}).get("fresh"):
            self.anchors.clear()  # nothing was published: every capture so far is void
            return {}, None
        candidates = self.anchors.get(e.step, [])
        index = len(candidates) - 1
        if e.mutation_version is not None:
            matching = [i for i, (mv, *_) in enumerate(candidates) if mv == e.mutation_version]
            if matching:
                index = matching[-1]
            elif candidates:
                self.flag("restore-anchor", f"restore at step {e.step} from a state (mutation version "
                          f"{e.mutation_version}) that no checkpoint or snapshot of that step logged")
        if index < 0:
            return None
        self.anchors[e.step] = candidates[: index + 1]
        return candidates[index][1], candidates[index][2]

    def on_restore(self, e: RestoreEvent) -> None:
        """Rewind to the anchor at step R: later history is void, open groups superseded unless restored."""
        self.report.restores += 1
        r = e.step
        restored = self._restored_anchor(e)
        anchor = restored[0] if restored is not None else None
        self.prompts.rewind(restored[1] if restored is not None else None)
        self.reopened = {k for k, st in (anchor or {}).items() if st[0] in ("inflight", "failed")}
        buffered = [k for k, st in (anchor or {}).items() if st[0] in ("ready", "selected")]
        if anchor is not None and e.group_ids is not None:
            lost = sorted(set(buffered) - set(e.group_ids))
            if lost:
                self.flag(
                    "lost-on-restore", f"groups {lost} were buffered at the step-{r} anchor but not restored"
                )
        for k, g in self.groups.items():
            if anchor is not None:
                g.status, g.trained_step, g.target_step, g.end_weight = anchor.get(
                    k, ("superseded", None, None, None)
                )
            if g.status == "trained" and g.trained_step is not None and g.trained_step >= r:
                g.status, g.trained_step = "superseded", None
            elif g.status in _OPEN:
                g.status = "superseded"
            g.selected_at = None
        for gid in e.group_ids if e.group_ids is not None else buffered:
            self.restore_group(gid)
        self.anchors = {s: a for s, a in self.anchors.items() if s <= r}
        self.open_steps.clear()
        self.pending_retry.clear()
        self.version, self.cursor = r, None

    def restore_group(self, gid: str) -> None:
        g = self.groups.get(gid)
        if (
            g is None
            or g.status not in ("superseded", "evicted", "dropped", "aborted")
            or g.end_weight is None
        ):
            state = "unknown" if g is None else "never committed" if g.end_weight is None else g.status
            self.flag(
                "restore-state",
                f"restored group {gid!r} is {state}; only committed, untrained groups restore",
            )
            return
        g.status = "ready"

    def finish(self, final: bool) -> None:
        counts: dict[str, int] = {}
        for g in self.groups.values():
            counts[g.status] = counts.get(g.status, 0) + 1
        self.report.outcomes = counts
        self.report.prompts = dict(self.prompts.counts)
        self.prompts.finish(final)
        if final:
            unfinished = {s: counts.get(s, 0) for s in ("inflight", "failed", "selected") if counts.get(s)}
            if unfinished:
                self.flag("unfinished", f"the run ended with groups {unfinished} unaccounted for")
