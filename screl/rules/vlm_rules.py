"""A vision-language policy (``screl.models.TinyVisionLM``, ``screl.models.HFVisionLM``) and image tasks
(:mod:`screl.models.vision`, docs/multimodal.md).

What is built: GRPO on the torch engine in generation workers, single-turn, under the default strategy (or DDP).
Everything else is refused here, naming the key and the fix: a task whose prompts carry images with a text-only
policy, PPO (its critic reads token ids only), distillation (its rows carry no images), ``MegatronStrategy`` (no vision path in the Megatron model provider),
vLLM (its CPU build does not run the Qwen2-VL family here), the Megatron engine, colocated generation, the static
decode path and multi-turn workflows.
"""

from __future__ import annotations

import importlib
from typing import Any

from screl.config_generation import DEFAULT_WORKFLOW
from screl.rules.context import RuleContext, get, model_algorithm
from screl.rules.megatron_generation_rules import is_megatron_strategy

__all__ = ["vlm_rules"]

POLICY = "model.init_args.policy"
TASK = "data.init_args.task"
GEN = "data.init_args.generation"


def _class(class_path: Any) -> type | None:
    """The class a ``class_path`` names (``pkg.mod.Class`` or ``pkg.mod:Class``), or None (the parser reports it)."""
    if not isinstance(class_path, str):
        return None
    module, _, name = class_path.replace(":", ".").rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except (ImportError, ValueError):
        return None
    return found if isinstance(found, type) else None


def _task_has_images(cls: type | None, init_args: Any) -> bool:
    """Whether the task's prompts carry images: a task that draws them, or a ``DatasetTask`` with ``image_column``."""
    from screl.envs.base import Task
    from screl.envs.datasets import DatasetTask

    if cls is not None and issubclass(cls, DatasetTask):
        return isinstance(init_args, dict) and init_args.get("image_column") is not None
    return cls is not None and issubclass(cls, Task) and cls.images is not Task.images


def vlm_rules(c: RuleContext) -> None:
    policy = _class(get(c.cfg, f"{POLICY}.class_path"))
    task_path = get(c.cfg, f"{TASK}.class_path")
    vlm = bool(policy is not None and getattr(policy, "is_vlm", None))
    if not vlm:
        if policy is not None and _task_has_images(_class(task_path), get(c.cfg, f"{TASK}.init_args")):
            c.bad(POLICY, policy.__name__, f"the task's prompts carry images ({task_path} draws them) and "
                  f"{policy.__name__} is a text-only policy: it cannot see them",
                  "use a vision-language policy (screl.models.TinyVisionLM, screl.models.HFVisionLM), or a text task")
        return
    name = policy.__name__  # type: ignore[union-attr]
    algo = model_algorithm(c.cfg)
    if algo is not None and algo.vision_refusal is not None:
        c.bad("model.class_path", get(c.cfg, "model.class_path"), algo.vision_refusal.format(policy=name),
              "use model.class_path: screl.GRPO for a vision-language policy")
    if is_megatron_strategy(c.cfg):
        c.bad("trainer.strategy", "MegatronStrategy", f"the Megatron model provider builds text-only GPT models: "
              f"{name}'s vision tower and multimodal positions are not built there",
              "train a vision-language policy under the default strategy (auto) or screl.strategies.DDPStrategy")
    if c.engine is not None and not c.engine.vision_inputs:
        why = c.engine.reason("vision_inputs", c.engine_name)
        c.bad(f"{GEN}.backend", c.gen_cfg.backend, f"{why}; {name}'s prompts carry images",
              "use backend: torch")
    if (decode := (c.gen_cfg.backend_args or {}).get("decode")) in ("static", "continuous"):
        c.bad(f"{GEN}.backend_args.decode", decode, "a vision-language policy decodes through Hugging Face's "
              "forward (the vision tower and multimodal positions)", "set decode: hf or auto")
    if c.gen_cfg.colocated.enabled:
        c.bad(f"{GEN}.colocated.enabled", True, "colocated generation builds text prompts only; the images are "
              "drawn on a generation worker", "colocated.enabled: false")
    workflow = str(c.gen_cfg.workflow or DEFAULT_WORKFLOW)
    if workflow.rsplit(".", 1)[-1] != "SingleTurnWorkflow":
        c.bad(f"{GEN}.workflow", workflow, "multimodal rows are built by the single-turn workflow only (a multi-turn "
              "row would need each turn's images)", "use the single-turn workflow with a vision-language policy")
    if get(c.cfg, "model.init_args.routing_replay"):
        c.bad("model.init_args.routing_replay", True, f"{name} is not a mixture-of-experts policy",
              "routing_replay: false")
    if get(c.cfg, "data.init_args.val_task") is not None:
        c.bad("data.init_args.val_task", "set", "validation generates from text prompts only (no images yet)",
              "drop data.init_args.val_task for a vision-language policy")
