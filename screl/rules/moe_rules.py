"""``model.init_args.routing_replay``: rollout routing replay for a mixture-of-experts policy
(:mod:`screl.modules.routing_replay`). The torch engine records the routing through Hugging Face's forward in a
generation worker; everything else is refused here, naming the key and the fix."""

from __future__ import annotations

from screl.config_generation import DEFAULT_WORKFLOW
from screl.rules.context import RuleContext, get
from screl.rules.megatron_generation_rules import is_megatron_strategy

__all__ = ["routing_replay_rules"]

KEY = "model.init_args.routing_replay"
GEN = "data.init_args.generation"


def routing_replay_rules(c: RuleContext) -> None:
    if not get(c.cfg, KEY):
        return
    gen = c.gen_cfg
    if c.engine is not None and not c.engine.routing_records:
        c.bad(KEY, True, c.engine.reason("routing_records", c.engine_name),
              "use backend: torch, or routing_replay: false")
    elif (gen.backend_args or {}).get("decode") == "static":
        c.bad(f"{GEN}.backend_args.decode", "static", "routing replay records the experts through Hugging Face's "
              "forward", "set decode: hf or auto")
    if gen.colocated.enabled:
        c.bad(KEY, True, "a colocated engine decodes with the trainer's own module and precision: its routing is "
              "the trainer's already", "routing_replay: false, or colocated.enabled: false")
    if is_megatron_strategy(c.cfg):
        c.bad(KEY, True, "MegatronStrategy does not train mixture-of-experts policies here (no MoE export)",
              "train under the default strategy or screl.strategies.DDPStrategy")
    workflow = str(gen.workflow or DEFAULT_WORKFLOW)
    if workflow.rsplit(".", 1)[-1] != "SingleTurnWorkflow":
        c.bad(f"{GEN}.workflow", workflow, "routing replay records single-turn completions only (a multi-turn row "
              "joins several engine calls)", "use the single-turn workflow, or routing_replay: false")
