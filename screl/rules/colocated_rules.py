"""``data.init_args.generation.colocated.enabled``: the engine decodes with the trainer's module in the trainer's
process (:mod:`screl.rollout.colocated`). An engine that declares ``colocated`` runs in one trainer process; one
that declares ``colocated_tensor_parallel`` (the megatron engine) across the trainer's tensor-parallel ranks; every
other combination is refused before anything starts, naming the key and the way out."""

from __future__ import annotations

from screl.config_generation import GenerationConfig
from screl.rules.context import RuleContext, get
from screl.rules.megatron_generation_rules import colocated_megatron_layout_problem, is_megatron_strategy
from screl.rules.optimizer_rules import _world_size

__all__ = ["colocated_rules"]

GEN = "data.init_args.generation"


def colocated_rules(c: RuleContext) -> None:
    """The spec's rule (each step one full batch) and the limits of today's colocated engine."""
    gen = c.gen_cfg
    if not gen.colocated.enabled:
        return
    key = f"{GEN}.colocated.enabled"
    engine = c.engine
    if engine is not None and not engine.colocated:
        c.bad(key, True, engine.reason("colocated", c.engine_name), "use backend: torch or megatron for colocated "
              f"generation, or colocated.enabled: false with {c.engine_name} workers")
    if c.min_groups != c.P:
        c.bad("async_rl.min_groups_for_streaming_train", c.min_groups, "colocated generation stands down for the "
              "whole train step, so each step must be one full batch", f"set it to num_prompts_per_step ({c.P})")
    if gen.num_workers != 1:
        c.bad(f"{GEN}.num_workers", gen.num_workers, "a colocated engine is the trainer's process: there is "
              "one", "set num_workers: 1 (or colocated.enabled: false for a fleet of workers)")
    world = _world_size(c.cfg)
    strategy = get(c.cfg, "trainer.strategy")
    named = strategy.get("class_path") if isinstance(strategy, dict) else strategy
    tensor_parallel = engine is not None and engine.colocated_tensor_parallel
    if tensor_parallel and is_megatron_strategy(c.cfg):
        why = colocated_megatron_layout_problem(c.cfg)
        if why is not None:
            c.bad(key, True, why, "train with tensor parallelism only (trainer.devices = tensor_model_parallel_size, "
                  "one node), or set colocated.enabled: false for Megatron engines in workers")
    elif not tensor_parallel and (world > 1 or (isinstance(named, str) and named not in ("auto", "single_device"))):
        c.bad(key, True, f"colocated generation runs in one trainer process (trainer world size {world}, strategy "
              f"{named or 'auto'}); a data- or model-parallel colocated {c.engine_name} engine is not built",
              "train on one device (trainer.devices: 1, num_nodes: 1, no strategy), use backend: megatron under "
              "MegatronStrategy with tensor parallelism, or set colocated.enabled: false")
    if gen.expose_http_server:
        c.bad(f"{GEN}.expose_http_server", True, "the policy server reaches Ray workers; a colocated engine has "
              "none yet", "set expose_http_server: false, or colocated.enabled: false")
    _device_rule(c, gen)
    gpus = gen.colocated.resources.gpus_per_node
    if (gpus or 0) > 0:
        c.bad(f"{GEN}.colocated.resources.gpus_per_node", gpus, "colocated generation uses the "
              "trainer's devices; these GPUs would be set aside for nothing", "set gpus_per_node: 0")


def _device_rule(c: RuleContext, gen: GenerationConfig) -> None:
    """The engine decodes where the trainer's module is: ``generation.device`` must say the same kind."""
    accelerator = str(get(c.cfg, "trainer.accelerator"))  # unset: Lightning's auto
    device = str(gen.device)
    if accelerator == "cpu" and device.startswith("cuda"):
        c.bad(f"{GEN}.device", device, "a colocated engine decodes on the trainer's device, and the trainer runs on "
              "the CPU", "set device: cpu (or trainer.accelerator: gpu)")
    elif accelerator in ("gpu", "cuda") and device == "cpu":
        c.bad(f"{GEN}.device", device, "a colocated engine decodes on the trainer's device, and the trainer runs on "
              "a GPU", "set device: cuda")
