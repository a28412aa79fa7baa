"""``trainer.strategy.init_args.use_distributed_optimizer``: megatron-core's distributed optimizer under MegatronStrategy.

What is true on CPU (gloo) and GPU alike, per ``tests/strategies/test_distributed_optimizer.py``: DP=2 trains as
DP=1 does; pipeline parallelism works with it (PP=2 equals PP=1); checkpoints reshard across DP and TP sizes. So
the only refusals are a contradictory second switch and a strategy without the knob. Data-parallel size 1 is
allowed (each rank keeps all of the state, as without the knob) and only logged.
"""

from __future__ import annotations

import logging
from typing import Any

from screl.rules.context import RuleContext, get

__all__ = ["distributed_optimizer_rules"]

log = logging.getLogger(__name__)

STRATEGY = "trainer.strategy"
KNOB = f"{STRATEGY}.init_args.use_distributed_optimizer"
DDP_KNOB = f"{STRATEGY}.init_args.ddp_config.use_distributed_optimizer"


def _size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def _world_size(cfg: Any) -> int:
    devices = get(cfg, "trainer.devices")  # unset or unclear (auto): 1
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    procs = len(devices) if isinstance(devices, (list, tuple)) else _size(devices)
    return procs * _size(get(cfg, "trainer.num_nodes"))


def distributed_optimizer_rules(c: RuleContext) -> None:
    """Check ``use_distributed_optimizer`` against the strategy and its ``ddp_config``; log a DP size of 1."""
    strategy = get(c.cfg, STRATEGY)
    if not isinstance(strategy, dict):
        return
    on = get(strategy, "init_args.use_distributed_optimizer")
    ddp_flag = get(strategy, "init_args.ddp_config.use_distributed_optimizer")
    is_megatron = str(strategy.get("class_path", "")).rsplit(".", 1)[-1] == "MegatronStrategy"
    if on and not is_megatron:
        c.bad(KNOB, on, f"only screl.strategies.MegatronStrategy has a distributed optimizer (got "
              f"{strategy.get('class_path')!r})", "remove use_distributed_optimizer, or train under "
              "screl.strategies.MegatronStrategy (docs/megatron.md)")
        return
    if ddp_flag is not None and bool(ddp_flag) != bool(on):
        c.bad(DDP_KNOB, ddp_flag, f"contradicts {KNOB}={bool(on)}; the strategy sets Megatron's DDP flag from its "
              "own knob", f"remove ddp_config.use_distributed_optimizer and set {KNOB}")
        return
    if not on:
        return
    par = get(strategy, "init_args.parallelism") or {}
    model_parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model_parallel *= _size(par.get(name))
    dp = _world_size(c.cfg) // model_parallel
    if dp <= 1:
        log.info("screl check: %s is true at data-parallel size %s: each rank keeps all of the optimizer state, "
                 "as without it (harmless; it shards once DP > 1)", KNOB, dp)
