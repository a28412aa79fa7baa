"""The PPO module without Ray: critic warmup, epochs, RL-step counting, warm start from a checkpoint bundle."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from screl.algos import ClippedPGLoss, ClippedValueLoss
from screl.checkpoint.resume import LIGHTNING_CKPT
from screl.checkpoint.store import CheckpointStore
from screl.datamodule import collate_chunk
from screl.models import TinyCausalLM
from screl.modules.ppo import PPO
from tests.test_grpo_module import _Batches, _rollouts

torch.set_num_threads(1)
SPEC = TinyCausalLM(seed=0)
CRITIC = TinyCausalLM(seed=1)


def _ppo(start: int = 0, **algo: Any) -> PPO:
    return PPO(policy=SPEC, value=CRITIC, loss_fn=ClippedPGLoss(use_importance_sampling_correction=True),
               value_loss_fn=ClippedValueLoss(value_clip=0.5), learning_rate=1e-2, value_learning_rate=1e-2,
               algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2, "ppo_epochs": 2,
                     "critic_ppo_epochs": 3, "policy_training_start_step": start, **algo})


def _batches(steps: int) -> list[dict[str, Any]]:
    out = []
    for v in range(steps):
        meta, data = _rollouts(3, temperature=1.0, version=0)
        meta["trainer_version"] = v  # the step each batch trains (tokens from version 0: off-policy after it)
        out.append(collate_chunk(meta, data, pad_id=0))
    return out


def _fit(model: PPO, batches: list[dict[str, Any]], **trainer: Any) -> L.Trainer:
    t = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, **trainer)
    t.fit(model, train_dataloaders=_Batches(batches))
    return t


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_warmup_steps_train_the_critic_only_and_step_counts_are_rl_steps() -> None:
    model = _ppo(start=2)
    policy0, critic0 = _params(model.model), _params(model.critic)
    trainer = _fit(model, _batches(2))
    assert all(torch.equal(v, policy0[k]) for k, v in model.model.state_dict().items()), "policy moved in warmup"
    assert any(not torch.equal(v, critic0[k]) for k, v in model.critic.state_dict().items())
    assert model.refit_due is False
    assert model.update_counts == {"policy": 0, "critic": 2 * 3}
    assert trainer.global_step == 2  # one per RL step, whatever the epochs


def test_after_warmup_both_train_with_their_epochs() -> None:
    model = _ppo(start=1)
    policy0 = _params(model.model)
    trainer = _fit(model, _batches(3))
    assert any(not torch.equal(v, policy0[k]) for k, v in model.model.state_dict().items())
    assert model.refit_due is True
    assert model.update_counts == {"policy": 2 * 2, "critic": 3 * 3}
    assert trainer.global_step == 3


def _bundle(tmp_path: Path, model: PPO, trainer: L.Trainer, step: int) -> str:
    root = str(tmp_path / "ckpts")
    ckpt = tmp_path / "lightning.ckpt"
    trainer.save_checkpoint(str(ckpt))
    with CheckpointStore(root).begin(step) as writer:
        writer.write_file(LIGHTNING_CKPT, str(ckpt))
        writer.commit()
    return root


def _value_loss(model: PPO, batch: dict[str, Any]) -> float:
    with torch.no_grad():
        data = model._value_stage(batch, _NoOpt())  # type: ignore[arg-type]
        values = model.critic.token_values(batch["input_ids"], batch["attention_mask"])
        loss, _ = model.value_loss_fn(values, data.old_values, _targets(batch), data.token_mask, data.sample_mask)
    return float(loss)


class _NoOpt:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def _targets(batch: dict[str, Any]) -> torch.Tensor:
    """The sequence reward at every completion token (gamma = lambda = 1 returns)."""
    return batch["rewards"][:, None].float().expand_as(batch["token_mask"]) * batch["token_mask"]


def test_a_warm_started_critic_is_the_other_runs_critic(tmp_path: Path) -> None:
    trained = _ppo(start=10, adv_estimator={"name": "gae", "gamma": 1.0, "lam": 1.0, "whiten_advantages": False})
    batches = _batches(4)
    trainer = _fit(trained, batches)
    root = _bundle(tmp_path, trained, trainer, step=4)
    warm = _ppo(warm_start_value_checkpoint=root)
    assert all(torch.equal(v, trained.critic.state_dict()[k]) for k, v in warm.critic.state_dict().items())
    also = _ppo(warm_start_value_checkpoint=f"{root}/step_4")  # one bundle named directly
    assert all(torch.equal(v, trained.critic.state_dict()[k]) for k, v in also.critic.state_dict().items())
    cold = _ppo()
    assert _value_loss(warm, batches[0]) < _value_loss(cold, batches[0])


def test_a_warm_start_that_cannot_be_used_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"ppo.warm_start_value_checkpoint=.*no complete checkpoint bundle"):
        _ppo(warm_start_value_checkpoint=str(tmp_path / "nothing"))
    grpo_like = _ppo(start=10)
    trainer = _fit(grpo_like, _batches(1))
    root = _bundle(tmp_path, grpo_like, trainer, step=1)
    with pytest.raises(ValueError, match=r"ppo.warm_start_value_checkpoint=.*does not match model.init_args.value"):
        PPO(policy=SPEC, value=TinyCausalLM(hidden_size=32, num_layers=1),
            algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2, "warm_start_value_checkpoint": root})


def test_the_step_must_be_one_chunk() -> None:
    batch = copy.copy(_batches(1)[0])
    batch["last_chunk"] = False
    with pytest.raises(RuntimeError, match=r"PPO trains one full step per chunk: set async_rl.min_groups_for_"):
        _fit(_ppo(), [batch])


def test_overlong_filtering_reaches_the_critic_and_an_all_filtered_step_fails() -> None:
    batches = _batches(1)
    batches[0]["finish_reason"] = torch.ones_like(batches[0]["finish_reason"])  # every row truncated
    model = _ppo(overlong_filtering=True)
    critic0 = _params(model.critic)
    with pytest.raises(RuntimeError, match=r"step 0: every sample is filtered out of the loss \(0 masked by the "
                                           r"task or environment, 6 truncated"):
        _fit(model, batches)
    assert all(torch.equal(v, critic0[k]) for k, v in model.critic.state_dict().items())
    assert model.update_counts == {"policy": 0, "critic": 0}


def test_a_warm_start_checkpoint_that_holds_code_is_refused_and_never_run(tmp_path: Path) -> None:
    import io
    import os

    from screl.checkpoint import CheckpointStore

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.mkdir, (str(marker),))

    buf = io.BytesIO()
    torch.save({"state_dict": {}, "hook": Payload()}, buf)
    store = CheckpointStore(str(tmp_path / "ck"))
    with store.begin(2) as w:
        w.write_bytes("lightning.ckpt", buf.getvalue())
        w.commit({"trainer_version": 2})
    with pytest.raises(ValueError, match=r"ppo\.warm_start_value_checkpoint=.*lightning\.ckpt of step 2 holds more "
                                         r"than tensors and plain containers"):
        _ppo(warm_start_value_checkpoint=str(tmp_path / "ck"))
    assert not marker.exists(), "loading the checkpoint ran its code"

