"""Which tokens and rows a step trains on and compares: the behaviour logprobs of the IS weight, the rows whose
tokens are all on-policy (``train/logprob_mismatch``), the loss's sample mask (the task's or environment's flag,
overlong filtering) and its figures, and the error of a step that would train on nothing. Shared by GRPO and PPO."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from screl.rollout.rows import FINISH_CODES

__all__ = ["AllFilteredStepError", "behaviour", "loss_sample_mask", "mask_metrics", "whole_row_on_policy"]


def behaviour(trainer_lp: Tensor, engine_lp: Tensor, on_policy: Tensor, source: str) -> Tensor:
    """The behaviour logprobs the IS weight divides by: the engine's, except on tokens the trainer's current
    version generated when ``source`` is ``trainer`` (there the trainer's own, so their weight is exactly 1)."""
    if source == "engine":
        return engine_lp.float()
    return torch.where(on_policy, trainer_lp, engine_lp.float())


def whole_row_on_policy(token_versions: Tensor, token_mask: Tensor, trainer_version: int) -> Tensor:
    """``[rows, tokens]`` the valid tokens of rows whose every valid token the trainer's current version generated:
    where ``train/logprob_mismatch`` measures engine against trainer numerics. A row that crossed an in-flight refit
    is left out: its tokens after the refit attend to keys and values the older weights computed (unless the engine
    re-prefills), so they differ from the trainer's recompute by more than numerics."""
    valid = token_mask.bool()
    oldest = torch.where(valid, token_versions, torch.full_like(token_versions, trainer_version)).amin(dim=1)
    return valid & (oldest == trainer_version)[:, None]


def loss_sample_mask(batch: dict[str, Any], overlong_filtering: bool) -> Tensor:
    """``[rows]`` 1 where the loss trains on the row: the task's or environment's mask, and with
    ``overlong_filtering`` not truncated (finish reason ``length``)."""
    mask = batch["sample_mask"].float()
    if overlong_filtering and "finish_reason" in batch:
        mask = mask * (batch["finish_reason"] != FINISH_CODES["length"]).float()
    return mask


def mask_metrics(batch: dict[str, Any], overlong_filtering: bool) -> dict[str, Tensor]:
    """The chunk's masked, truncated and raw-reward figures (``train/*``)."""
    out = {"train/masked_fraction": 1.0 - loss_sample_mask(batch, overlong_filtering).mean()}
    if "finish_reason" in batch:
        out["train/truncated_fraction"] = (batch["finish_reason"] == FINISH_CODES["length"]).float().mean()
    if "raw_rewards" in batch:
        out["train/raw_reward"] = batch["raw_rewards"].float().mean()
    return out


class AllFilteredStepError(RuntimeError):
    """A step in which the loss would see no row: never skipped silently, the optimizer does not step."""

    def __init__(self, step: int, batch: dict[str, Any]) -> None:
        truncated = int((batch.get("finish_reason", torch.zeros(0)) == FINISH_CODES["length"]).sum())
        masked = int((batch["sample_mask"] == 0).sum())
        super().__init__(
            f"step {step}: every sample is filtered out of the loss ({masked} masked by the task or environment, "
            f"{truncated} truncated with grpo/ppo.overlong_filtering on, in the step's last chunk): nothing to train "
            "on. Raise generation.max_new_tokens, turn overlong_filtering off, or fix the task's masks"
        )
