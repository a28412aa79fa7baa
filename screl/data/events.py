"""Typed records of the run's event log (``events.jsonl``: one JSON object per line, flushed as it happens).

Every record has ``event`` (its name) and an optional ``time`` (seconds, supplied by the caller's
clock: this module reads none). Other fields, where they apply:

===========  =====================================================================================
event        fields (required first)
===========  =====================================================================================
admit        trainer_version, step (dispatch index of the admitted batch); target_step (stamp), prompt_ids
spare        trainer_version, prompt_ids (a dataloader batch held back as replacement reserve)   [screl]
replace      group_id, prompt_id (the dropped group), replacement (the spare's prompt id); target_step  [screl]
reserve      group_id, prompt_id, start_weight; target_step, trainer_version
commit       group_id, end_weight; start_weight, prompt_id, target_step
fail         group_id; prompt_id, sibling (a sibling attempt: the group lives on), reason
promote      group_id, target_step (new stamp), step (the lender's old stamp)   [screl extension]
select       trainer_version, group_ids (training order); step
evict        group_id, trainer_version; start_weight, target_step, reason
abort        group_id, trainer_version; start_weight, reason (default: stale in-flight at refit)
drop         reason, and group_id or prompt_id (a prompt dropped before it was reserved: an admitted one at
             shutdown, or a spare with reason ``reserve_unused``); reason ``filtered``: dynamic sampling
train_step   step, group_ids (every group trained in the step); trainer_version
validate     trainer_version (the weights validated; extra: token_versions, samples, reward_mean, pass@k)  [screl]
refit        trainer_version (the version the rollout engines now serve)
checkpoint   step (trainer steps done when the state was captured)
snapshot     step (base trainer step of a periodic rollout snapshot, captured under the barrier)
restore      step (the run resumed after this many steps); group_ids (groups restored into the buffer)
===========  =====================================================================================

Logging contract (what ``screl events check`` relies on): records are appended in the order the
controller applies the mutations (a commit is logged when the buffer commits, a select when the
groups are claimed, a checkpoint/snapshot when its state is captured); a retried attempt is a
``fail`` followed by a ``reserve`` of the same prompt id; a redispatch after a restart reserves
the ledger's group id again.

``screl events check RUN_DIR`` audits a run (:mod:`screl.data.event_check`, its command line in
:mod:`screl.data.event_check_cli`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar

EVENTS_FILENAME = "events.jsonl"

_INT_FIELDS = frozenset(
    {"prompt_id", "sibling", "start_weight", "end_weight", "target_step", "trainer_version", "step", "replacement"}
)
_STR_FIELDS = frozenset({"group_id", "reason"})


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of all event records."""

    name: ClassVar[str] = ""
    time: float | None = None
    extra: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)
    """Diagnostics beyond the contract (e.g. ``reward_mean``); written inline, ignored by the checker."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "extra":
                _check_field(self.name, f.name, getattr(self, f.name))
        clash = sorted(set(self.extra or {}) & ({f.name for f in dataclasses.fields(self)} | {"event"}))
        if clash:
            raise ValueError(f"{self.name} event: extra fields {clash} shadow contract fields")

    def to_dict(self) -> dict[str, Any]:
        """``{"event": name, ...fields, ...extra}``, omitting fields that are None."""
        out: dict[str, Any] = {"event": self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                continue
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        out.update(self.extra or {})
        return out

    def to_json(self) -> str:
        """One compact JSON line (no trailing newline)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _check_field(event: str, key: str, value: object) -> None:
    if value is None:
        return
    if key in _INT_FIELDS:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif key in _STR_FIELDS:
        ok = isinstance(value, str) and bool(value)
    elif key == "group_ids":
        ok = isinstance(value, tuple) and all(isinstance(g, str) for g in value)
    elif key == "prompt_ids":
        ok = isinstance(value, tuple) and all(isinstance(p, int) and not isinstance(p, bool) for p in value)
    elif key == "time":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = True
    if not ok:
        raise ValueError(f"{event} event: field {key!r} has invalid value {value!r}")


