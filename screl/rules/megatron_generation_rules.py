"""``data.init_args.generation.backend: megatron``: the policy's megatron-core ``GPTModel`` generates
(:mod:`screl.rollout.engines.megatron_engine`). It needs ``MegatronStrategy`` (the trainer exports Megatron's own names and
layout to it, or lends it its module when colocated); its workers run tensor parallel size 1 and take no
``backend_args``; a colocated Megatron engine runs across the trainer's tensor-parallel ranks only."""

from __future__ import annotations

from typing import Any

from screl.rules.context import RuleContext, get
from screl.rules.optimizer_rules import _size, _world_size

__all__ = ["colocated_megatron_layout_problem", "megatron_backend_rules"]

GEN = "data.init_args.generation"


def is_megatron_strategy(cfg: Any) -> bool:
    strategy = get(cfg, "trainer.strategy")
    named = strategy.get("class_path") if isinstance(strategy, dict) else strategy
    return isinstance(named, str) and named.rsplit(".", 1)[-1] == "MegatronStrategy"


def megatron_backend_rules(c: RuleContext) -> None:
    """``backend: megatron`` needs MegatronStrategy and takes no ``backend_args``."""
    gen = c.gen_cfg
    if not is_megatron_strategy(c.cfg):
        strategy = get(c.cfg, "trainer.strategy")
        c.bad(f"{GEN}.backend", "megatron", "the Megatron engine loads the policy as MegatronStrategy trains it "
              f"(Megatron's own names and layout), and the trainer's strategy is {strategy!r}",
              "set trainer.strategy: {class_path: screl.strategies.MegatronStrategy} (docs/megatron.md), or "
              "backend: torch")
    if gen.backend_args:
        c.bad(f"{GEN}.backend_args", gen.backend_args, "the megatron backend takes none (each worker runs the "
              "policy's GPTModel at tensor parallel size 1)", "remove backend_args")


def colocated_megatron_layout_problem(cfg: Any) -> str | None:
    """Why a colocated Megatron engine cannot run on this trainer layout (None: it can): its ranks must be one
    tensor-parallel group (no pipeline, context or data parallelism), as every rank takes part in each decode."""
    par = get(cfg, "trainer.strategy.init_args.parallelism") or {}
    tp = _size(par.get("tensor_model_parallel_size"))  # unset or unclear: 1
    others = {k: _size(par.get(k)) for k in ("pipeline_model_parallel_size", "context_parallel_size")}
    world = _world_size(cfg)
    if any(v > 1 for v in others.values()) or world != tp:
        bad = ", ".join(f"{k}={v}" for k, v in others.items() if v > 1)
        return (f"a colocated Megatron engine decodes across one tensor-parallel group (tensor_model_parallel_size "
                f"{tp}, trainer world size {world}{', ' + bad if bad else ''}): pipeline, context and data "
                "parallelism are not built for it")
    return None
