"""Rules of the rollout side's refit and deadlines: the drain gate, per-request deadlines, the vLLM backend."""

from __future__ import annotations

import importlib.util

from screl.data.sampler_config import InOrderSamplerConfig
from screl.rollout.engines.registry import engine_capabilities
from screl.rules.context import RuleContext, get

GEN = "data.init_args.generation"


def refit_rules(c: RuleContext) -> None:
    """``async_rl.in_flight_weight_updates: false`` (the drain gate) against the knobs it contradicts."""
    if c.async_cfg.in_flight_weight_updates is not False:
        return
    key = "async_rl.in_flight_weight_updates"
    if c.async_cfg.recompute_kv_cache_after_weight_updates:
        c.bad(key, False, "the drain gate lets in-flight requests finish under the old weights, so there is no "
              "KV cache to recompute (recompute_kv_cache_after_weight_updates: true)",
              "drop one of the two: keep in_flight_weight_updates: true to recompute, or set "
              "recompute_kv_cache_after_weight_updates: false")
    if isinstance(c.sampler, InOrderSamplerConfig) and c.sampler.peak_window == 0:
        c.bad(key, False, "with sampler in_order and max_lookahead_versions 0 (sync) no request is in flight at a "
              "refit, so the drain gate has nothing to wait for", "remove in_flight_weight_updates, or raise "
              "max_lookahead_versions to generate ahead")


def deadline_rules(c: RuleContext) -> None:
    """``generation_timeout_s`` and ``rollout_timeout_s``: positive, consistent, below the stall watchdog's."""
    set_ = {}
    for knob in ("generation_timeout_s", "rollout_timeout_s"):
        v = getattr(c.gen_cfg, knob)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            c.bad(f"{GEN}.{knob}", v, "must be a number of seconds > 0, or null (no deadline)",
                  f"set e.g. {knob}: 300")
        else:
            set_[knob] = float(v)
    gen_s, roll_s = set_.get("generation_timeout_s"), set_.get("rollout_timeout_s")
    if gen_s is not None and roll_s is not None and gen_s > roll_s:
        c.bad(f"{GEN}.generation_timeout_s", gen_s, f"is above rollout_timeout_s ({roll_s:g}), which covers every "
              "generate call of a rollout: it would never fire", "set generation_timeout_s <= rollout_timeout_s")
    stall = c.async_cfg.watchdog.stall_timeout_s
    if isinstance(stall, (int, float)) and not isinstance(stall, bool) and set_ and stall <= max(set_.values()):
        knob, longest = max(set_.items(), key=lambda kv: kv[1])
        c.bad("async_rl.watchdog.stall_timeout_s", stall, f"must exceed every request deadline ({GEN}.{knob} = "
              f"{longest:g}): a slow request would stop the run before its own deadline retries it",
              f"set stall_timeout_s > {longest:g}")


def worker_health_rules(c: RuleContext) -> None:
    """``generation.max_worker_restarts`` and ``async_rl.watchdog.health_check_interval_s``."""
    restarts = c.gen_cfg.max_worker_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < -1:
        c.bad(f"{GEN}.max_worker_restarts", restarts, "must be an integer >= 0, or -1 (without limit)",
              "set max_worker_restarts: -1")
    interval = c.async_cfg.watchdog.health_check_interval_s
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0):
        c.bad("async_rl.watchdog.health_check_interval_s", interval, "must be a number of seconds > 0, or null (off)",
              "set health_check_interval_s: 5")


def torch_backend_rules(c: RuleContext) -> None:
    """``backend: torch`` takes the ``backend_args`` its engine declares (``decode``), each among its choices."""
    declared = engine_capabilities("torch").backend_args
    args = c.gen_cfg.backend_args or {}
    for key in sorted(set(args) - set(declared.defaults)):
        c.bad(f"{GEN}.backend_args.{key}", args[key],
              f"the torch backend takes only {', '.join(f'backend_args.{k}' for k in declared.defaults)}",
              f"remove {key}")
    for key, choices in declared.choices.items():
        if key in args and args[key] not in choices:
            c.bad(f"{GEN}.backend_args.{key}", args[key], f"must be one of {', '.join(map(str, choices))}",
                  f"set {key}: {declared.defaults[key]}")
    if args.get("cuda_graphs") is True and not c.gen_cfg.colocated.enabled and \
            not str(c.gen_cfg.device).startswith("cuda"):
        c.bad(f"{GEN}.backend_args.cuda_graphs", True, f"CUDA graphs need a CUDA device (device: {c.gen_cfg.device})",
              "set cuda_graphs: auto (on where the engine runs on CUDA) or device: cuda")


def vllm_rules(c: RuleContext) -> None:
    """``backend: vllm``: vLLM's own limits, and vLLM importable where the workers start (before any work)."""
    transfer = (c.gen_cfg.backend_args or {}).get("weight_transfer")
    key = f"{GEN}.backend_args.weight_transfer"
    if transfer not in (None, "nccl"):
        c.bad(key, transfer, "must be nccl (vLLM's NCCL transfer, GPU) or null (the object store)",
              "set weight_transfer: nccl or remove it")
    elif transfer == "nccl" and not str(c.gen_cfg.device).startswith("cuda"):
        c.bad(key, transfer, "NCCL moves weights between GPUs, and the engines run on the CPU",
              "set device: cuda on a GPU machine, or remove weight_transfer (the object store path)")
    strategy = get(c.cfg, "trainer.strategy")
    strategy_path = strategy.get("class_path", "") if isinstance(strategy, dict) else str(strategy or "")
    if transfer == "nccl" and "MegatronStrategy" in strategy_path:
        c.bad(key, transfer, "the NCCL sender broadcasts a Hugging Face module's parameters; under MegatronStrategy "
              "the policy is a Megatron model whose names vLLM does not know", "remove weight_transfer")
    t = c.gen_cfg.temperature
    if isinstance(t, (int, float)) and t > 2:
        c.bad(f"{GEN}.temperature", t, "vLLM samples at temperatures in [0, 2] only", "set temperature <= 2")
    if importlib.util.find_spec("vllm") is not None:
        return
    c.bad(f"{GEN}.backend", "vllm", "vLLM is not installed in this environment",
          "on CPU run `bash .ci/vllm-venv` and use .venv-vllm/bin/screl; on GPU pip install 'screl[vllm]' "
          "(docs/generation.md)")
