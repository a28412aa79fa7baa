"""``screl``: the one composition root.

* ``screl fit --config X.yaml`` trains (LightningCLI's fit);
* ``screl check --config X.yaml`` parses and validates the whole config without starting anything
  and prints the capacity plan;
* ``screl events check RUN_DIR`` audits a run's ``events.jsonl``.

The spec's top-level blocks (the registered algorithms' ``grpo``/``ppo``, ``async_rl``, ``data_plane``, ``checkpointing``,
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

from screl.prestart import cli_command, prestart_for_command

prestart_for_command(sys.argv)  # `screl fit`: Ray comes up while the driver imports Lightning and parses its config

from jsonargparse import Namespace, set_parsing_settings  # noqa: E402

from screl.algorithms import algorithm_of_run, run_blocks  # noqa: E402
from screl.config import (  # noqa: E402
    AsyncRLConfig,
    CheckpointingConfig,
    DataPlaneConfig,
    RayConfig,
    RolloutCheckpointingConfig,
    RolloutRecoveryConfig,
    RunConfig,
    TokenCaptureConfig,
)
from screl.plan import capacity_plan  # noqa: E402
from screl.rules import ConfigError, config_problems  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")

from screl.lightning_import import import_lightning  # noqa: E402

import_lightning(lean=cli_command(sys.argv) == "check")  # `screl check`: Lightning without torch._dynamo, torchmetrics' extras

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


def wants_help_text(args: Any) -> bool:
    """Whether ``args`` print the options' help (``--help``, ``--KEY.help``, ``--print_config``): only then does the
    parser read the config classes' attribute docstrings, which means parsing their source (about 0.75 CPU-s of every
    ``screl fit`` and ``screl check`` otherwise)."""
    if args is None:
        return True  # sys.argv: whatever it holds
    if isinstance(args, dict):
        return False
    return any(a in ("-h", "--help") or a.startswith("--print_config") or a.split("=", 1)[0].endswith(".help")
               for a in map(str, args))


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


def _run_block_keys() -> list[str]:
    """The algorithms' run blocks (``grpo``, ``ppo``: ``screl.algorithms.run_blocks``)."""
    return list(run_blocks())


def build_run_config(*values: Any) -> dict[str, Any]:
    """The ``data.init_args.run`` mapping linked from the top-level blocks, the algorithms' blocks first (a plain
    dict, so it serializes)."""
    algo_keys = _run_block_keys()
    keys = [*algo_keys, *TOP_LEVEL_BLOCKS]
    return {k: _algo_block(v) if k in algo_keys else _plain(v) for k, v in zip(keys, values, strict=True)}


def _generation_temperature(datamodule: Any) -> float:
    return float(datamodule.generation.temperature)


def _algo_for_model(*values: Any) -> dict[str, Any] | None:
    """The module's ``algo`` from the algorithms' blocks and ``checkpointing`` (the last value): the block of the
    run's algorithm; a block with a warm start (PPO's critic) reads with the checkpoints' fsspec options unless it
    names its own."""
    *blocks, checkpointing = values
    keys = _run_block_keys()
    algo = _algo_block(blocks[keys.index(algorithm_of_run(dict(zip(keys, blocks, strict=True))).config_key)])
    if isinstance(algo, dict) and "warm_start_storage_options" in algo and not algo["warm_start_storage_options"]:
        algo["warm_start_storage_options"] = dict((_plain(checkpointing) or {}).get("storage_options") or {})
    return algo


