"""The algorithm blocks of a run (``grpo`` or ``ppo``): step sizes, advantages, reward shaping and scaling,
validation during training. Plain dataclasses whose attribute docstrings become ``screl fit --help`` text;
``screl.config.RunConfig`` holds whichever block the run sets, and ``screl.algorithms`` says which algorithm
owns it: GRPO and PPO register there beside their blocks (their LightningModules by class path, imported only
when a model is built)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from screl.algorithms import Algorithm, register_algorithm

__all__ = [
    "AdvantageEstimatorConfig",
    "GRPOConfig",
    "PPOConfig",
    "RewardScalingConfig",
    "RewardShapingConfig",
    "ValidationConfig",
]


@dataclass
class AdvantageEstimatorConfig:
    """How advantages are computed from rewards (GRPO) or values (PPO)."""

    name: str = "grpo"
    """A registered estimator (``screl.algos.register_adv_estimator``): ``grpo`` (group-relative, std-normalized),
    ``rloo`` (leave-one-out, unnormalized) for GRPO; ``gae`` for PPO (it needs the critic's values)."""
    use_leave_one_out_baseline: bool = True
    """(grpo) Baseline each row with the mean of its siblings excluding itself (else the group mean)."""
    normalize_rewards: bool = True
    """(grpo) Divide advantages by the group's reward standard deviation (zero-variance groups give 0)."""
    std_floor: float = 0.0
    """(grpo) Lower bound on that std (0: none, as upstream). Near-tied leave-one-out siblings give a tiny std;
    a floor of 0.1 bounds each advantage by 10x its reward gap."""
    warn_abs_advantage: float = 10.0
    """Warn (once) when an advantage's magnitude exceeds this; ``train/advantage_abs_max`` logs it every step."""
    gamma: float = 1.0
    """(gae) Discount factor."""
    lam: float = 0.95
    """(gae) GAE lambda."""
    whiten_advantages: bool = True
    """(gae) Whiten the step's advantages over its valid tokens (zero mean, unit variance)."""


@dataclass
class RewardShapingConfig:
    """Reward shaping on the workers, before advantages (see ``screl.rollout.workflows.reward_transform``)."""

    enabled: bool = False
    """Apply the overlong penalty and/or ``class_path``."""
    overlong_buffer_length: int = 0
    """DAPO's soft overlong penalty: its buffer zone in tokens before ``max_response_length`` (0: off)."""
    overlong_penalty_factor: float = 1.0
    """The penalty at ``max_response_length`` (it grows linearly over the buffer zone)."""
    max_response_length: int | None = None
    """``L_max`` of the penalty (None: ``generation.max_new_tokens``)."""
    class_path: str | None = None
    """Your shaping, ``package.module.fn`` with ``fn(reward, response_length, finish_reason) -> float`` (or a
    class built without arguments whose instances are such callables); applied after the overlong penalty."""


@dataclass
class ValidationConfig:
    """How validation during training generates and scores (``val_period``, ``val_at_start``, ``val_at_end``)."""

    num_samples: int = 1
    """Completions per held-out prompt: ``val/pass@k`` is reported for k = 1 and k = num_samples."""
    temperature: float = 0.0
    """0 is greedy (then num_samples must be 1)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    max_new_tokens: int | None = None
    """Completion length cap (None: ``generation.max_new_tokens``)."""
    pass_threshold: float = 1.0
    """A completion passes when its reward is at least this (what pass@k counts)."""
    max_prompts: int | None = None
    """Validate on the first N held-out prompts only (None: all of them)."""


@dataclass
class RewardScalingConfig:
    """Clip rewards into ``[source_min, source_max]`` and map that range linearly onto ``[target_min, target_max]``."""

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


@dataclass
class GRPOConfig:
    """Step settings of a GRPO run. One RL step = one training batch = one optimizer step."""

    num_prompts_per_step: int = 8
    """Prompt groups per RL step (P)."""
    num_generations_per_prompt: int = 4
    """Rollouts per prompt, the GRPO group size (G). Rows per step = P x G."""
    max_num_epochs: int = 1
    """Passes over the prompt dataset; must be positive (there is no -1 = unbounded convention)."""
    max_num_steps: int | None = None
    """Stop after this many RL steps (None: bounded by epochs x batches and ``trainer.max_steps``)."""
    adv_estimator: AdvantageEstimatorConfig = field(default_factory=AdvantageEstimatorConfig)
    """Advantage estimator (``name: grpo``)."""
    overlong_filtering: bool = False
    """Exclude truncated completions (finish reason ``length``) from the loss through ``sample_mask``; they stay in
    their group's advantage baseline (see docs/async-and-is.md)."""
    val_period: int = 0
    """Validate the weights of every N-th step (0: off) on the held-out prompts (``Task.val_prompts()`` or
    ``data.init_args.val_task``), interleaved with the rollouts (docs/validation-during-training.md)."""
    val_at_start: bool = False
    """Validate the initial weights (version 0) too."""
    val_at_end: bool = False
    """Validate the final weights too."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Sampling and scoring of validation (greedy, one sample per prompt by default)."""
    use_dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards all agree (docs/dynamic-sampling.md)."""
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    """Reward shaping on the workers: DAPO's overlong penalty and/or your function (docs/async-and-is.md)."""
    reward_scaling: RewardScalingConfig = field(default_factory=RewardScalingConfig)
    """Reward scaling after shaping: clip and map into a range."""
    async_grpo: dict[str, Any] | None = None
    """NeMo-RL's async-GRPO block, refused with its migration to ``async_rl`` (the spec's table): must be null."""


@dataclass
class PPOConfig(GRPOConfig):
    """Step settings of a PPO run: ``ppo_epochs`` policy and ``critic_ppo_epochs`` critic updates per step."""

    adv_estimator: AdvantageEstimatorConfig = field(default_factory=lambda: AdvantageEstimatorConfig(name="gae"))
    """Advantage estimator; PPO requires ``name: gae``."""
    ppo_epochs: int = 1
    """Policy passes per RL step over the same batch (>= 1); each pass is ``num_minibatches`` updates."""
    critic_ppo_epochs: int = 1
    """Critic passes per RL step over the same batch (>= 1); each pass is ``num_minibatches`` updates."""
    num_minibatches: int = 1
    """Optimizer updates per epoch (policy and critic alike, >= 1; must divide num_prompts_per_step x
    num_generations_per_prompt). Each epoch shuffles the step's rows (seeded by the run's ``seed_everything``, the
    step and the epoch, so a resumed run repeats it) and takes one update per minibatch of ``rows /
    num_minibatches`` rows, its token-level loss normalized by that minibatch's valid tokens. 1: one unshuffled,
    full-batch update per epoch."""
    policy_training_start_step: int = 0
    """Critic warmup: for the first N steps the policy is neither trained nor refit."""
    warm_start_value_checkpoint: str | None = None
    """Seed the critic from another screl run's checkpoint instead of warming it up online: its checkpoint
    directory (the newest complete bundle is used) or one bundle (``.../step_<n>``), a local path or fsspec URL."""
    warm_start_storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for ``warm_start_value_checkpoint`` (empty: ``checkpointing.storage_options``)."""
    reward_kl_coef: float = 0.0
    """KL in the reward: each completion token's reward gets ``-coef * (log pi_gen - log pi_ref)`` against the
    initial policy (0: off)."""
    async_ppo: dict[str, Any] | None = None
    """NeMo-RL's async-PPO block, refused with its migration to ``async_rl`` (the spec's table): must be null."""
    async_grpo: dict[str, Any] | None = None
    """Not used by PPO; must be null."""


register_algorithm(Algorithm(
    name="grpo", title="GRPO", config_key="grpo", module="screl.modules.grpo.GRPO", block=GRPOConfig,
    step_may_shrink=True, needs_critic=False, default_adv_estimator="grpo", min_generations_per_prompt=2,
    megatron_context_parallel=False,
))
register_algorithm(Algorithm(
    name="ppo", title="PPO", config_key="ppo", module="screl.modules.ppo.PPO", block=PPOConfig,
    step_may_shrink=False, needs_critic=True, default_adv_estimator="gae", samplers=("in_order",),
    rules=("screl.rules.critic_rules:critic_rules",),
    multi_process_strategies=("DDPStrategy", "MegatronStrategy"),
    vision_refusal="PPO's critic (screl.models.ValueModel) reads token ids only: it cannot take {policy}'s images, "
                   "so its values would ignore what the policy sees",
))
