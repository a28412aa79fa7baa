"""``model.init_args.lora`` against the strategy and the generation topology: LoRA trains an HF policy under
Lightning's own strategies, and the engines must receive the merged weights (docs/lora.md)."""

from __future__ import annotations

from screl.rules.context import GEN, RuleContext, get


def lora_rules(c: RuleContext) -> None:
    from screl.models.lora import BROADCAST_REFUSAL, COLOCATED_REFUSAL, KEY, MEGATRON_REFUSAL, lora_settings

    value = get(c.cfg, KEY)
    if value is None:
        return
    try:
        lora_settings(value)
    except (ValueError, TypeError, ImportError) as err:
        c.bad(KEY, value, str(err).removeprefix(f"{KEY}: "), "fix the lora block (docs/lora.md)")
        return
    strategy = get(c.cfg, "trainer.strategy")
    named = strategy.get("class_path") if isinstance(strategy, dict) else strategy
    if str(named or "").rsplit(".", 1)[-1] == "MegatronStrategy":
        c.bad(KEY, value, MEGATRON_REFUSAL.removeprefix(f"{KEY}: "), "train under trainer.strategy: auto or "
              "screl.strategies.DDPStrategy, or remove model.init_args.lora")
    if c.gen_cfg.colocated.enabled:
        c.bad(f"{GEN}.colocated.enabled", True, COLOCATED_REFUSAL, "set colocated.enabled: false")
    if (c.gen_cfg.backend_args or {}).get("weight_transfer") == "nccl":
        c.bad(f"{GEN}.backend_args.weight_transfer", "nccl", BROADCAST_REFUSAL, "remove weight_transfer: nccl")