class ScrelCLI(LightningCLI):
    """LightningCLI with screl's top-level blocks, validation before any work, and WeightSync injected."""

    def __init__(self, *args: Any, check_only: bool = False, **kwargs: Any) -> None:
        self.check_only = check_only
        set_parsing_settings(docstring_parse_attribute_docstrings=wants_help_text(kwargs.get("args")))
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("trainer_defaults", {"max_epochs": 1, "num_sanity_val_steps": 0})
        kwargs.setdefault("parser_kwargs", {"default_env": False})
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(LightningModule, LightningDataModule, *args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: Any) -> None:
        algo_keys = _run_block_keys()
        for key, (block, help_line) in run_blocks().items():  # each registered algorithm's block
            parser.add_argument(f"--{key}", type=block | None, default=None, help=help_line)
        for key, cls in TOP_LEVEL_BLOCKS.items():
            parser.add_class_arguments(cls, key, instantiate=False)
        parser.link_arguments((*algo_keys, *TOP_LEVEL_BLOCKS), "data.init_args.run", compute_fn=build_run_config)
        parser.link_arguments((*algo_keys, "checkpointing"), "model.init_args.algo", compute_fn=_algo_for_model)
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

        algo_blocks = {key: block for key, (block, _) in run_blocks().items()}
        blocks = {**TOP_LEVEL_BLOCKS, **algo_blocks, "trainer": None, "model": None, "data": None}
        problems = shape_problems(self.config_dict(), blocks) or config_problems(self.config_dict())
        if problems:
            raise ConfigError(problems)
        if not self.check_only:  # before the Trainer (and CUDA) starts: the trainer sees only its GPUs
            from screl.rules.advice import config_advice

            for line in config_advice(self.config_dict()):
                logging.getLogger("screl.startup").warning("screl: %s", line)
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

        from screl.callbacks import Completions, DataPlaneCheckpoint, ModelSummary, WeightSync

        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        for i, cb in enumerate(callbacks):  # Lightning's own summary prints 'Total FLOPs: 0' for every run
            if type(cb) in (LightningModelSummary, RichModelSummary):
                callbacks[i] = ModelSummary(max_depth=cb._max_depth)
        _count_rl_steps(callbacks, (self.config_dict().get("trainer") or {}).get("callbacks"))
        if not any(isinstance(cb, WeightSync) for cb in callbacks):
            callbacks.append(WeightSync())
        if not any(isinstance(cb, Completions) for cb in callbacks):  # the figures each step; samples every 10
            callbacks.append(Completions())
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


def _count_rl_steps(callbacks: list[Any], configured: Any) -> None:
    """Swap Lightning's default progress bar (no total: ``Epoch 0/0 12/--``) for one over RL steps, unless the
    config names a progress bar of its own (``configured``: the config's ``trainer.callbacks``, class paths)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from screl.callbacks import rl_progress_bar

    if "ProgressBar" in str(configured or ""):
        return
    for i, cb in enumerate(callbacks):
        if type(cb) in (RichProgressBar, TQDMProgressBar):
            callbacks[i] = rl_progress_bar()
            return


def final_export_dir(cfg: dict[str, Any]) -> str | None:
    """Where ``screl.callbacks.HFExport`` writes the final model (None: the config exports none at the end)."""
    import inspect

    from screl.callbacks import HFExport

    trainer = cfg.get("trainer") or {}
    defaults = {k: p.default for k, p in inspect.signature(HFExport).parameters.items()}
    for cb in trainer.get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).rsplit(".", 1)[-1] == "HFExport":
            args = {**defaults, **(cb.get("init_args") or {})}
            if args["at_end"]:
                root = args["out_dir"] or os.path.join(str(trainer.get("default_root_dir") or os.getcwd()), "export")
                return os.path.join(root, "final")
    return None


def check(argv: Sequence[str]) -> int:
    """``screl check --config X.yaml``: validate everything, start nothing (no download), print the capacity plan."""
    from screl.models.hub import no_downloads
    from screl.rules.advice import config_advice

    with no_downloads():
        try:
            cli = ScrelCLI(args=list(argv), run=False, check_only=True)
        except ConfigError as err:
            print(f"screl check: {err}", file=sys.stderr)
            return 2
        print("screl check: the config is valid\n")
        print(capacity_plan(cli.config_dict()))
        final = final_export_dir(cli.config_dict())
        if final is not None:
            print(f"final model          written to {final} (screl.callbacks.HFExport, a Hugging Face folder)")
        for line in config_advice(cli.config_dict()):
            print(f"advice: {line}")
    return 0


USAGE = """screl: asynchronous single-controller RL post-training (GRPO, PPO) on PyTorch Lightning

  screl fit --config X.yaml        train (LightningCLI fit; `screl fit --help` lists every knob,
                                   `screl fit --grpo.help GRPOConfig` the step settings)
  screl check --config X.yaml      validate the whole config, start nothing, print the capacity plan
  screl events check RUN_DIR       audit a run's events.jsonl (sampler rules, no group trained twice,
                                   every prompt accounted for)
  screl export SOURCE --out DIR    a checkpoint bundle (or a run's checkpoint root) as a Hugging Face folder
  screl samples RUN_DIR [--last N]  the newest completions the run logged (prompt, completion, rewards)
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
    if args and args[0] == "export":
        from screl.export import main as export_main

        return export_main(args[1:])
    if args and args[0] == "samples":
        from screl.samples import main as samples_main

        return samples_main(args[1:])
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
