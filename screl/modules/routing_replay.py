"""Rollout routing replay (R3) in the trainer: ``GRPO(routing_replay=True)`` on a mixture-of-experts policy.

The engines record the experts each MoE layer chose for every token they fed (``GenerationResult.routing``); the
rows carry it (``screl.rollout.rows.ROUTING_SCHEMA``); the trainer's forward that recomputes the policy's logprobs
routes every token to those experts (:func:`screl.models.moe.replay_routing`), its own gate weighting them. Tokens
the engine never fed (a row's last sampled token) keep the trainer's own routing. The reference policy (the KL
penalty's) routes by itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from screl.models.moe import moe_routers, replay_problem, replay_rows

KEY = "model.init_args.routing_replay"


def check_routing_replay(on: bool, model: torch.nn.Module, activation_checkpointing: str | None) -> bool:
    """``routing_replay`` after checking it can work on ``model``; ``ValueError`` naming the key and the fix."""
    if not on:
        return False
    if not moe_routers(model) and not any(hasattr(m, "experts") for m in model.modules()):
        raise ValueError(f"{KEY}: true needs a mixture-of-experts policy (a top-k router per layer, e.g. Qwen3-MoE: "
                         f"screl.models.TinyMoECausalLM); {type(model).__name__} has none. Fix: routing_replay: false")
    problem = replay_problem(model)
    if problem is not None:
        raise ValueError(f"{KEY}: true on {type(model).__name__}: {problem}. Fix: routing_replay: false, or add the "
                         "router to screl.models.moe.REPLAYS with its test")
    if activation_checkpointing is not None:
        raise ValueError(f"{KEY}: true with activation_checkpointing={activation_checkpointing!r}: the recomputed "
                         "forward of the backward pass would route by itself. Fix: one of the two")
    return True


def replayed(on: bool, model: torch.nn.Module, batch: dict[str, Any], sl: slice) -> Any:
    """The context of one policy forward over rows ``sl`` of ``batch``: the rows' recorded routing, replayed."""
    if not on:
        return contextlib.nullcontext()
    routing = batch.get("routing")
    if routing is None:
        raise ValueError(f"{KEY}: the chunk's rows carry no routing (rows written without it, e.g. by a run "
                         "without routing replay): resume such a run with routing_replay: false")
    rows = routing[sl]
    width = int(batch["input_ids"][sl].shape[1])
    return replay_rows(model, rows[:, :width].to(next(model.parameters()).device))