@dataclass(frozen=True, kw_only=True)
class AdmitEvent(Event):
    name: ClassVar[str] = "admit"
    trainer_version: int
    step: int
    target_step: int | None = None
    prompt_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class SpareEvent(Event):
    """A dataloader batch held back as replacement reserve (``on_dropped_prompt: replace``)."""

    name: ClassVar[str] = "spare"
    trainer_version: int
    prompt_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ReplaceEvent(Event):
    """A dropped group's slot handed to a spare prompt, stamped for the same step."""

    name: ClassVar[str] = "replace"
    group_id: str
    prompt_id: int
    replacement: int
    target_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class ReserveEvent(Event):
    name: ClassVar[str] = "reserve"
    group_id: str
    prompt_id: int
    start_weight: int
    target_step: int | None = None
    trainer_version: int | None = None


@dataclass(frozen=True, kw_only=True)
class CommitEvent(Event):
    name: ClassVar[str] = "commit"
    group_id: str
    end_weight: int
    start_weight: int | None = None
    prompt_id: int | None = None
    target_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class FailEvent(Event):
    name: ClassVar[str] = "fail"
    group_id: str
    prompt_id: int | None = None
    sibling: int | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class PromoteEvent(Event):
    name: ClassVar[str] = "promote"
    group_id: str
    target_step: int
    step: int


@dataclass(frozen=True, kw_only=True)
class SelectEvent(Event):
    name: ClassVar[str] = "select"
    trainer_version: int
    group_ids: tuple[str, ...]
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class EvictEvent(Event):
    name: ClassVar[str] = "evict"
    group_id: str
    trainer_version: int
    start_weight: int | None = None
    target_step: int | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class AbortEvent(Event):
    name: ClassVar[str] = "abort"
    group_id: str
    trainer_version: int
    start_weight: int | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class DropEvent(Event):
    name: ClassVar[str] = "drop"
    reason: str
    group_id: str | None = None
    prompt_id: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_id is None and self.prompt_id is None:
            raise ValueError("drop event: name the dropped group_id or prompt_id")


@dataclass(frozen=True, kw_only=True)
class TrainStepEvent(Event):
    name: ClassVar[str] = "train_step"
    step: int
    group_ids: tuple[str, ...]
    trainer_version: int | None = None


@dataclass(frozen=True, kw_only=True)
class RefitEvent(Event):
    name: ClassVar[str] = "refit"
    trainer_version: int


@dataclass(frozen=True, kw_only=True)
class WindowEvent(Event):
    """The sampler's gate window changed (PPO critic warmup: ``warmup_lookahead_versions`` shrinking to
    ``max_lookahead_versions``); logged once at the start too, when the sampler retunes at all."""

    name: ClassVar[str] = "window"
    trainer_version: int
    window: int


@dataclass(frozen=True, kw_only=True)
class ValidateEvent(Event):
    """A validation of the weights of ``trainer_version`` finished (every sample scored); its metrics and the
    weight versions its tokens came from (``token_versions``: exactly that version) ride along."""

    name: ClassVar[str] = "validate"
    trainer_version: int


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(Event):
    name: ClassVar[str] = "checkpoint"
    step: int
    mutation_version: int | None = None
    """The controller's data-plane mutation counter at the capture: names this state among the step's anchors."""


@dataclass(frozen=True, kw_only=True)
class SnapshotEvent(Event):
    name: ClassVar[str] = "snapshot"
    step: int
    mutation_version: int | None = None
    """As for ``checkpoint``. Logged at the capture, so a snapshot killed before it was published is logged too."""


@dataclass(frozen=True, kw_only=True)
class RestoreEvent(Event):
    name: ClassVar[str] = "restore"
    step: int
    group_ids: tuple[str, ...] | None = None
    mutation_version: int | None = None
    """The restored state's capture (a ``checkpoint`` or ``snapshot`` of this step); None: the step's latest."""


