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



# ------------------------------------------------------------------------------------------- minibatches
def _mb_ppo(k: int, micro: int | None = None, epochs: tuple[int, int] = (2, 3)) -> PPO:
    """A step of 3 x 2 = 6 rows, ``k`` minibatches, ``epochs`` = (policy, critic) epochs; a critic head that is
    not zero, so the critic's trunk has gradients from the first update on."""
    module = PPO(policy=SPEC, value=CRITIC, loss_fn=ClippedPGLoss(use_importance_sampling_correction=True),
                 value_loss_fn=ClippedValueLoss(value_clip=0.5), learning_rate=1e-2, value_learning_rate=1e-2,
                 max_grad_norm=0.5, value_max_grad_norm=0.5, micro_batch_size=micro,
                 algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2, "ppo_epochs": epochs[0],
                       "critic_ppo_epochs": epochs[1], "num_minibatches": k})
    with torch.no_grad():
        head = module.critic.head.weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    return module


def _off_policy_step() -> dict[str, Any]:
    """One step at trainer version 1 whose tokens version 0 sampled (so the IS weights are not all 1)."""
    return _batches(2)[1]


def _adam_steps(opt: torch.optim.Optimizer) -> set[int]:
    """The update count of every parameter an AdamW optimizer has state for."""
    return {int(state["step"]) for state in opt.state.values()}


