"""``model.init_args.routing_replay``: rollout routing replay for a mixture-of-experts policy
(:mod:`screl.modules.routing_replay`). The torch engine records the routing through Hugging Face's forward in a
generation worker; everything else is refused here, naming the key and the fix. Replay is exact or refused: a policy
whose routers are not in :data:`screl.models.moe.REPLAYS` (read from the spec's ``build_config()``, the model built
on the meta device) is refused naming its router and MoE block class."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from screl.config_generation import DEFAULT_WORKFLOW
from screl.rules.context import RuleContext, get
from screl.rules.megatron_generation_rules import is_megatron_strategy

__all__ = ["routing_replay_rules"]

KEY = "model.init_args.routing_replay"
GEN = "data.init_args.generation"
POLICY = "model.init_args.policy"


def _policy_problem(policy: Any) -> str | None:
    """Why replay cannot be exact on the policy a ``{class_path, init_args}`` builds, or None (also when the spec
    does not build or cannot tell its config without loading weights: the trainer checks the built model)."""
    if not isinstance(policy, Mapping):
        return None
    module, _, name = str(policy.get("class_path", "")).rpartition(".")
    try:
        spec = getattr(importlib.import_module(module), name)(**dict(policy.get("init_args") or {}))
        config = spec.build_config()
    except (ImportError, AttributeError, TypeError, ValueError, OSError):
        return None  # the parser, or the spec's own rule, reports it
    if config is None:
        return None
    from screl.models.moe import config_replay_problem

    return config_replay_problem(config)


def routing_replay_rules(c: RuleContext) -> None:
    if not get(c.cfg, KEY):
        return
    gen = c.gen_cfg
    if c.engine is not None and not c.engine.routing_records:
        c.bad(KEY, True, c.engine.reason("routing_records", c.engine_name),
              "use backend: torch, or routing_replay: false")
    elif (decode := (gen.backend_args or {}).get("decode")) in ("static", "continuous"):
        c.bad(f"{GEN}.backend_args.decode", decode, "routing replay records the experts through Hugging Face's "
              "forward", "set decode: hf or auto")
    if gen.colocated.enabled:
        c.bad(KEY, True, "a colocated engine decodes with the trainer's own module and precision: its routing is "
              "the trainer's already", "routing_replay: false, or colocated.enabled: false")
    if is_megatron_strategy(c.cfg):
        c.bad(KEY, True, "MegatronStrategy does not train mixture-of-experts policies here (no MoE export)",
              "train under the default strategy or screl.strategies.DDPStrategy")
    problem = _policy_problem(get(c.cfg, POLICY))
    if problem is not None:
        c.bad(KEY, True, f"replay would not be exact on {get(c.cfg, POLICY + '.class_path')}: {problem}",
              "routing_replay: false, or add the router to screl.models.moe.REPLAYS with its exactness test")
    workflow = str(gen.workflow or DEFAULT_WORKFLOW)
    if workflow.rsplit(".", 1)[-1] != "SingleTurnWorkflow":
        c.bad(f"{GEN}.workflow", workflow, "routing replay records single-turn completions only (a multi-turn row "
              "joins several engine calls)", "use the single-turn workflow, or routing_replay: false")
