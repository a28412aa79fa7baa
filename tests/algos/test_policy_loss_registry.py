"""Policy losses chosen by registered name (``screl.algos.register_policy_loss``): a loss registered from outside
screl trains a module."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from screl.algos import (
    ClippedPGLoss,
    PolicyLoss,
    get_policy_loss,
    policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from screl.datamodule import collate_chunk
from screl.modules import GRPO
from tests.test_grpo_module import SPEC, _fit, _rollouts


@register_policy_loss("test_reinforce")
class Reinforce(nn.Module):
    """REINFORCE: ``-A log pi`` averaged over the valid tokens (no ratio, no clip); counts its calls."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.token_level_loss = True

    @property
    def requires_reference_logprobs(self) -> bool:
        return False

    def forward(
        self, curr_logprobs: Tensor, prev_logprobs: Tensor, generation_logprobs: Tensor, advantages: Tensor,
        token_mask: Tensor, sample_mask: Tensor | None = None, reference_logprobs: Tensor | None = None,
        global_normalizer: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        type(self).calls += 1
        m = token_mask.float() * (sample_mask.float()[:, None] if sample_mask is not None else 1.0)
        total = -(advantages * curr_logprobs * m).sum()
        loss = total / (global_normalizer if global_normalizer is not None else m.sum().clamp_min(1.0))
        return loss, {"policy_loss": loss.detach()}


def test_the_builtin_loss_is_registered_and_a_name_builds_it_with_its_defaults() -> None:
    assert get_policy_loss("clipped") is ClippedPGLoss
    assert {"clipped", "test_reinforce"} <= set(policy_loss_names())
    built = policy_loss(None)
    assert type(built) is ClippedPGLoss and built.ratio_clip_max == 0.2 and not built.use_importance_sampling_correction
    given = ClippedPGLoss(ratio_clip_max=0.28)
    assert policy_loss(given) is given
    with pytest.raises(ValueError, match=r"policy loss 'clipped' is already registered \(ClippedPGLoss\)"):
        register_policy_loss("clipped")(Reinforce)
    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'; registered: \[.*'clipped'.*\]"):
        policy_loss("nope")


def test_a_module_trains_with_a_policy_loss_registered_from_the_test_tree() -> None:
    module = GRPO(policy=SPEC, loss_fn="test_reinforce", learning_rate=1e-2, max_grad_norm=None,
                  algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2})
    assert isinstance(module.loss_fn, Reinforce)
    loss: PolicyLoss = module.loss_fn  # the protocol types it
    assert loss.token_level_loss and module.reference is None
    before = [p.detach().clone() for p in module.model.parameters()]
    meta, data = _rollouts(3, temperature=1.0)
    calls = Reinforce.calls
    cap = _fit(module, [collate_chunk(meta, data, pad_id=0)])
    assert Reinforce.calls > calls
    moved = sum(not torch.equal(b, p) for b, p in zip(before, module.model.parameters(), strict=True))
    assert moved > 0, "the step changed no parameter"
    assert cap.metrics[-1]["train/policy_loss"] == pytest.approx(float(cap.metrics[-1]["train/loss"]), rel=1e-6)
