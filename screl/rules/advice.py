"""Advice on a valid config: settings that run but are likely not what the user meant. ``screl check`` prints them
and ``screl fit`` logs them; none stops a run (a problem does: :mod:`screl.rules`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from screl.rules.context import get
from screl.rules.hub_rules import _hub_spec

#: A pretrained policy trained at this learning rate or above is likely wrecked within a few steps.
PRETRAINED_LR_LIMIT = 1e-4


def config_advice(cfg: Mapping[str, Any]) -> list[str]:
    """Every piece of advice on ``cfg``, each naming its key."""
    out: list[str] = []
    lr, policy = get(cfg, "model.init_args.learning_rate"), get(cfg, "model.init_args.policy.class_path")
    if isinstance(lr, (int, float)) and isinstance(policy, str) and lr >= PRETRAINED_LR_LIMIT and _hub_spec(policy):
        out.append(f"model.init_args.learning_rate = {lr:g} trains a pretrained policy ({policy.rsplit('.', 1)[-1]}) "
                   f"at >= {PRETRAINED_LR_LIMIT:g}: a rate this high usually wrecks it within a few steps; TRL's "
                   "default is 1e-6 (set 1e-6 to 5e-6, with warmup: docs/running.md)")
    return out
