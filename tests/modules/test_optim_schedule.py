"""The modules' optimizer (by class path) and learning-rate schedule (warmup, then constant, linear or cosine),
stepped once per RL step and logged as ``train/lr``. Expected values derived by hand in the comments."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from screl.datamodule import collate_chunk
from screl.models import TinyCausalLM
from screl.modules import GRPO, PPO
from screl.modules.optim import OptimSettings, lr_factor
from tests.test_grpo_module import SPEC, _fit, _rollouts


def _lrs(settings: OptimSettings, total: int | None, steps: int, lr: float = 0.1) -> list[float]:
    """The learning rate of each of ``steps`` updates under ``settings``' schedule (a real LambdaLR)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = settings.schedule(opt, total)["scheduler"]
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return out


def test_warmup_then_linear_decay_to_zero_at_the_last_step() -> None:
    # warmup 2: (n + 1) / 2 -> 0.5, 1.0; then 1 - (n - 2) / (10 - 2): n=2 -> 1, n=6 -> 0.5, n=9 -> 1/8, n=10 -> 0
    factors = [lr_factor(n, 2, 10, "linear") for n in (0, 1, 2, 6, 9, 10)]
    assert factors == [0.5, 1.0, 1.0, 0.5, 0.125, 0.0]
    lrs = _lrs(OptimSettings("torch.optim.SGD", "linear", 2, 0.0), total=10, steps=10)
    assert lrs[:3] == pytest.approx([0.05, 0.1, 0.1], abs=1e-15)
    assert lrs[6] == pytest.approx(0.05, abs=1e-15) and lrs[9] == pytest.approx(0.0125, abs=1e-15)


def test_warmup_then_cosine_decay() -> None:
    # after warmup 2 of 10: 0.5 (1 + cos(pi (n - 2) / 8)): n=4 -> 0.5 + sqrt(2)/4, n=6 -> 0.5, n=8 -> 0.5 - sqrt(2)/4
    assert [lr_factor(n, 2, 10, "cosine") for n in (0, 1, 2, 6, 10)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0],
                                                                                      abs=1e-15)
    assert lr_factor(4, 2, 10, "cosine") == pytest.approx(0.5 + math.sqrt(2) / 4, abs=1e-15)
    assert lr_factor(8, 2, 10, "cosine") == pytest.approx(0.5 - math.sqrt(2) / 4, abs=1e-15)
    # warmup_ratio 0.25 of 10 steps: ceil(2.5) = 3 warmup steps: 1/3, 2/3, 1 of the rate
    lrs = _lrs(OptimSettings("torch.optim.SGD", "cosine", 0, 0.25), total=10, steps=4, lr=0.3)
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.3], abs=1e-15)


def test_constant_keeps_the_rate_after_warmup_and_needs_no_run_length() -> None:
    assert _lrs(OptimSettings("torch.optim.AdamW", "constant", 4, 0.0), total=None, steps=6, lr=0.4) == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.4, 0.4], abs=1e-15)


def test_bad_settings_are_refused_naming_their_key() -> None:
    with pytest.raises(ValueError, match=r"model.init_args.lr_scheduler='step': expected one of"):
        OptimSettings("torch.optim.AdamW", "step", 0, 0.0)
    with pytest.raises(ValueError, match=r"model.init_args.warmup_steps=3 and warmup_ratio=0.1: set one of them"):
        OptimSettings("torch.optim.AdamW", "linear", 3, 0.1)
    with pytest.raises(ValueError, match=r"model.init_args.optimizer='torch.optim.Nope': not an importable"):
        OptimSettings("torch.optim.Nope", "constant", 0, 0.0)
    with pytest.raises(ValueError, match=r"lr_scheduler='cosine' with warmup_ratio=0.0 needs the run's length"):
        OptimSettings("torch.optim.AdamW", "cosine", 0, 0.0).schedule(torch.optim.SGD([torch.zeros(1)], lr=1.0), None)
    megatron_distributed = SimpleNamespace(use_distributed_optimizer=True)
    with pytest.raises(ValueError, match=r"model.init_args.optimizer=torch.optim.sgd.SGD: MegatronStrategy\("):
        OptimSettings("torch.optim.SGD", "constant", 0, 0.0).optimizer([torch.zeros(1)], 1.0, 0.0,
                                                                      megatron_distributed)


def test_a_real_run_uses_the_configured_optimizer_steps_the_schedule_and_logs_train_lr() -> None:
    # linear over max_num_steps 4, no warmup: the rate of step n is 0.02 (1 - n / 4): 0.02, then 0.015
    module = GRPO(policy=SPEC, learning_rate=0.02, optimizer="torch.optim.SGD", lr_scheduler="linear",
                  algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2, "max_num_steps": 4})
    batches = [collate_chunk(*_rollouts(3, temperature=1.0, version=v), pad_id=0) for v in (0, 1)]
    cap = _fit(module, batches)
    assert type(module.trainer.optimizers[0]) is torch.optim.SGD
    as_logged = [torch.tensor(lr).item() for lr in (0.02, 0.015)]  # the loggers get float32 scalars
    assert [m["train/lr"] for m in cap.metrics] == as_logged
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01, abs=1e-12)  # the next step's


def test_ppo_lists_the_critic_schedule_first_as_its_checkpoints_did() -> None:
    module = PPO(policy=TinyCausalLM(seed=0), value=TinyCausalLM(seed=1), optimizer="torch.optim.SGD",
                 learning_rate=0.02, value_learning_rate=0.04, value_lr_warmup_steps=2, warmup_steps=4,
                 algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2})
    (policy_opt, critic_opt), (critic, policy) = module.configure_optimizers()
    assert type(policy_opt) is torch.optim.SGD and type(critic_opt) is torch.optim.SGD
    assert critic["scheduler"].optimizer is critic_opt and policy["scheduler"].optimizer is policy_opt
    # the critic warms up over 2 updates (1/2 of 0.04), the policy over 4 steps (1/4 of 0.02)
    assert (critic_opt.param_groups[0]["lr"], policy_opt.param_groups[0]["lr"]) == pytest.approx((0.02, 0.005),
                                                                                                  abs=1e-15)
    assert policy["interval"] == critic["interval"] == "step"


def test_the_default_learning_rate_is_safe_for_a_pretrained_model() -> None:
    assert GRPO(policy=SPEC).learning_rate == 1e-6
    assert PPO(policy=SPEC, value=SPEC).learning_rate == 1e-6


def test_ppo_schedules_its_policy_over_the_steps_that_train_it() -> None:
    # critic warmup 1 step, then the policy warms up over 2 of its steps: no train/lr at step 0, 0.01 / 2, 0.01
    from tests.test_grpo_module import _Capture
    from tests.test_ppo_module import _batches
    from tests.test_ppo_module import _fit as _fit_ppo

    module = PPO(policy=TinyCausalLM(seed=0), value=TinyCausalLM(seed=1), learning_rate=0.01, warmup_steps=2,
                 algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2, "policy_training_start_step": 1})
    cap = _Capture()
    _fit_ppo(module, _batches(3), callbacks=[cap])
    assert [m.get("train/lr") for m in cap.metrics] == [None, *(torch.tensor(lr).item() for lr in (0.005, 0.01))]
