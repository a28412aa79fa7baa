"""Typed config blocks of a screl run, with the knob names of the single-controller spec.

Each block is a dataclass whose attribute docstrings become ``screl fit --help`` text. Top-level
blocks (``grpo``/``ppo``, ``async_rl``, ``data_plane``, ``checkpointing``, ``rollout_checkpointing``,
``rollout_recovery``, ``token_capture``) sit beside Lightning's ``trainer``/``model``/``data`` in
the YAML; ``RunConfig`` bundles them for the DataModule and the controller. Cross-block rules live
in ``screl.rules``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from screl.algorithms import Algorithm, algorithm_of_run
from screl.config_algo import (
    AdvantageEstimatorConfig,
    GRPOConfig,
    PPOConfig,
    RewardScalingConfig,
    RewardShapingConfig,
    ValidationConfig,
)
from screl.config_generation import ColocatedConfig, GenerationConfig
from screl.data.sampler_api import StalenessSampler
from screl.data.sampler_config import (
    CustomSamplerConfig,
    InOrderSamplerConfig,
    ReadyFirstSamplerConfig,
    SamplerConfig,
    WeightFifoSamplerConfig,
    WindowedSamplerConfig,
    parse_sampler_config,
)
from screl.data.sampler_factory import declared_capabilities, required_buffer_capacity, sampler_rules
from screl.data.watchdog import WatchdogConfig

__all__ = [
    "AdvantageEstimatorConfig",
    "AsyncRLConfig",
    "CheckpointingConfig",
    "ColocatedConfig",
    "CustomSamplerConfig",
    "DataPlaneConfig",
    "GRPOConfig",
    "GenerationConfig",
    "InOrderSamplerConfig",
    "PPOConfig",
    "RayConfig",
    "ReadyFirstSamplerConfig",
    "RewardScalingConfig",
    "RewardShapingConfig",
    "RolloutCheckpointingConfig",
    "RolloutFailureConfig",
    "RolloutRecoveryConfig",
    "RunConfig",
    "ValidationConfig",
    "SamplerConfig",
    "TokenCaptureConfig",
    "WeightFifoSamplerConfig",
    "WindowedSamplerConfig",
    "parse_sampler_config",
    "required_buffer_capacity",
]

Granularity = Literal["sibling", "prompt_group"]

T = TypeVar("T")


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass in a field type (``X``, ``X | None``), if any."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                return arg
    return None


def from_dict(cls: type[T], data: Mapping[str, Any] | T | None) -> T:
    """Build dataclass ``cls`` from a (nested) mapping; unknown keys are an error naming them."""
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; known keys are {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = _dataclass_in(hints[key])
        kwargs[key] = from_dict(sub, value) if sub is not None and isinstance(value, Mapping) else value
    return cls(**kwargs)


@dataclass
class RolloutFailureConfig:
    """Retry and drop budgets for failed rollouts."""

    max_infra_attempts: int = 5
    """Attempts per prompt when generation infrastructure fails (worker died, timeout)."""
    max_data_attempts: int = 2
    """Attempts per prompt when the rollout itself fails (reward function raised, bad output)."""
    backoff_base_s: float = 1.0
    """First retry delay; doubles per attempt."""
    max_backoff_s: float = 30.0
    """Cap on the retry delay; >= backoff_base_s."""
    max_skipped_prompts: int = 0
    """Prompts the run may drop after exhausting data attempts (0 = a failure stops the run)."""
    max_consecutive_dropped_prompts: int = 0
    """Consecutive prompts that may be dropped after exhausting infra attempts (0 = stop the run)."""
    min_step_batch_fraction: float = 0.9
    """A step shortened by drops must keep at least this fraction of its groups, in (0, 1]."""
    on_dropped_prompt: Literal["shrink", "replace"] = "shrink"
    """``shrink`` trains a shorter step; ``replace`` fills the slot from a reserve of spare prompts."""
    max_replacement_attempts: int = 1
    """(replace) Spares tried per dropped slot."""
    replacement_reserve_prompts: int = 1
    """(replace) Spare prompts held back for replacement."""


@dataclass
class AsyncRLConfig:
    """Single-controller async knobs: the staleness sampler and the rollout pump's bounds."""

    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "in_order", "max_lookahead_versions": 1})
    """Staleness sampler, as a mapping chosen by ``name`` (each mode takes only its own knobs):
    ``in_order`` {max_lookahead_versions: 1, warmup_lookahead_versions: null};
    ``weight_fifo`` {max_staleness_versions: 1}; ``ready_first`` {max_staleness_versions: 1};
    ``windowed`` {max_staleness_versions: 1, sample_freshest_first: false, over_sampling_ratio: null};
    ``custom`` {target: "module:ClassName", ...extra keys passed as kwargs}."""
    min_groups_for_streaming_train: int | None = None
    """Ready groups the trainer waits for before training a chunk (None: num_prompts_per_step, one chunk/step)."""
    max_inflight_prompts: int | None = None
    """Concurrent prompt groups in generation (None: num_prompts_per_step x (window + 1))."""
    max_buffered_rollouts: int | None = None
    """Hard cap on groups holding data-plane room, in flight, ready or claimed (None: the larger of the sampler's
    required capacity and ``max_inflight_prompts``, so dispatch can run as far ahead as the in-flight bound allows)."""
    recompute_kv_cache_after_weight_updates: bool = False
    """After a refit, recompute the KV cache of in-flight requests with the new weights."""
    in_flight_weight_updates: bool = True
    """True: a refit updates the weights under in-flight requests (their later tokens carry the new version).
    False (the drain gate): a refit waits for in-flight requests to finish, so no sample spans two versions."""
    rollout_failure: RolloutFailureConfig = field(default_factory=RolloutFailureConfig)
    """Retry and drop budgets."""
    event_log: bool = True
    """Append every admit/reserve/commit/select/... to ``events.jsonl`` in the run directory."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Fail a run whose rollout side stops committing groups (``stall_timeout_s``)."""


