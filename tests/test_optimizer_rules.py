"""``screl.rules.optimizer_rules``: ``use_distributed_optimizer`` checked against the strategy (direct calls; the
rule joins ``screl check`` once registered in ``screl.rules.RULES``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from screl.rules.context import RuleContext
from screl.rules.optimizer_rules import distributed_optimizer_rules

MEGATRON = "screl.strategies.MegatronStrategy"


def _problems(strategy: dict[str, Any], devices: int = 2) -> list[str]:
    c = RuleContext({"trainer": {"devices": devices, "strategy": strategy}})
    distributed_optimizer_rules(c)
    return [str(p) for p in c.problems]


def test_megatron_with_the_knob_at_dp2_and_at_pp2_passes() -> None:
    assert _problems({"class_path": MEGATRON, "init_args": {"use_distributed_optimizer": True}}) == []
    pp2 = {"use_distributed_optimizer": True, "parallelism": {"pipeline_model_parallel_size": 2}}
    assert _problems({"class_path": MEGATRON, "init_args": pp2}, devices=4) == []


def test_dp1_is_allowed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    tp2 = {"use_distributed_optimizer": True, "parallelism": {"tensor_model_parallel_size": 2}}
    with caplog.at_level(logging.INFO, logger="screl.rules.optimizer_rules"):
        assert _problems({"class_path": MEGATRON, "init_args": tp2}) == []
    assert "at data-parallel size 1" in caplog.text


def test_other_strategies_and_a_contradicting_ddp_flag_are_refused_by_key() -> None:
    (ddp,) = _problems({"class_path": "screl.strategies.DDPStrategy", "init_args": {"use_distributed_optimizer": True}})
    assert ddp.startswith("trainer.strategy.init_args.use_distributed_optimizer = True: only")
    assert "Fix: remove use_distributed_optimizer, or train under screl.strategies.MegatronStrategy" in ddp
    args = {"use_distributed_optimizer": True, "ddp_config": {"use_distributed_optimizer": False}}
    (both,) = _problems({"class_path": MEGATRON, "init_args": args})
    assert both.startswith("trainer.strategy.init_args.ddp_config.use_distributed_optimizer = False: contradicts")
    assert _problems({"class_path": MEGATRON, "init_args": {"ddp_config": {"use_distributed_optimizer": False}}}) == []