EVENT_TYPES: dict[str, type[Event]] = {
    cls.name: cls
    for cls in (
        AdmitEvent,
        SpareEvent,
        ReplaceEvent,
        ReserveEvent,
        CommitEvent,
        FailEvent,
        PromoteEvent,
        SelectEvent,
        EvictEvent,
        AbortEvent,
        DropEvent,
        TrainStepEvent,
        RefitEvent,
        WindowEvent,
        ValidateEvent,
        CheckpointEvent,
        SnapshotEvent,
        RestoreEvent,
    )
}


def parse_event(line: str | Mapping[str, Any]) -> Event:
    """The typed record of one log line (or an already-decoded mapping); ValueError names what is wrong."""
    if isinstance(line, str):
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON object: {line.strip()[:120]!r} ({exc})") from None
    else:
        data = line
    if not isinstance(data, Mapping):
        raise ValueError(f"an event must be a JSON object, got {type(data).__name__}")
    fields = dict(data)
    name = fields.pop("event", None)
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown event {name!r}; expected one of {sorted(EVENT_TYPES)}")
    known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    extra = {k: fields.pop(k) for k in sorted(set(fields) - known)}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    missing = sorted(required - set(fields))
    if missing:
        raise ValueError(f"{name} event: missing fields {missing}")
    for key in ("group_ids", "prompt_ids"):
        if isinstance(fields.get(key), list):
            fields[key] = tuple(fields[key])
    return cls(**fields, extra=extra or None)


def read_events(source: str | os.PathLike[str] | Iterable[str]) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines of a log file, a run directory, or given lines."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            path = path / EVENTS_FILENAME
        with path.open(encoding="utf-8") as fh:
            yield from ((n, line) for n, line in enumerate(fh, 1) if line.strip())
        return
    yield from ((n, line) for n, line in enumerate(source, 1) if line.strip())


def torn_tail(path: str | os.PathLike[str]) -> bytes:
    """The unterminated last line of a log file (a writer killed mid-write), or ``b""`` when it ends cleanly."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        tail = b""
        while size > 0:  # read backwards to the last newline
            step = min(size, 65536)
            size -= step
            fh.seek(size)
            tail = fh.read(step) + tail
            if b"\n" in tail:
                return tail.rsplit(b"\n", 1)[1]
        return tail


def repair_torn_tail(path: str | os.PathLike[str]) -> str | None:
    """Cut an unterminated last line (left by a writer killed mid-write) off the log, so that the next event starts
    a line of its own instead of merging into it; returns a note saying what was cut, or None (nothing to do)."""
    if not os.path.exists(path):
        return None
    torn = torn_tail(path)
    if not torn:
        return None
    size = os.path.getsize(path)
    os.truncate(path, size - len(torn))
    return (f"{path}: cut a torn last line ({len(torn)} bytes, {torn[:80]!r}...) left by a writer that was killed "
            "mid-write; the events before it are intact")


def open_event_log(path: str | os.PathLike[str]) -> tuple[IO[str], str | None]:
    """Open a run's event log for appending, first cutting a torn last line (:func:`repair_torn_tail`); returns the
    stream and the repair's note (None when the log ended cleanly)."""
    note = repair_torn_tail(path)
    return open(path, "a", encoding="utf-8"), note  # noqa: SIM115 - the caller owns the stream


class EventLogWriter:
    """Appends events to an open text stream, one line each, flushed at once.

    ``clock`` stamps ``time`` on events that carry none (inject ``time.time`` at the composition root).
    """

    def __init__(self, stream: IO[str], clock: Callable[[], float] | None = None) -> None:
        self._stream = stream
        self._clock = clock

    def write(self, event: Event) -> None:
        if event.time is None and self._clock is not None:
            event = dataclasses.replace(event, time=self._clock())
        self._stream.write(event.to_json() + "\n")
        self._stream.flush()
