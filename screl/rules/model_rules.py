"""``model.init_args`` at real scale and ``trainer.precision``: the combinations that cannot train.

screl trains fp32 master weights with fp32 optimizer state and computes in bf16 under ``trainer.precision:
bf16-mixed`` (see ``docs/real-scale.md``); a run that would update bf16 or fp16 parameters directly loses every
update smaller than the weight's precision step, so it is refused before anything starts.
"""

from __future__ import annotations

from typing import Any

from screl.rules.context import RuleContext, get

_PURE_HALF = ("bf16-true", "16-true")
_FP16_MIXED = ("16-mixed", "16")  # Lightning reads "16" as 16-mixed (and "bf16" as bf16-mixed)
_MIXED_FIX = "set trainer.precision: bf16-mixed (fp32 master weights and optimizer state, bf16 compute)"


def _int_knob(c: RuleContext, key: str, value: Any, meaning: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        c.bad(key, value, f"must be an integer >= 0 or null ({meaning})", f"set {key} to null (automatic) or >= 0")


def precision_rules(c: RuleContext) -> None:
    precision = str(get(c.cfg, "trainer.precision"))  # unset: Lightning's default (32-true), which is sound
    if precision in _PURE_HALF:
        c.bad("trainer.precision", precision, "trains half-precision parameters with no fp32 master copy: an "
              "update smaller than a weight's precision step is lost (bf16 keeps 8 bits of mantissa)", _MIXED_FIX)
    elif precision in _FP16_MIXED:
        c.bad("trainer.precision", precision, "fp16 needs a loss scaler, which screl's manual optimization (gradient "
              "clipping, streamed chunks) does not run", _MIXED_FIX)
    provider = get(c.cfg, "trainer.strategy.init_args.model_provider.init_args") or {}
    params_dtype = provider.get("params_dtype") if isinstance(provider, dict) else None
    if params_dtype in ("bfloat16", "float16"):
        c.bad("trainer.strategy.init_args.model_provider.init_args.params_dtype", params_dtype,
              "Megatron parameters in half precision are updated in place by the optimizer: no fp32 master copy",
              f"drop params_dtype (GRPO builds fp32 masters from the policy) and {_MIXED_FIX}")


def model_memory_rules(c: RuleContext) -> None:
    args = get(c.cfg, "model.init_args") or {}
    if not isinstance(args, dict):
        return
    _int_knob(c, "model.init_args.logprob_chunk_tokens", args.get("logprob_chunk_tokens"),
              "0: full logits, null: sized from the vocabulary")
    _int_knob(c, "model.init_args.micro_batch_tokens", args.get("micro_batch_tokens"),
              "0: the whole chunk, null: automatic")
    ckpt = args.get("activation_checkpointing")
    if ckpt not in (True, False, None, "full", "selective"):
        c.bad("model.init_args.activation_checkpointing", ckpt, "expected false, true, full or selective",
              "set model.init_args.activation_checkpointing: full (or false)")
    strategy = get(c.cfg, "trainer.strategy")
    name = str(strategy.get("class_path", "")) if isinstance(strategy, dict) else str(strategy or "auto")
    if ckpt == "selective" and not name.endswith("MegatronStrategy"):
        c.bad("model.init_args.activation_checkpointing", ckpt, "selective recomputation (the attention core "
              "only) is Megatron's; a Hugging Face policy checkpoints whole layers",
              "set model.init_args.activation_checkpointing: full, or train under screl.strategies.MegatronStrategy")
