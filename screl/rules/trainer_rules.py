"""``trainer.strategy``: the Lightning strategies a screl run can train under.

A screl run trains where the controller is: rank 0 holds the controller and refits the generation workers from
its full copy of the policy, and every rank is a process Lightning starts with the script launcher (so each runs
``screl fit`` and builds its own modules). That rules out three families of Lightning's built-in strategies.
"""

from __future__ import annotations

from typing import Any

from screl.algorithms import Algorithm
from screl.rules.context import RuleContext, get, model_algorithm

KEY = "trainer.strategy"
SCREL_DDP = "screl.strategies.DDPStrategy"
_LIGHTNING_DDP = ("ddp", "ddp_find_unused_parameters_true", "ddp_find_unused_parameters_false")
_SPAWNING = ("ddp_spawn", "ddp_fork", "ddp_notebook")
_SHARDED = ("fsdp", "deepspeed", "FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")


def _name(strategy: Any) -> tuple[str, dict[str, Any]]:
    """A registry name or class path, and the init_args given with a class path."""
    if isinstance(strategy, dict):
        return str(strategy.get("class_path", "")), dict(strategy.get("init_args") or {})
    return str(strategy or "auto"), {}


def _processes(devices: Any) -> int:
    """Training processes per node that ``trainer.devices`` asks for (1 for ``auto`` and anything unclear)."""
    if isinstance(devices, bool):
        return 1
    if isinstance(devices, int):
        return devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        return int(devices)
    return 1


def strategy_rules(c: RuleContext) -> None:
    name, init_args = _name(get(c.cfg, KEY))
    procs = _processes(get(c.cfg, "trainer.devices")) * int(get(c.cfg, "trainer.num_nodes") or 1)
    short = name.rsplit(".", 1)[-1]
    if name.startswith(_SPAWNING) or (short in ("DDPStrategy", "MegatronStrategy")
                                      and init_args.get("start_method") not in (None, "popen")):
        c.bad(KEY, name, "a spawned or forked rank gets the LightningModule and the datamodule by pickling, and "
              "their Ray and TransferQueue handles do not survive it", f"set trainer.strategy: {{class_path: "
              f"{SCREL_DDP}}} (every rank starts as its own `screl fit`)")
    elif any(short.startswith(s) for s in _SHARDED):
        c.bad(KEY, name, "the refit sends rank 0's full copy of the policy to the generation workers, and a "
              "sharded strategy leaves rank 0 no full copy", "for sharded training set trainer.strategy: "
              "{class_path: screl.strategies.MegatronStrategy} (tensor/pipeline/data parallel, docs/megatron.md); "
              f"for data parallel {{class_path: {SCREL_DDP}}}")
    elif name in _LIGHTNING_DDP or (short == "DDPStrategy" and not name.startswith("screl.")):
        c.bad(KEY, name, "Lightning's DDP rendezvouses through torch's TCP store, which listens on every network "
              f"interface; {SCREL_DDP} is the same strategy, and ranks on one node meet through a file instead",
              f"set trainer.strategy: {{class_path: {SCREL_DDP}}} (docs/scaling.md)")
    elif (algo := _needs_named_strategies(c)) and procs > 1 and short not in (algo.multi_process_strategies or ()):
        allowed = " or ".join(f"screl.strategies.{s}" for s in algo.multi_process_strategies or ())
        c.bad(KEY, name, f"{algo.title} over {procs} processes reduces its advantages, loss normalizers and "
              f"gradients over data-parallel replicas under {allowed} only",
              f"set trainer.strategy: {{class_path: {SCREL_DDP}}} (docs/{algo.name}.md), or trainer.devices: 1")
    _megatron_context_parallel_rule(c, short, init_args)


def _needs_named_strategies(c: RuleContext) -> Algorithm | None:
    """The configured model's algorithm when it needs one of a few strategies for a multi-process run."""
    algo = model_algorithm(c.cfg)
    return algo if algo is not None and algo.multi_process_strategies else None


def _megatron_context_parallel_rule(c: RuleContext, short: str, init_args: dict[str, Any]) -> None:
    """GRPO's policy under MegatronStrategy computes logprobs over whole sequences: no context parallelism."""
    cp = get(init_args, "parallelism.context_parallel_size")
    algo = model_algorithm(c.cfg)
    if algo is not None and not algo.megatron_context_parallel and short == "MegatronStrategy" \
            and isinstance(cp, int) and cp > 1:
        c.bad(f"{KEY}.init_args.parallelism.context_parallel_size", cp, f"{algo.title} under MegatronStrategy does not "
              "support context parallelism (every rank computes the policy's logprobs over whole sequences)",
              "set context_parallel_size: 1 and split the model with tensor_model_parallel_size or "
              "pipeline_model_parallel_size instead")