@dataclass
class DataPlaneConfig:
    """The TransferQueue data plane that holds rollout rows between the pumps."""

    enabled: bool = True
    """Required: the single controller always moves rollouts through TransferQueue."""
    backend: Literal["simple", "mooncake_cpu"] = "simple"
    """Storage backend: ``simple`` (``mooncake_cpu`` is the spec's name for TransferQueue's Mooncake storage, which
    screl does not wire in yet: ``screl check`` refuses it rather than fall back to ``simple`` silently)."""
    num_storage_units: int = 1
    """TransferQueue storage unit actors."""
    storage_node_resource: str | None = None
    """Place the storage units only on nodes that offer this custom Ray resource (e.g. ``head_node`` given to
    ``ray start --head --resources``). None: TransferQueue spreads them over every live node, generation nodes
    included, so losing such a node loses the rows it held (docs/scaling.md)."""
    partition_id: str = "train"
    """Partition rollout rows are written to."""


SHADOW_MODE_NOTE = ("does not declare supports_buffer_checkpoint = True: bundles keep the data-plane snapshot but "
                    "no replay index, and a resume restores no buffered or unfinished group (their prompts are "
                    "skipped this epoch)")
"""What shadow-mode checkpoints keep and lose (``RunConfig.shadow_checkpoints``), for ``screl check`` and the log."""


@dataclass
class CheckpointingConfig:
    """Trainer checkpoint bundles (model, optimizer, controller state, data plane)."""

    enabled: bool = False
    """Write checkpoint bundles and resume from the latest one."""
    checkpoint_dir: str | None = None
    """Local path, ``s3://bucket/prefix`` or a shared filesystem path."""
    save_period: int = 10
    """Save every N RL steps (and at the last step)."""
    save_data_plane: bool = True
    """Include the TransferQueue snapshot and replay index so buffered rollouts survive a restart."""
    keep_top_k: int | None = 3
    """Keep K bundles (None: keep all): the newest K, or with ``metric_name`` the best K plus the newest."""
    save_optimizer: bool = True
    """Include the optimizer's state (AdamW's moments: twice the weights). False keeps its hyperparameters only:
    a resume then starts the moments from zero, and refuses to unless ``resume_without_optimizer``."""
    resume_without_optimizer: bool = False
    """Resume from a bundle written with ``save_optimizer: false`` (the optimizer's moments start from zero)."""
    metric_name: str | None = None
    """Rank bundles by a training metric for ``keep_top_k``: ``train:<metric>``, the step's logged value of
    ``<metric>`` (``train:reward``) or of ``train/<metric>`` (``train:loss``), recorded in each bundle's manifest.
    A save whose step did not log it fails, naming the keys it did log. None: keep the newest."""
    higher_is_better: bool = True
    """With ``metric_name``: a larger value is better (false for a loss)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for ``checkpoint_dir`` (e.g. ``{client_kwargs: {endpoint_url: http://...}}`` for S3)."""


@dataclass
class RolloutCheckpointingConfig:
    """Periodic rollout snapshots between trainer checkpoints."""

    snapshot_attempt_interval_s: float | None = None
    """Attempt a snapshot this often (None: off). An attempt after step N needs step_N durable."""
    keep_latest_k: int = 2
    """Published snapshots kept per anchor."""
    restore_mode: Literal["latest", "trainer_checkpoint"] = "latest"
    """``latest``: newest compatible snapshot; ``trainer_checkpoint``: ignore snapshots, use the bundle."""
    extra_fingerprint_excluded_paths: list[str] = field(default_factory=list)
    """Dotpaths left out of the bootstrap fingerprint (``*`` one level, ``**`` any levels)."""
    max_consecutive_failures: int = 3
    """Abort the run after this many consecutive failed snapshot attempts."""


