"""Audit a run's event log: no group trained twice, every sampler rule held, no prompt lost.

``check_events(source, sampler_config)`` replays the log (see ``screl.data.events`` for the records
and the logging contract) and reports each violation with its rule and line:

* ``trained-twice`` / ``selected-twice``: a group trained or selected again (after a restore, only
  steps from the restore point on are superseded).
* ``select-rule``: a selected group broke its sampler's rule (in_order ``target_step == T``;
  windowed ``T - S <= start_weight <= T``; ready_first ``start_weight <= T``; weight_fifo the oldest
  in-window start weight); ``select-order``: the selection is not the head of the sampler's
  eligible list at that moment (the greedy prefix, in dispatch or freshest-first order).
* ``gate``: a gated sampler dispatched batch ``d > T + window``; ``dispatch-cursor``, ``in_order-stamp``.
* ``evict-rule`` / ``abort-rule``: eviction or in-flight abort the sampler never does.
* ``*-state`` / ``unknown-group``: transitions out of order (commit twice, select an unready group...).
* ``train-step-mismatch``: a step trained other groups than were selected for it.
* ``lost-on-restore``: a group ready or claimed at the resumed checkpoint is missing from the
  restore's ``group_ids``. A step may have several anchors (its checkpoint, then periodic snapshots,
  each logged when captured): the restore names the one it resumed by ``mutation_version``.
* ``restore-anchor``: a restore names a ``mutation_version`` that no anchor of its step logged.
* ``validate-version`` / ``validate-pinned``: a validation of weights not yet trained, or whose tokens came
  from other weights than the version it names.
* ``capacity``: more buffered groups than ``max_buffered_rollouts`` (when given).
* ``unfinished`` (only with ``final=True``): a run that ended with rollouts in flight, failed attempts
  neither retried nor dropped, a selected step never trained, or prompts unaccounted for.
* ``prompt-accounting``: every prompt an ``admit`` names is reserved once or dropped unreserved (``drop`` with
  its prompt id, at shutdown); a ``spare`` batch is held in the replacement reserve until a ``replace`` hands a
  spare to a dropped group's slot, an ``admit`` (``from_reserve``) takes a step's worth, or it is dropped with
  reason ``reserve_unused``. Checked when the admits name their ``prompt_ids``.

A ``restore`` at step R supersedes what the log said before it about steps >= R: those train steps
no longer count, and groups open at the crash are superseded unless restored (the replayed state and that
rewind are :mod:`screl.data.event_replay`; the per-event rules are here).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from screl.data.event_prompts import EventCheckReport, Violation
from screl.data.event_replay import ReplayGroup, ReplayState
from screl.data.events import (
    AbortEvent,
    AdmitEvent,
    CheckpointEvent,
    CommitEvent,
    DropEvent,
    Event,
    EvictEvent,
    FailEvent,
    PromoteEvent,
    RefitEvent,
    ReplaceEvent,
    ReserveEvent,
    RestoreEvent,
    SelectEvent,
    SnapshotEvent,
    SpareEvent,
    TrainStepEvent,
    ValidateEvent,
    WindowEvent,
    parse_event,
    read_events,
)
from screl.data.sampler_config import SamplerConfig, parse_sampler_config

__all__ = ["EventCheckReport", "Violation", "check_events"]


class _Checker(ReplayState):
    """The per-event rules: each ``on_<event>`` checks one record against the replayed state, then applies it."""

    def on_admit(self, e: AdmitEvent) -> None:
        if e.prompt_ids is not None:
            self.prompts.admit(e.prompt_ids, bool((e.extra or {}).get("from_reserve")))
        if e.trainer_version > self.version:
            self.flag(
                "admit-version",
                f"admit at trainer_version {e.trainer_version} ahead of {self.version} steps done",
            )
        if self.cursor is not None and e.step != self.cursor + 1:
            self.flag("dispatch-cursor", f"admitted batch {e.step} after batch {self.cursor}")
        self.cursor = e.step
        if self.rules is None:
            return
        limit = self.rules.max_admitted_batch(e.trainer_version)
        if limit is not None and e.step > limit:
            self.flag(
                "gate",
                f"{self.rules.name} admitted batch {e.step} at T={e.trainer_version}, beyond the window "
                f"{self.rules.peak_window} (latest allowed batch {limit})",
            )
        stamp = self.rules.expected_stamp(e.step)
        if stamp is not None and e.target_step != stamp:
            self.flag(
                f"{self.rules.name}-stamp", f"batch {e.step} stamped target_step={e.target_step}, expected {stamp}"
            )

    def on_spare(self, e: SpareEvent) -> None:
        self.prompts.hold(e.prompt_ids)

    def on_replace(self, e: ReplaceEvent) -> None:
        g = self.group(e.group_id, "replace", ("dropped", "filtered"))
        if g is not None:
            if g.target_step != e.target_step:
                self.flag("replace-state", f"group {e.group_id!r} stamped {g.target_step} replaced for step "
                          f"{e.target_step}")
            g.status = "replaced"
        self.prompts.replace(e.replacement)

    def on_reserve(self, e: ReserveEvent) -> None:
        old = self.groups.get(e.group_id)
        if old is not None and old.status != "superseded":
            self.flag("reserve-state", f"group {e.group_id!r} reserved again while {old.status}")
        retry = self.pending_retry.get(e.prompt_id)
        if retry:
            self.groups[retry.pop(0)].status = "retried"
        elif e.group_id in self.reopened:  # a group generating at the restored anchor, dispatched again
            self.reopened.discard(e.group_id)
        else:  # a new group: it takes an admitted prompt
            self.prompts.reserve(e.prompt_id)
        self.groups[e.group_id] = ReplayGroup(e.prompt_id, e.start_weight, e.target_step, self.order)
        self.order += 1
        held = sum(1 for g in self.groups.values() if g.status in ("inflight", "ready", "selected"))
        if self.cap is not None and held > self.cap:
            self.flag(
                "capacity",
                f"{held} groups buffered after reserving {e.group_id!r}, max_buffered_rollouts={self.cap}",
            )

    def on_commit(self, e: CommitEvent) -> None:
        g = self.group(e.group_id, "commit", ("inflight",))
        if g is None:
            return
        if e.end_weight < g.start_weight or (e.start_weight is not None and e.start_weight != g.start_weight):
            self.flag(
                "commit-weights",
                f"group {e.group_id!r} committed start/end weights {e.start_weight}/{e.end_weight}, "
                f"reserved at start_weight {g.start_weight}",
            )
        g.status, g.end_weight = "ready", e.end_weight

    def on_fail(self, e: FailEvent) -> None:
        g = self.group(e.group_id, "fail", ("inflight",))
        if g is None or e.sibling is not None:
            return
        g.status = "failed"
        self.pending_retry.setdefault(g.prompt_id, []).append(e.group_id)

    def on_promote(self, e: PromoteEvent) -> None:
        g = self.group(e.group_id, "promote", ("ready",))
        if g is None:
            return
        if g.target_step != e.step or e.target_step >= e.step:
            self.flag(
                "promote-state",
                f"group {e.group_id!r} stamped {g.target_step} promoted from {e.step} to {e.target_step}",
            )
        g.target_step = e.target_step

    def on_select(self, e: SelectEvent) -> None:
        t = e.trainer_version
        if t != self.version:
            self.flag("select-version", f"select at trainer_version {t} while {self.version} steps are done")
        eligible = self.eligible(t)
        flagged = len(self.report.violations)
        if len(set(e.group_ids)) != len(e.group_ids):
            self.flag("selected-twice", f"select at T={t} names a group twice: {list(e.group_ids)}")
        groups = []
        for gid in e.group_ids:
            g = self.groups.get(gid)
            if g is not None and g.status in ("selected", "trained"):
                self.flag(
                    "selected-twice" if g.status == "selected" else "trained-twice",
                    f"group {gid!r} selected at T={t} but already {g.status}",
                )
                continue
            g = self.group(gid, "select", ("ready",))
            if g is not None:
                self.check_select_rule(gid, g, t, eligible)
                groups.append(g)
        clean = len(self.report.violations) == flagged  # one cause, one report: order only if all else held
        if clean and eligible is not None and list(e.group_ids) != eligible[: len(e.group_ids)]:
            self.flag(
                "select-order",
                f"{self.report.sampler} at T={t} selected {list(e.group_ids)}; the eligible groups in order "
                f"were {eligible[: len(e.group_ids) + 3]}",
            )
        for g in groups:
            g.status, g.selected_at = "selected", t
        self.open_steps.setdefault(t, []).extend(e.group_ids)

    def eligible(self, t: int) -> list[str] | None:
        """The sampler's eligible list at trainer version ``t`` (None: rules not checked)."""
        if self.rules is None:
            return None
        found = self.rules.eligible([self.slot(k, g) for k, g in self.live()], t)
        return None if found is None else [s.group_id for s in found]

    def check_select_rule(self, gid: str, g: ReplayGroup, t: int, eligible: list[str] | None) -> None:
        if self.rules is None or eligible is None or gid in eligible:
            return
        why = self.rules.ineligible_reason(self.slot(gid, g), t)
        self.flag("select-rule", f"{self.rules.name} selected group {gid!r} at T={t}: {why}")

    def on_evict(self, e: EvictEvent) -> None:
        g = self.groups.get(e.group_id)
        if g is not None and g.status == "inflight":
            self.flag("evict-unready", f"evicted group {e.group_id!r} while its rollout was in flight")
        g = self.group(e.group_id, "evict", ("ready", "inflight"))
        if g is None:
            return
        t, rules = e.trainer_version, self.rules
        if rules is not None and e.reason != "shutdown":
            if e.group_id not in rules.evict([self.slot(e.group_id, g, ready=True)], t):
                self.flag(
                    "evict-rule",
                    f"{rules.name} evicted group {e.group_id!r} (start_weight {g.start_weight}, target_step "
                    f"{g.target_step}) at T={t}, which it may still select",
                )
        g.status = "evicted"

    def on_abort(self, e: AbortEvent) -> None:
        g = self.group(e.group_id, "abort", ("inflight",))
        if g is None:
            return
        rules = self.rules
        if rules is not None and e.reason in (None, "stale"):
            if not rules.should_abort_inflight(g.start_weight, e.trainer_version):
                self.flag(
                    "abort-rule",
                    f"{rules.name} aborted in-flight group {e.group_id!r} (start_weight {g.start_weight}) at "
                    f"T={e.trainer_version}, which its should_abort_inflight keeps",
                )
        g.status = "aborted"

    def on_drop(self, e: DropEvent) -> None:
        if e.group_id is not None:
            g = self.group(e.group_id, "drop", ("inflight", "ready", "failed"))
            if g is not None:
                if g.status == "failed":
                    self.pending_retry[g.prompt_id].remove(e.group_id)
                g.status = "filtered" if e.reason == "filtered" else "dropped"
        elif e.prompt_id is not None and self.pending_retry.get(e.prompt_id):
            self.groups[self.pending_retry[e.prompt_id].pop(0)].status = "dropped"
        elif e.prompt_id is not None:
            self.prompts.drop(e.prompt_id, e.reason)

    def on_train_step(self, e: TrainStepEvent) -> None:
        if e.step != self.version:
            self.flag("train-step-order", f"train step {e.step} logged after {self.version} steps")
        selected = self.open_steps.pop(e.step, [])
        if sorted(selected) != sorted(e.group_ids):
            self.flag(
                "train-step-mismatch",
                f"step {e.step} trained {sorted(e.group_ids)} but selected {sorted(selected)}",
            )
        for gid in e.group_ids:
            g = self.groups.get(gid)
            if g is None:
                self.flag("unknown-group", f"train_step of group {gid!r} that was never reserved")
            elif g.status == "trained":
                self.flag(
                    "trained-twice", f"group {gid!r} trained at step {e.step} and step {g.trained_step}"
                )
            else:
                g.status, g.trained_step = "trained", e.step
        self.version = e.step + 1

    def on_refit(self, e: RefitEvent) -> None:
        if e.trainer_version != self.version:
            self.flag("refit-version", f"refit to version {e.trainer_version} after {self.version} steps")

    def on_window(self, e: WindowEvent) -> None:
        if e.trainer_version != self.version:
            self.flag("window-version", f"window change at version {e.trainer_version} after {self.version} steps")
        peak = self.rules.peak_window if self.rules is not None else None
        if peak is not None and e.window > peak:
            self.flag("window-rule", f"window {e.window} is wider than the sampler's widest window {peak}")

    def on_validate(self, e: ValidateEvent) -> None:
        if e.trainer_version > self.version:
            self.flag("validate-version", f"validation of version {e.trainer_version} after {self.version} steps")
        seen = (e.extra or {}).get("token_versions")
        if seen is not None and list(seen) not in ([], [e.trainer_version]):
            self.flag("validate-pinned", f"validation of version {e.trainer_version} generated with versions {seen}")