def _reference_step(module: PPO, batch: dict[str, Any], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """The step written out by hand on copies of ``module``'s models: the value stage and GAE with the algos'
    functions, then for each epoch the seeded permutation cut into ``num_minibatches`` parts and, per part, one
    full forward, the losses normalized by the part's own valid tokens (their default), the norm clipped and a
    plain ``torch.optim.AdamW`` step. Critic epochs first, then policy epochs, as PPO runs them."""
    from screl.algos import gae_advantages, terminal_token_rewards
    from screl.models.logprobs import token_logprobs
    from screl.modules.masks import behaviour, loss_sample_mask
    from screl.modules.ppo_step import minibatch_permutation

    policy, critic = copy.deepcopy(module.model), copy.deepcopy(module.critic)
    cfg, step = module.ppo, int(batch["trainer_version"])
    ids, attention = batch["input_ids"], batch["attention_mask"]
    token_mask, sample_mask = batch["token_mask"].float(), loss_sample_mask(batch, False)
    rows, k = ids.shape[0], cfg.num_minibatches
    with torch.no_grad():
        old_values = critic.token_values(ids, attention)
        old_lp = token_logprobs(policy, ids, attention, 1.0)
        gen = behaviour(old_lp, batch["generation_logprobs"], batch["token_versions"] == step, "trainer")
        mask = token_mask * sample_mask[:, None]
        rewards = terminal_token_rewards(batch["rewards"].float(), mask)
        adv, ret = gae_advantages(rewards, old_values, mask, gamma=1.0, lam=0.95, whiten=True)

    def parts(model: str, epoch: int) -> list[torch.Tensor]:
        order = minibatch_permutation(seed, step, model, epoch, rows) if k > 1 else torch.arange(rows)
        return list(order.split(rows // k))

    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-2, weight_decay=0.0, eps=ADAM_EPS)
    for epoch in range(cfg.critic_ppo_epochs):
        for idx in parts("critic", epoch):
            values = critic.token_values(ids[idx], attention[idx])
            loss, _ = module.value_loss_fn(values, old_values[idx], ret[idx], token_mask[idx], sample_mask[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 0.5)
            critic_opt.step()
            critic_opt.zero_grad()
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0, eps=ADAM_EPS)
    for epoch in range(cfg.ppo_epochs):
        for idx in parts("policy", epoch):
            curr = token_logprobs(policy, ids[idx], attention[idx], 1.0)
            loss, _ = module.loss_fn(curr, old_lp[idx], gen[idx], adv[idx], token_mask[idx], sample_mask[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
            policy_opt.step()
            policy_opt.zero_grad()
    return {"model": _params(policy), "critic": _params(critic)}


ADAM_EPS = 1e-3
"""Adam's eps in both runs of a weight comparison: at the default 1e-8 Adam's first steps are ``lr * sign(g)``, and
the analytically-zero gradient of the key projections' biases turns float rounding noise into lr-sized moves
(seen: 3e-5 apart once micro-batches accumulate); 1e-3 keeps the update linear there."""


class _AdamEps(L.Callback):
    """Sets ``ADAM_EPS`` on the module's optimizers when training starts."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                group["eps"] = ADAM_EPS


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[key] - b[key]).abs().max()) for key in a)


@pytest.mark.parametrize(("k", "micro"), [(1, None), (3, None), (3, 1)])
def test_minibatch_updates_equal_a_hand_written_adamw_loop(k: int, micro: int | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 on one process: the same permutation, losses and clipping in a different code path differ only by
    float summation order (Adam's eps raised in both, see ``ADAM_EPS``), 1e-2-sized weight moves agreeing to 1e-6,
    accumulating 2 micro-batches of one row included. ``k = 1`` is one unshuffled full-batch update per epoch (what PPO did before minibatches)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    module, batch = _mb_ppo(k, micro), _off_policy_step()
    before = {"model": _params(module.model), "critic": _params(module.critic)}
    reference = _reference_step(module, batch, seed=7)
    _fit(module, [batch], callbacks=[_AdamEps()])
    for part in ("model", "critic"):
        after = _params(getattr(module, part))
        assert _max_diff(after, before[part]) > 1e-3, f"{part} barely moved: the comparison would prove nothing"
        assert _max_diff(after, reference[part]) < 1e-6, part
    if k > 1:  # the order matters: the unshuffled minibatches give other weights
        unshuffled = _reference_step(_mb_ppo(k, micro), batch, seed=8)
        assert _max_diff(unshuffled["model"], reference["model"]) > 1e-4


def test_k_minibatches_take_k_updates_per_epoch_and_one_global_step() -> None:
    module = _mb_ppo(3)
    trainer = _fit(module, _batches(2))
    policy_opt, critic_opt = trainer.optimizers
    assert _adam_steps(policy_opt) == {2 * 2 * 3}  # 2 steps x 2 epochs x 3 minibatches
    assert _adam_steps(critic_opt) == {2 * 3 * 3}
    assert module.update_counts == {"policy": 12, "critic": 18}
    assert trainer.global_step == 2
    assert float(trainer.callback_metrics["train/policy_updates"]) == 6.0  # per step
    assert float(trainer.callback_metrics["train/critic_updates"]) == 9.0
    assert float(trainer.callback_metrics["ppo/policy_updates"]) == 12.0  # cumulative
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 18  # the critic's LR schedule steps once per critic update


def test_the_shuffle_is_seeded_by_the_run_seed_the_step_and_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    from screl.modules.ppo_step import minibatch_permutation

    perm = minibatch_permutation(seed=5, step=4, model="policy", epoch=0, rows=64)
    assert torch.equal(perm, minibatch_permutation(5, 4, "policy", 0, 64))  # a resumed run draws it again
    assert sorted(perm.tolist()) == list(range(64))
    for other in ((6, 4, "policy", 0), (5, 3, "policy", 0), (5, 4, "critic", 0), (5, 4, "policy", 1)):
        assert not torch.equal(perm, minibatch_permutation(*other, rows=64)), other
    batch = _off_policy_step()
    results = []
    for seed in ("11", "11", "12"):
        monkeypatch.setenv("PL_GLOBAL_SEED", seed)
        module = _mb_ppo(3)
        _fit(module, [batch])
        results.append(_params(module.model))
    # exact: the same fit run twice in one process with the same seed, batch and thread count (same kernels, same order)
    assert all(torch.equal(v, results[1][key]) for key, v in results[0].items())
    assert _max_diff(results[0], results[2]) > 1e-4


def test_a_minibatch_is_its_shards_rows_of_the_global_part() -> None:
    from screl.modules.ppo_step import shard_minibatches

    order = torch.tensor([5, 0, 3, 1, 4, 2])
    assert [p.tolist() for p in shard_minibatches(order, 3, offset=0, local_rows=6)] == [[5, 0], [3, 1], [4, 2]]
    # the shard holding global rows 2..3: minibatch 0 holds none of them, 1 holds row 3 (its local row 1) ...
    assert [p.tolist() for p in shard_minibatches(order, 3, offset=2, local_rows=2)] == [[], [1], [0]]
    with pytest.raises(ValueError, match=r"ppo.num_minibatches=4: a step of 6 rows does not split"):
        shard_minibatches(order, 4, 0, 6)


def test_num_minibatches_must_divide_the_step() -> None:
    for k in (0, 4):
        with pytest.raises(ValueError, match=rf"ppo.num_minibatches={k}: must be >= 1 and divide .* = 6 rows"):
            _mb_ppo(k)