@dataclass
class RolloutRecoveryConfig:
    """What happens to unfinished prompt groups on failure and restart."""

    default_granularity: Granularity = "sibling"
    """``sibling``: keep sealed siblings, regenerate unfinished ones; ``prompt_group``: regenerate the group."""
    task_source_granularity_overrides: dict[str, Granularity] = field(default_factory=dict)
    """Granularity by the rollout row's task source."""
    agent_granularity_overrides: dict[str, Granularity] = field(default_factory=dict)
    """Granularity by agent name; wins over a task-source override."""


@dataclass
class TokenCaptureConfig:
    """Token-level capture of generations (per-sibling staging for recovery)."""

    enabled: bool = True
    """Stage each finished generation (its tokens and row, kept in the data plane under its attempt) so recovery can
    reuse it: after a failed or restarted sibling only the unfinished ones are generated again
    (``rollout_recovery.default_granularity: sibling``). ``false``: no finished generation outlives its group's
    failure: a data failure, an abandonment or a restart regenerates the whole group from the weights live at
    redispatch (``prompt_group`` for every group); non-default granularities and periodic snapshots need ``true``."""


@dataclass
class RayConfig:
    """Where Ray runs."""

    address: str | None = None
    """Join an existing cluster (``ray://`` or ``host:port``); None starts a local one on loopback."""
    num_cpus: int = 6
    """Logical CPUs of a local cluster (TransferQueue needs at least 3)."""
    namespace: str = "screl"
    """Ray namespace for screl's actors."""


@dataclass
class RunConfig:
    """Everything the rollout side needs, assembled by the CLI from the top-level blocks."""

    grpo: GRPOConfig | None = None
    ppo: PPOConfig | None = None
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    rollout_checkpointing: RolloutCheckpointingConfig = field(default_factory=RolloutCheckpointingConfig)
    rollout_recovery: RolloutRecoveryConfig = field(default_factory=RolloutRecoveryConfig)
    token_capture: TokenCaptureConfig = field(default_factory=TokenCaptureConfig)

    ray: RayConfig = field(default_factory=RayConfig)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | RunConfig | None) -> RunConfig:
        """Build from the plain mapping the CLI links into ``data.init_args.run``."""
        return from_dict(cls, data)

    @property
    def algorithm(self) -> Algorithm:
        """The registered algorithm whose block this run sets (its step rules: ``screl.algorithms``)."""
        return algorithm_of_run(self)

    @property
    def algo(self) -> GRPOConfig:
        """The step settings of whichever algorithm block is present."""
        block: GRPOConfig | None = getattr(self, self.algorithm.config_key)
        if block is None:
            raise ValueError("neither `grpo` nor `ppo` is set: add exactly one algorithm block")
        return block

    @property
    def sampler(self) -> SamplerConfig:
        return parse_sampler_config(self.async_rl.sampler)

    @property
    def groups_per_step(self) -> int:
        return self.algo.num_prompts_per_step

    @property
    def rows_per_step(self) -> int:
        return self.algo.num_prompts_per_step * self.algo.num_generations_per_prompt

    @property
    def min_groups(self) -> int:
        m = self.async_rl.min_groups_for_streaming_train
        return self.groups_per_step if m is None else m

    @property
    def sampler_rules(self) -> StalenessSampler:
        """The configured sampler's rule hooks (capacity, in-flight bound, IS need, thread hint, description)."""
        return sampler_rules(self.sampler, self.groups_per_step)

    @property
    def shadow_checkpoints(self) -> bool:
        """Checkpoints cannot restore buffered groups: a custom sampler that does not declare
        ``supports_buffer_checkpoint = True`` on its own class (bundles are written in shadow mode: the
        data-plane snapshot kept, no authoritative replay index; a resume restores no buffered or unfinished
        group, and their prompts are skipped this epoch)."""
        return not declared_capabilities(self.sampler)[0]

    @property
    def required_capacity(self) -> int:
        return required_buffer_capacity(self.sampler, self.groups_per_step, self.min_groups)

    @property
    def max_buffered_rollouts(self) -> int:
        """``async_rl.max_buffered_rollouts``, or by default room for everything the in-flight bound lets generate
        (and never below the sampler's required capacity): the buffer counts in-flight groups too, so a default of
        the bare minimum (one streaming chunk for ``windowed``) would gate a sampler whose dispatch is ungated."""
        m = self.async_rl.max_buffered_rollouts
        return max(self.required_capacity, self.max_inflight_prompts) if m is None else m

    @property
    def max_inflight_prompts(self) -> int:
        m = self.async_rl.max_inflight_prompts
        return sampler_rules(self.sampler, self.groups_per_step).inflight_bound(self.groups_per_step) if m is None else m
