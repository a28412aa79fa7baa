"""Values that cross the boundary of :class:`~screl.data.core.RolloutCore`: its settings, the effects each
transition returns, the reports it takes from the rollout workers, and the state it checkpoints.

All of them are plain data (no Ray, no asyncio, no clock): the controller actor executes effects, the
workers produce reports, the checkpoint stores ``ControllerState.to_dict()``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from screl.data.events import Event
from screl.data.reserve import ReservePolicy

if TYPE_CHECKING:
    from screl.data.prompt_table import PromptTable

STATE_SCHEMA = 2
"""Version of :class:`ControllerState`'s dict form (2: row keys carry the attempt, ``<group>_g<i>_a<n>``)."""


class RolloutFailure(RuntimeError):
    """A prompt group failed beyond its retry budget and the drop budget is spent."""


class WorkersLostError(RolloutFailure):
    """Every generation worker is dead for good (Ray will not restart them)."""


def seed_for(*parts: Any) -> int:
    """A 32-bit seed from any parts (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def replay_digest(groups: list[dict[str, Any]]) -> str:
    """SHA-256 over the canonical JSON of the replay index's groups."""
    return hashlib.sha256(json.dumps(groups, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class CorePrompt:
    """What the core needs of a prompt: its id and the keys its recovery granularity may be overridden by."""

    prompt_id: int
    task_source: str | None = None
    agent: str | None = None
    key: str | None = None
    """The dataset's own id of a prompt whose id is a string (``DatasetTask``'s ``metadata["dataset_id"]``): written
    beside its prompt id where the event log admits or holds it (``prompt_keys``)."""


@dataclass(frozen=True)
class FailureBudget:
    """The knobs of ``async_rl.rollout_failure`` the core acts on (retries, backoff, drop budgets), by the same
    names: the controller copies them from ``RolloutFailureConfig`` field by field."""

    max_infra_attempts: int = 5
    max_data_attempts: int = 2
    backoff_base_s: float = 1.0
    max_backoff_s: float = 30.0
    max_skipped_prompts: int = 0
    max_consecutive_dropped_prompts: int = 0
    min_step_batch_fraction: float = 0.9

    def backoff(self, k: int) -> float:
        """Delay before the ``k``-th retry (k >= 1): doubles from ``backoff_base_s`` up to ``max_backoff_s``."""
        return float(min(self.backoff_base_s * 2 ** (k - 1), self.max_backoff_s))


@dataclass(frozen=True)
class CoreSettings:
    """Everything the core is configured with (the controller builds it from the run config)."""

    prompts: tuple[CorePrompt, ...] | PromptTable
    """The training prompts (a :class:`~screl.data.prompt_table.PromptTable`, or the prompts themselves)."""
    groups_per_step: int
    generations_per_prompt: int
    max_num_epochs: int
    max_num_steps: int | None = None
    min_groups: int = 1
    max_buffered_rollouts: int | None = None
    max_inflight_prompts: int | None = None
    num_workers: int = 1
    seed: int = 0
    failure: FailureBudget = field(default_factory=FailureBudget)
    id_prefix: str = ""
    policy_training_start_step: int | None = None
    """(PPO) Critic warmup: the sampler may retune its window until the policy trains (``StalenessSampler.retune``)."""
    dynamic_sampling: bool = False
    """Drop a group whose rewards all agree (reason ``filtered``) instead of committing it."""
    reserve: ReservePolicy = field(default_factory=ReservePolicy)
    """The replacement reserve that refills a dropped group's slot (``on_dropped_prompt: replace``)."""
    step_may_shrink: bool = True
    """Whether a step may train fewer groups than ``groups_per_step`` after drops (PPO: no)."""
    algo_key: str = "grpo"
    """The config block of the step settings (``grpo``/``ppo``), for error messages."""


@dataclass(frozen=True)
class Dispatch:
    """Send one sibling attempt to worker ``worker`` (after ``delay_s``: a retry's backoff)."""

    attempt: str
    group_id: str
    sibling: int
    prompt_id: int
    seed: int
    priority: int
    worker: int
    delay_s: float = 0.0
    """The attempt id is also the data-plane key its row is written under."""


@dataclass(frozen=True)
class Burst:
    """Rollout calls the shell sends one worker at once (``size`` of them, one transition's dispatches): the
    worker starts decoding as soon as the first generate of each has arrived, instead of waiting out its
    gathering window after the last."""

    id: int
    size: int


STALE = "stale"
"""What a worker's ``rollout`` returns instead of reports when it serves an older version than the one the call
expects, or has no data plane (Ray restarted it): the shell refreshes it and calls again."""


@dataclass
class Effects:
    """What a transition asks the shell to do, in this order: log ``events`` (already in mutation order),
    clear ``clear`` from the data plane (under the barrier), send ``abort`` (worker -> attempt ids), run
    ``dispatch``; ``error`` stops the rollout pump."""

    events: list[Event] = field(default_factory=list)
    clear: list[str] = field(default_factory=list)
    abort: dict[int, list[str]] = field(default_factory=dict)
    dispatch: list[Dispatch] = field(default_factory=list)
    error: RolloutFailure | None = None

    def extend(self, other: Effects) -> Effects:
        self.events += other.events
        self.clear += other.clear
        for worker, ids in other.abort.items():
            self.abort.setdefault(worker, []).extend(ids)
        self.dispatch += other.dispatch
        self.error = self.error or other.error
        return self

    def abort_attempt(self, worker: int, attempt: str) -> None:
        self.abort.setdefault(worker, []).append(attempt)

    def __bool__(self) -> bool:
        return bool(self.events or self.clear or self.abort or self.dispatch or self.error)


@dataclass(frozen=True)
class SiblingReport:
    """A worker's word on one attempt (metadata only: the row, if any, is already in the data plane).

    ``status``: ``sealed`` (row written under the attempt's key), ``data_error`` (the reward or the workflow
    raised: the sibling is resampled), ``abort`` (the attempt was aborted before finishing; no row), ``timeout``
    (past ``generation_timeout_s`` or ``rollout_timeout_s``: aborted by the worker, retried as an infra failure).
    """

    attempt: str
    status: Literal["sealed", "data_error", "abort", "timeout"]
    reward: float = 0.0
    end_version: int = 0
    response_len: int = 0
    finish_reason: str = ""
    detail: str = ""
    reward_parts: dict[str, float] | None = None
    """A sealed sibling's value from each reward function (``screl.rewards``): ``train/rewards/<name>/*``."""


@dataclass
class GroupRun:
    """A prompt group in generation (the ledger holds its sibling states; this holds the rest)."""

    group_id: str
    prompt_id: int
    start_weight: int
    target_step: int | None
    epoch: int
    end_weight: int = 0
    keys: dict[int, str] = field(default_factory=dict)  # sealed sibling -> its row key
    rewards: dict[int, float] = field(default_factory=dict)
    resamples: dict[int, int] = field(default_factory=dict)  # sibling -> data failures (changes its seed)
    infra_failures: int = 0
    data_failures: int = 0
    started: float = 0.0
    replacements: int = 0
    """How many dropped groups this group's slot has replaced (0: an original prompt of its batch)."""

    def info(self) -> dict[str, Any]:
        """What a checkpoint keeps of a group in flight (the ledger keeps the rest)."""
        return {"epoch": self.epoch, "end_weight": self.end_weight, "resamples": dict(self.resamples),
                "sealed": sorted(self.keys), "keys": {str(s): k for s, k in sorted(self.keys.items())},
                "rewards": {str(s): r for s, r in sorted(self.rewards.items())}, "replacements": self.replacements}


@dataclass(frozen=True)
class ChunkPlan:
    """What the train side gets from :meth:`RolloutCore.next_chunk`.

    ``kind``: ``chunk`` (``group_ids``/``keys``/weights set), ``done`` (the run is over), ``wait`` (nothing
    trainable yet).
    """

    kind: Literal["chunk", "done", "wait"]
    group_ids: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    start_weight: tuple[int, ...] = ()
    end_weight: tuple[int, ...] = ()
    trainer_version: int = 0
    step_groups: int = 0
    last_chunk: bool = False


@dataclass
class ControllerState:
    """Everything a resume needs of the core, captured at a step boundary (or mid-step, claims rolled back).

    ``to_dict`` is the checkpoint's ``controller_state.pt`` layout; ``from_dict`` checks the schema.
    """

    train_steps: int
    trainer_version: int
    epoch: int
    batch_index: int
    admitted: list[list[Any]]
    sampler_name: str
    sampler: dict[str, Any]
    dispatch_index: int
    buffer: dict[str, Any]
    replay_index: dict[str, Any]
    ledger: dict[str, Any]
    rolled_back_groups: int
    in_flight: dict[str, dict[str, Any]]
    shortfall: dict[str, int]
    skipped_prompts: int
    mutation_version: int
    mode: Literal["authoritative", "shadow"]
    replacement_reserve: dict[str, Any] | list[Any] = field(default_factory=list)
    """``ReplacementReserve.state_dict()`` (``[]``: written before the reserve existed, or no reserve)."""
    validation: dict[str, Any] = field(default_factory=dict)
    """``{"pending": [versions]}``: validations started whose results the trainer had not logged (redone)."""
    schema_version: int = STATE_SCHEMA

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ControllerState:
        if data.get("schema_version") != STATE_SCHEMA:
            raise ValueError(
                f"controller state schema {data.get('schema_version')!r} is not {STATE_SCHEMA}: this checkpoint "
                "was written by another screl version; resume it with that version or start afresh"
            )
        required = {n for n, f in cls.__dataclass_fields__.items() if f.default is MISSING
                    and f.default_factory is MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"controller state lacks {missing}: the checkpoint is corrupt")
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})
