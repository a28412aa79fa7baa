"""``screl``: the one composition root.

* ``screl fit --config X.yaml`` trains (LightningCLI's fit);
* ``screl check --config X.yaml`` parses and validates the whole config without starting anything
  and prints the capacity plan;
* ``screl events check RUN_DIR`` audits a run's ``events.jsonl``.

The spec's top-level blocks (``grpo``/``ppo``, ``async_rl``, ``data_plane``, ``checkpointing``,
``rollout_checkpointing``, ``rollout_recovery``, ``token_capture``, ``ray``) sit beside
``trainer``/``model``/``data``; they are linked into the DataModule (``data.init_args.run``) and the
algorithm block into the model (``model.init_args.algo``), so nothing is written twice.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from jsonargparse import Namespace, set_parsing_settings

from screl.config import (
    SHADOW_MODE_NOTE,
    AsyncRLConfig,
    CheckpointingConfig,
    DataPlaneConfig,
    GenerationConfig,
    GRPOConfig,
    PPOConfig,
    RayConfig,
    RolloutCheckpointingConfig,
    RolloutRecoveryConfig,
    RunConfig,
    TokenCaptureConfig,
    from_dict,
)
from screl.config_distill import distill_plan_name
from screl.rules import ConfigError, config_problems
from screl.threads import ThreadPlan, thread_plan

set_parsing_settings(docstring_parse_attribute_docstrings=True)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")

from lightning.pytorch import LightningDataModule, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from typing_extensions import override  # noqa: E402

#: Top-level blocks and their types (None default = optional block).
TOP_LEVEL_BLOCKS: dict[str, type] = {
    "async_rl": AsyncRLConfig,
    "data_plane": DataPlaneConfig,
    "checkpointing": CheckpointingConfig,
    "rollout_checkpointing": RolloutCheckpointingConfig,
    "rollout_recovery": RolloutRecoveryConfig,
    "token_capture": TokenCaptureConfig,
    "ray": RayConfig,
}


def _plain(value: Any) -> Any:
    if isinstance(value, Namespace):
        return {k: _plain(v) for k, v in vars(value).items() if k != "__path__"}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _algo_block(value: Any) -> dict[str, Any] | None:
    """A parsed ``grpo``/``ppo`` value as a plain dict (jsonargparse wraps optional dataclasses)."""
    plain = _plain(value)
    if isinstance(plain, dict) and "init_args" in plain and "class_path" in plain:
        plain = plain["init_args"]
    return plain  # type: ignore[no-any-return]


def build_run_config(
    grpo: Any, ppo: Any, async_rl: Any, data_plane: Any, checkpointing: Any, rollout_checkpointing: Any,
    rollout_recovery: Any, token_capture: Any, ray: Any,
) -> dict[str, Any]:
    """The ``data.init_args.run`` mapping linked from the top-level blocks (a plain dict, so it serializes)."""
    return {
        "grpo": _algo_block(grpo),
        "ppo": _algo_block(ppo),
        "async_rl": _plain(async_rl),
        "data_plane": _plain(data_plane),
        "checkpointing": _plain(checkpointing),
        "rollout_checkpointing": _plain(rollout_checkpointing),
        "rollout_recovery": _plain(rollout_recovery),
        "token_capture": _plain(token_capture),
        "ray": _plain(ray),
    }


def _generation_temperature(datamodule: Any) -> float:
    return float(datamodule.generation.temperature)


def _algo_for_model(grpo: Any, ppo: Any, checkpointing: Any) -> dict[str, Any] | None:
    """The module's ``algo``: the algorithm block; a PPO warm start reads with the checkpoints' fsspec options
    unless it names its own."""
    if ppo is None:
        return _algo_block(grpo)
    algo = _algo_block(ppo)
    if isinstance(algo, dict) and not algo.get("warm_start_storage_options"):
        algo["warm_start_storage_options"] = dict((_plain(checkpointing) or {}).get("storage_options") or {})
    return algo


class ScrelCLI(LightningCLI):
    """LightningCLI with screl's top-level blocks, validation before any work, and WeightSync injected."""

    def __init__(self, *args: Any, check_only: bool = False, **kwargs: Any) -> None:
        self.check_only = check_only
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("trainer_defaults", {"max_epochs": 1, "num_sanity_val_steps": 0})
        kwargs.setdefault("parser_kwargs", {"default_env": False})
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(LightningModule, LightningDataModule, *args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--grpo", type=GRPOConfig | None, default=None, help="GRPO step settings.")
        parser.add_argument("--ppo", type=PPOConfig | None, default=None, help="PPO step settings.")
        for key, cls in TOP_LEVEL_BLOCKS.items():
            parser.add_class_arguments(cls, key, instantiate=False)
        parser.link_arguments(
            ("grpo", "ppo", *TOP_LEVEL_BLOCKS), "data.init_args.run", compute_fn=build_run_config
        )
        parser.link_arguments(("grpo", "ppo", "checkpointing"), "model.init_args.algo", compute_fn=_algo_for_model)
        # from the built DataModule: a parse-time link cannot reach into the subclass-mode `data` (it silently left
        # the model at temperature 1.0, so every logprob the trainer recomputed disagreed with the engine's)
        parser.link_arguments("data", "model.init_args.temperature", compute_fn=_generation_temperature,
                              apply_on="instantiate")

    # -- validation before anything starts ---------------------------------------------------------
    @override
    def _set_seed(self) -> None:
        """Lightning seeds numpy too, which takes [0, 2**32 - 1]: refuse another seed naming the key, before
        ``seed_everything`` fails inside numpy."""
        seed = self._get(self.config, "seed_everything")
        if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed <= 2**32 - 1:
            from screl.rules import Problem

            raise ConfigError([Problem("seed_everything", seed, "numpy's seed range is [0, 4294967295]",
                                       "pick a seed in that range, or true for a random one")])
        super()._set_seed()

    def current_config(self) -> Namespace:
        cfg = self.config
        if self.subcommand is not None and self.subcommand in cfg:
            cfg = cfg[self.subcommand]
        return cfg  # type: ignore[no-any-return]

    def config_dict(self) -> dict[str, Any]:
        return _plain(self.current_config())  # type: ignore[no-any-return]

    @override
    def before_instantiate_classes(self) -> None:
        from screl.rules.shapes import shape_problems

        blocks = {**TOP_LEVEL_BLOCKS, "grpo": GRPOConfig, "ppo": PPOConfig, "trainer": None, "model": None, "data": None}
        problems = shape_problems(self.config_dict(), blocks) or config_problems(self.config_dict())
        if problems:
            raise ConfigError(problems)
        if not self.check_only:  # before the Trainer (and CUDA) starts: the trainer sees only its GPUs
            from screl.placement_env import apply_trainer_devices
            from screl.rules import Problem

            placed = apply_trainer_devices(self.config_dict())
            if placed.problems:
                raise ConfigError([Problem(*p) for p in placed.problems])

    @override
    def instantiate_classes(self) -> None:
        if self.check_only:
            return
        super().instantiate_classes()

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        if trainer_cfg.get("logger") in (None, True) and "logger" not in kwargs:
            from lightning.pytorch.loggers import CSVLogger

            root = trainer_cfg.get("default_root_dir") or os.getcwd()
            kwargs["logger"] = CSVLogger(save_dir=root, name="lightning_logs")
        trainer = super().instantiate_trainer(**kwargs)
        from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
        from lightning.pytorch.callbacks import RichModelSummary

        from screl.callbacks import DataPlaneCheckpoint, ModelSummary, WeightSync

        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        for i, cb in enumerate(callbacks):  # Lightning's own summary prints 'Total FLOPs: 0' for every run
            if type(cb) in (LightningModelSummary, RichModelSummary):
                callbacks[i] = ModelSummary(max_depth=cb._max_depth)
        _count_rl_steps(callbacks, trainer_cfg)
        if not any(isinstance(cb, WeightSync) for cb in callbacks):
            callbacks.append(WeightSync())
        run = getattr(self.datamodule, "run", None)
        if isinstance(run, RunConfig) and run.checkpointing.enabled:
            if not any(isinstance(cb, DataPlaneCheckpoint) for cb in callbacks):
                callbacks.append(DataPlaneCheckpoint(run.checkpointing))
        return trainer

    def before_fit(self) -> None:
        """With ``checkpointing.enabled`` and a bundle in ``checkpoint_dir``: resume from it."""
        run = getattr(self.datamodule, "run", None)
        if not (isinstance(run, RunConfig) and run.checkpointing.enabled):
            return
        from screl.checkpoint.resume import fetch_resume

        fit_cfg = self.config_init[self.subcommand]
        if fit_cfg.get("ckpt_path"):
            raise ValueError(
                "ckpt_path restores the model only: with checkpointing.enabled, screl resumes the whole run "
                "(model, optimizer, data plane, controller) from checkpointing.checkpoint_dir. Drop --ckpt_path."
            )
        self.datamodule.config_dict = self.config_dict()
        ck, rc = run.checkpointing, run.rollout_checkpointing
        # every training process fetches its own copy (ranks need not share a disk); rank 0 also the rollout side
        rank = os.environ.get("RANK") or f"{os.environ.get('NODE_RANK', '0')}_{os.environ.get('LOCAL_RANK', '0')}"
        local_root = os.path.join(self.trainer.default_root_dir, ".screl_restore", f"rank_{rank}")
        resume = fetch_resume(
            str(ck.checkpoint_dir), local_root, restore_mode=rc.restore_mode,
            snapshots_enabled=rc.snapshot_attempt_interval_s is not None, config=self.config_dict(),
            extra_excluded_paths=list(rc.extra_fingerprint_excluded_paths), storage_options=ck.storage_options,
            rollout_side=rank in ("0", "0_0"),
        )
        if resume is not None and not resume.optimizer_saved and not ck.resume_without_optimizer:
            raise ValueError(
                f"{resume.source_url} was written with checkpointing.save_optimizer: false: it has no optimizer "
                "state, and resuming would restart AdamW's moments from zero. Set "
                "checkpointing.resume_without_optimizer: true to accept that, or resume from a bundle with it. "
                "Nothing was modified.")
        if resume is not None:
            self.datamodule.resume = resume
            if resume.ckpt_path is not None:
                fit_cfg["ckpt_path"] = resume.ckpt_path
                fit_cfg["weights_only"] = True  # tensors and plain containers only: a bundle runs no code
            print(f"screl: resuming from {resume.source_url} (step {resume.step})", file=sys.stderr)


def _count_rl_steps(callbacks: list[Any], trainer_cfg: Any) -> None:
    """Swap Lightning's default progress bar (no total: ``Epoch 0/0 12/--``) for one over RL steps, unless the
    config names a progress bar of its own."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from screl.callbacks import rl_progress_bar

    if "ProgressBar" in str(trainer_cfg.get("callbacks") or ""):
        return
    for i, cb in enumerate(callbacks):
        if type(cb) in (RichProgressBar, TQDMProgressBar):
            callbacks[i] = rl_progress_bar()
            return


def _generation_line(cfg: dict[str, Any]) -> str:
    from screl.controller.resources import worker_resources

    g = from_dict(GenerationConfig, cfg["data"]["init_args"].get("generation") or {})
    if g.colocated.enabled:
        return (f"colocated: one {g.backend} engine in the trainer's process, decoding with the trainer's module on "
                "its device (no worker process, no weight copy); a refit is a version bump")
    res = worker_resources(g)
    custom = "".join(f" + {v:g} {k}" for k, v in res.custom.items())
    where = " (only on nodes offering " + ", ".join(res.custom) + ")" if res.custom else ""
    return (f"{g.num_workers} worker(s), backend {g.backend} on {g.device}, {res.num_cpus:g} CPU / {res.num_gpus:g} "
            f"GPU{custom} each{where}; refits in {g.refit_bucket_mb:g} MiB buckets")


def _devices_line(cfg: dict[str, Any]) -> str:
    """The device map (:mod:`screl.placement`): per node the trainer's, the inference and the left-over GPUs."""
    from screl.placement import device_map

    return device_map(cfg).describe()


def _refit_line(cfg: dict[str, Any], run: RunConfig) -> str:
    """How a refit meets in-flight requests, and the per-request deadlines (the plan's ``refit`` line)."""
    from screl.rollout.backends import engine_capabilities, engine_title

    g = from_dict(GenerationConfig, cfg["data"]["init_args"].get("generation") or {})
    a = run.async_rl
    if g.colocated.enabled:
        how = ("colocated: the engine stands down for each train step (KV caches freed); " +
               ("the requests in flight finish first (drain gate)" if not a.in_flight_weight_updates else
                "requests in flight across it re-prefill under the new weights at the wake"))
    elif not a.in_flight_weight_updates:
        how = ("drain gate: each refit waits for the in-flight requests to finish under the old weights, so no "
               "sample spans two versions; generation runs dry for the longest request at every step")
    elif a.recompute_kv_cache_after_weight_updates:
        how = "in flight: requests continue under the new weights, their KV cache recomputed"
    else:
        how = "in flight: requests continue under the new weights on their old KV cache"
    limits = [f"{k} {v:g} s" for k, v in (("generation", g.generation_timeout_s), ("rollout", g.rollout_timeout_s))
              if v is not None]
    paused = "stood-down and paused time excluded" if g.colocated.enabled else "paused time excluded"
    line = how + ("; deadlines: " + ", ".join(limits) + f" ({paused})" if limits else "")
    if g.min_new_tokens > 0 and engine_capabilities(g.backend).eos_masked_logprobs:
        line += (f"; note: the {engine_title(g.backend)} engine's logprobs of the first {g.min_new_tokens} tokens are "
                 "of the EOS-masked distribution, the trainer's are not (train/logprob_mismatch shows the gap; "
                 "min_new_tokens: 0 avoids it)")
    return line


def _correction_line(loss_args: dict[str, Any]) -> str:
    """How the loss corrects for stale rollouts (the plan's ``IS correction`` line)."""
    if loss_args.get("proximal_policy") == "behaviour":
        return "off (naive PPO: the ratio is clipped against the behaviour policy)"
    if not loss_args.get("use_importance_sampling_correction", False):
        return "off"
    level, trunc = loss_args.get("is_level", "token"), loss_args.get("is_truncation")
    bound = "untruncated" if trunc is None else f"{loss_args.get('is_mode', 'truncate')} at {trunc}"
    return f"on ({level} level, {bound}; decoupled PPO against the trainer's policy)"


def _thread_plan(cfg: dict[str, Any], run: RunConfig) -> ThreadPlan:
    data = cfg["data"]["init_args"]
    generation = from_dict(GenerationConfig, data.get("generation") or {})
    return thread_plan(generation, run, data.get("train_num_threads"))


def capacity_plan(cfg: dict[str, Any]) -> str:
    """The human summary ``screl check`` prints for a valid config."""
    run = RunConfig.from_dict(cfg["data"]["init_args"]["run"])
    sampler = run.sampler
    algo_name = run.algorithm.title
    distill = (cfg.get("model") or {}).get("init_args", {}).get("distillation") if isinstance(cfg.get("model"), dict) else None
    if isinstance(distill, dict):  # screl.Distill: GRPO's step, the teachers' objective (docs/distillation.md)
        algo_name = distill_plan_name(distill)
    knobs = {k: v for k, v in vars(sampler).items() if k != "name"}
    loss = (cfg.get("model") or {}).get("init_args", {}).get("loss_fn") or {}
    loss_args = loss.get("init_args", loss) if isinstance(loss, dict) else {}
    steps = run.algo.max_num_steps
    staleness = run.sampler_rules.describe()
    chunks = -(-run.groups_per_step // run.min_groups)
    ck = run.checkpointing
    lines = [
        f"algorithm            {algo_name}",
        f"groups per step      {run.groups_per_step}  (num_prompts_per_step)",
        f"rows per step        {run.rows_per_step}  ({run.groups_per_step} x {run.algo.num_generations_per_prompt}"
        " generations)",
        f"sampler              {sampler.name} {knobs}",
        f"lookahead/staleness  {staleness}",
        f"buffer capacity      required {run.required_capacity}, configured {run.max_buffered_rollouts} groups"
        + (" (max_buffered_rollouts)" if run.async_rl.max_buffered_rollouts is not None else
           " (default: room for the in-flight bound; set max_buffered_rollouts to change it)"),
        f"in-flight bound      {run.max_inflight_prompts} prompt groups (max_inflight_prompts)",
        f"streaming            >= {run.min_groups} groups per chunk, up to {chunks} chunk(s) per step",
        f"IS correction        {_correction_line(loss_args)}",
        f"max steps            {steps if steps is not None else 'epochs x batches / trainer.max_steps'}",
        f"checkpointing        {'on -> ' + str(ck.checkpoint_dir) if ck.enabled else 'off'}"
        + (f"; SHADOW MODE: {run.sampler.name} sampler {SHADOW_MODE_NOTE}"
           if ck.enabled and run.shadow_checkpoints else ""),
        f"torch threads        {_thread_plan(cfg, run).describe()}",
        f"generation           {_generation_line(cfg)}",
        f"devices              {_devices_line(cfg)}",
        f"refit                {_refit_line(cfg, run)}",
        f"dropped groups       {_drops_line(run)}",
        f"recovery             {_recovery_line(run)}",
        f"validation           {_validation_line(run)}",
        f"trainer memory       {trainer_memory_line(cfg)}",
    ]
    return "\n".join(lines)


def trainer_memory_line(cfg: dict[str, Any]) -> str:
    """The plan's estimate of one training process's peak memory (:func:`screl.modules.memory_plan.config_estimate`),
    from the policy's config (no weights are loaded)."""
    from screl.modules.memory_plan import config_estimate

    estimate, note = config_estimate(cfg)
    return note if estimate is None else estimate.describe() + note


def _validation_line(run: RunConfig) -> str:
    a, v = run.algo, run.algo.validation
    when = [w for w, on in (("the initial weights", a.val_at_start), (f"every {a.val_period} steps", a.val_period),
                            ("the final weights", a.val_at_end)) if on]
    if not when:
        return "off"
    how = "greedy" if v.temperature == 0 else f"temperature {v.temperature:g}"
    return (f"{', '.join(when)}: {v.num_samples} sample(s) per held-out prompt, {how}, pass at reward >= "
            f"{v.pass_threshold:g}; the next refit waits for it")


def _recovery_line(run: RunConfig) -> str:
    """What a failed, abandoned or restarted sibling costs its group (``token_capture``, ``rollout_recovery``)."""
    if not run.token_capture.enabled:
        return ("token capture off: a failed or restarted sibling regenerates its whole group (prompt_group); no "
                "finished generation is kept")
    rr = run.rollout_recovery
    overrides = len(rr.task_source_granularity_overrides) + len(rr.agent_granularity_overrides)
    what = {"sibling": "finished siblings are kept, only unfinished ones are generated again",
            "prompt_group": "a group with an unfinished sibling is generated again whole"}[rr.default_granularity]
    return f"token capture on: {rr.default_granularity} ({what})" + (f"; {overrides} override(s)" if overrides else "")


def _drops_line(run: RunConfig) -> str:
    """What happens to a group that is dropped (after its retries) or filtered (dynamic sampling)."""
    f = run.async_rl.rollout_failure
    what = "zero-variance groups filtered (dynamic sampling); " if run.algo.use_dynamic_sampling else ""
    if f.on_dropped_prompt == "replace":
        return (f"{what}slots refilled from a reserve of >= {f.replacement_reserve_prompts} spare prompts (whole "
                f"batches of {run.groups_per_step} held back), <= {f.max_replacement_attempts} per slot")
    floor = (f">= {f.min_step_batch_fraction:g} of a step" if run.algorithm.step_may_shrink
             else f"never ({run.algorithm.title} trains full steps)")
    return f"{what}the step shrinks, {floor}"


def check(argv: Sequence[str]) -> int:
    """``screl check --config X.yaml``: validate everything, start nothing, print the capacity plan."""
    try:
        cli = ScrelCLI(args=list(argv), run=False, check_only=True)
    except ConfigError as err:
        print(f"screl check: {err}", file=sys.stderr)
        return 2
    print("screl check: the config is valid\n")
    print(capacity_plan(cli.config_dict()))
    return 0


USAGE = """screl: asynchronous single-controller RL post-training (GRPO, PPO) on PyTorch Lightning

  screl fit --config X.yaml        train (LightningCLI fit; `screl fit --help` lists every knob,
                                   `screl fit --grpo.help GRPOConfig` the step settings)
  screl check --config X.yaml      validate the whole config, start nothing, print the capacity plan
  screl events check RUN_DIR       audit a run's events.jsonl (sampler rules, no group trained twice,
                                   every prompt accounted for)
  screl plot RUN_DIR [RUN_DIR ...]  PNG charts of runs (reward, staleness, IS weights, buffer, timeline)
  screl fit ... --verbose          also Ray's logs and the workers' output (quiet by default)

LightningCLI's own help follows.
"""


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("💡 Tip:")


def quiet_third_party() -> None:
    """Drop Lightning's product tips, the pytree deprecation warning its own code triggers on every run and
    transformers' weight-loading bars (none is about the user's config); show screl's start-up lines."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_NoTips())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    lines = logging.getLogger("screl.startup")
    if not lines.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        lines.addHandler(handler)
        lines.setLevel(logging.INFO)
        lines.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        try:
            ScrelCLI(args=["--help"])
        except SystemExit as exit_:
            return int(exit_.code or 0)
        return 0
    if args and args[0] == "check":
        return check(args[1:])
    if args and args[0] == "plot":
        from screl.plot import main as plot_main

        return plot_main(args[1:])
    if args and args[0] == "events":
        from screl.data.event_check_cli import main as events_main

        return int(events_main(args[1:]) or 0)
    if "--verbose" in args:  # Ray's and the workers' own output too
        args.remove("--verbose")
        os.environ["SCREL_VERBOSE"] = "1"
    quiet_third_party()
    try:
        ScrelCLI(args=args)
    except ConfigError as err:
        print(f"screl: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