_HANDLERS: dict[type[Event], str] = {
    AdmitEvent: "on_admit",
    SpareEvent: "on_spare",
    ReplaceEvent: "on_replace",
    ReserveEvent: "on_reserve",
    CommitEvent: "on_commit",
    FailEvent: "on_fail",
    PromoteEvent: "on_promote",
    SelectEvent: "on_select",
    EvictEvent: "on_evict",
    AbortEvent: "on_abort",
    DropEvent: "on_drop",
    TrainStepEvent: "on_train_step",
    RefitEvent: "on_refit",
    WindowEvent: "on_window",
    ValidateEvent: "on_validate",
    CheckpointEvent: "on_anchor",
    SnapshotEvent: "on_anchor",
    RestoreEvent: "on_restore",
}


def check_events(
    source: str | os.PathLike[str] | Iterable[str | Event],
    sampler_config: Mapping[str, Any] | SamplerConfig | None = None,
    *,
    max_buffered_rollouts: int | None = None,
    final: bool = False,
) -> EventCheckReport:
    """Check an event log (a run directory, an ``events.jsonl`` path, lines, or Event objects).

    Without ``sampler_config`` only the sampler-independent rules are checked.
    """
    cfg = parse_sampler_config(sampler_config) if sampler_config is not None else None
    checker = _Checker(cfg, max_buffered_rollouts)
    if isinstance(source, (str, os.PathLike)):
        items: Iterable[tuple[int, str | Event]] = read_events(source)
    else:
        items = enumerate(source, 1)
    unparsed: tuple[int, str, str] | None = None  # (line, text, error) of a line that did not parse
    for n, item in items:
        if unparsed is not None:  # another line follows it: not a torn last line
            checker.line = unparsed[0]
            checker.flag("parse", unparsed[2])
            unparsed = None
        checker.line = n
        checker.report.events += 1
        if isinstance(item, str):
            if not item.strip():
                continue
            text = item
            try:
                item = parse_event(text)
            except ValueError as exc:
                unparsed = (n, text, str(exc))
                continue
        getattr(checker, _HANDLERS[type(item)])(item)
    if unparsed is not None:
        checker.line = unparsed[0]
        if unparsed[1].endswith("\n") or not isinstance(source, (str, os.PathLike)):
            checker.flag("parse", unparsed[2])
        else:  # no newline: the writer was killed mid-line, and no later incarnation appended after it
            checker.report.events -= 1
            checker.report.notes.append(
                f"line {unparsed[0]} is torn ({len(unparsed[1])} characters, no newline: a writer killed mid-write);"
                " ignored. A resumed run cuts it before appending")
    checker.finish(final)
    return checker.report
