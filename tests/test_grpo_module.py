"""The GRPO module and the chunk collation, without Ray: alignment, on-policy IS weights, streamed steps."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch

from screl.algos import ClippedPGLoss
from screl.datamodule import collate_chunk
from screl.envs import CountLetter, PromptRecord
from screl.models import TinyCausalLM
from screl.modules.grpo import GRPO, token_logprobs, whole_row_on_policy
from screl.rollout import GenerationRequest, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import ROW_SCHEMA

torch.set_num_threads(1)
SPEC = TinyCausalLM(seed=0)
G = 2


def _rollouts(n_groups: int, temperature: float, version: int = 0) -> tuple[dict[str, Any], dict[str, list[torch.Tensor]]]:
    """Real generations, laid out as the controller writes them to the data plane."""
    engine = TorchGenerationEngine(SPEC, seed=0, version=version)
    tok = SPEC.build_tokenizer()
    prompts = [f"{a}+{a + 1}=" for a in range(n_groups)]
    reqs = [
        GenerationRequest(f"p{i}_g{s}", tok(p, add_special_tokens=False)["input_ids"],
                          SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=temperature, seed=7 * i + s))
        for i, p in enumerate(prompts) for s in range(G)
    ]
    results = engine.generate(reqs)
    rows = [ROW_SCHEMA.build(res, float(i % 3)) for i, res in enumerate(results)]
    data = ROW_SCHEMA.merge(rows)
    meta = {"keys": [r.request_id for r in reqs], "trainer_version": version, "step_groups": n_groups,
            "last_chunk": True, "start_weight": [version] * len(reqs)}
    return meta, data


@pytest.mark.parity
def test_collated_positions_carry_the_engine_logprobs() -> None:
    """token_mask/generation_logprobs are next-token aligned: the trainer's logprobs match the engine's."""
    meta, data = _rollouts(3, temperature=0.8)
    batch = collate_chunk(meta, data, pad_id=0)
    assert batch["token_mask"].sum().item() == 3 * G * 6
    model = SPEC.build_model().eval()
    with torch.no_grad():
        trainer_lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature=0.8)
    mask = batch["token_mask"].bool()
    torch.testing.assert_close(trainer_lp[mask], batch["generation_logprobs"][mask], rtol=1e-5, atol=1e-5)


class _Capture(L.Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


class _Batches:
    """An iterable of ready batches (a plain list would be read as a list of dataloaders)."""

    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


def _fit(model: GRPO, batches: list[dict[str, Any]]) -> _Capture:
    cap = _Capture()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cap])
    trainer.fit(model, train_dataloaders=_Batches(batches))
    return cap


class _SGD(GRPO):
    """Plain SGD: the update is the accumulated gradient itself (Adam would amplify ~0 gradients, such as the
    key-projection bias's, into full-size steps and hide the comparison in noise)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1.0)


def _module(cls: type[GRPO] = GRPO) -> GRPO:
    loss = ClippedPGLoss(use_importance_sampling_correction=True)
    return cls(policy=SPEC, loss_fn=loss, learning_rate=1e-2, max_grad_norm=None,
                algo={"num_prompts_per_step": 4, "num_generations_per_prompt": G})


def test_is_weights_are_exp_of_trainer_minus_engine_logprobs_token_by_token() -> None:
    """Under ``behaviour_logprobs: engine`` every token's weight is exp(trainer - engine), here against logprobs the
    test computes itself: the engine's logprobs carry seeded noise of up to +-0.2 per token, and the logged min,
    max and mean weights must be those of exp(trainer - noisy engine) over the valid tokens. The mismatch metric
    reads the noise too (the largest |noise| up to fp error)."""
    meta, data = _rollouts(4, temperature=1.0, version=0)
    batch = collate_chunk(meta, data, pad_id=0)
    valid = batch["token_mask"].bool()
    noise = (torch.rand(batch["generation_logprobs"].shape, generator=torch.Generator().manual_seed(3)) - 0.5) * 0.4
    batch["generation_logprobs"] = batch["generation_logprobs"] + noise * valid
    with torch.no_grad():
        trainer_lp = token_logprobs(SPEC.build_model(), batch["input_ids"], batch["attention_mask"], temperature=1.0)
    weights = torch.exp(trainer_lp - batch["generation_logprobs"])[valid]
    model = _module()
    model.behaviour_logprobs = "engine"
    cap = _fit(model, [batch])
    got = cap.metrics[0]
    assert abs(got["train/is_weight_min"] - weights.min().item()) < 1e-5
    assert abs(got["train/is_weight_max"] - weights.max().item()) < 1e-5
    assert abs(got["train/is_weight_mean"] - weights.mean().item()) < 1e-5
    assert weights.max() > 1.15 and weights.min() < 0.85  # the noise really moved them
    assert abs(got["train/logprob_mismatch"] - noise[valid].abs().max().item()) < 1e-5


@pytest.mark.parity
def test_on_policy_tokens_agree_with_the_engine() -> None:
    """Tokens of the trainer's current version: the trainer's recomputed logprobs match the engine's."""
    meta, data = _rollouts(4, temperature=1.0, version=0)
    cap = _fit(_module(), [collate_chunk(meta, data, pad_id=0)])
    assert cap.metrics[0]["train/logprob_mismatch"] < 1e-5  # engine and trainer numerics agree


def test_stale_tokens_get_weights_from_behaviour_logprobs() -> None:
    meta, data = _rollouts(4, temperature=1.0, version=0)
    batch = collate_chunk(meta, data, pad_id=0)
    batch["trainer_version"] = 1  # the trainer moved on: version-0 tokens are now off-policy
    shifted = copy.deepcopy(batch)
    shifted["generation_logprobs"] = batch["generation_logprobs"] - 0.1 * batch["token_mask"]
    cap = _fit(_module(), [shifted])
    # w = exp(logp_old - logp_gen) = exp(0.1) for every valid token (up to engine/trainer fp noise)
    assert abs(cap.metrics[0]["train/is_weight_mean"] - float(torch.exp(torch.tensor(0.1)))) < 1e-4


def test_logprob_mismatch_leaves_out_rows_that_crossed_an_in_flight_refit() -> None:
    """Rows generated at version 0 are trained at version 1; row 0 took its last tokens after an in-flight refit (their
    version is 1, but they attended to version-0 keys and values: the engine's logprobs read 0.3 off), every other row
    was generated at version 1 from its first token. The mismatch is the clean rows' numerics alone."""
    meta, data = _rollouts(4, temperature=1.0, version=0)
    batch = collate_chunk(meta, data, pad_id=0)
    batch["trainer_version"] = 1
    valid = batch["token_mask"].bool()
    batch["token_versions"] = torch.where(valid, 1, batch["token_versions"])
    first = int(valid[0].nonzero()[0])
    batch["token_versions"][0, first] = 0  # row 0's first token: before the refit
    batch["generation_logprobs"][0] = batch["generation_logprobs"][0] - 0.3 * batch["token_mask"][0]
    clean = whole_row_on_policy(batch["token_versions"], batch["token_mask"], 1)
    assert not clean[0].any() and torch.equal(clean[1:], valid[1:])
    cap = _fit(_module(), [batch])
    assert cap.metrics[0]["train/logprob_mismatch"] < 1e-5
    # row 0's later tokens keep weight 1 in the loss (trainer side); exact: an on-policy token's behaviour logprob is
    # the trainer's own (detached) logprob, so its weight is exp(lp - lp) = exp(0) = 1
    assert cap.metrics[0]["train/is_weight_min"] == 1.0


@pytest.mark.parametrize(("source", "weight"), [("trainer", 1.0), ("engine", float(torch.exp(torch.tensor(0.05))))])
def test_behaviour_logprobs_of_on_policy_tokens_come_from_the_configured_side(source: str, weight: float) -> None:
    """An engine whose logprobs read 0.05 low on every token of the current version: ``trainer`` ignores it (IS
    weight exactly 1), ``engine`` corrects it (weight exp(0.05), as for a stale token)."""
    meta, data = _rollouts(4, temperature=1.0, version=0)
    batch = collate_chunk(meta, data, pad_id=0)
    batch["generation_logprobs"] = batch["generation_logprobs"] - 0.05 * batch["token_mask"]
    model = _module()
    model.behaviour_logprobs = source
    cap = _fit(model, [batch])
    assert abs(cap.metrics[0]["train/is_weight_mean"] - weight) < 1e-5
    assert abs(cap.metrics[0]["train/logprob_mismatch"] - 0.05) < 1e-5  # reported either way


def test_behaviour_logprobs_is_checked() -> None:
    with pytest.raises(ValueError, match=r"model.init_args.behaviour_logprobs='vllm': expected 'trainer' or"):
        GRPO(policy=SPEC, behaviour_logprobs="vllm")  # type: ignore[arg-type]


@pytest.mark.parity
def test_a_step_streamed_in_two_chunks_equals_one_chunk() -> None:
    meta, data = _rollouts(4, temperature=1.0)
    whole = collate_chunk(meta, data, pad_id=0)
    halves = []
    for lo, last in ((0, False), (2 * G, True)):
        m = {**meta, "keys": meta["keys"][lo:lo + 2 * G], "start_weight": meta["start_weight"][lo:lo + 2 * G],
             "last_chunk": last}
        halves.append(collate_chunk(m, {k: v[lo:lo + 2 * G] for k, v in data.items()}, pad_id=0))
    torch.manual_seed(0)
    one, two = _module(_SGD), _module(_SGD)
    _fit(one, [whole])
    _fit(two, halves)
    for (name, p1), (_, p2) in zip(one.model.named_parameters(), two.model.named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(one.model.parameters(), SPEC.build_model().parameters(),
                                                     strict=True))


@pytest.mark.parity
def test_micro_batches_by_token_budget_give_the_whole_chunks_update() -> None:
    meta, data = _rollouts(4, temperature=1.0)
    batch = collate_chunk(meta, data, pad_id=0)
    rows, width = batch["input_ids"].shape
    whole, split = _module(_SGD), _module(_SGD)
    assert rows == 8
    whole.micro_batch_tokens, split.micro_batch_tokens = 0, 3 * width  # 3 rows' worth: micro-batches of 3, 3, 2
    assert (whole._micro_rows(rows, width), split._micro_rows(rows, width)) == (rows, 3)
    calls = []
    trunk = split.model.base_model  # the policy's forward runs its trunk (logprobs are chunked over the head)
    forward = trunk.forward
    trunk.forward = lambda *a, **k: calls.append(k["input_ids"].shape[0]) or forward(*a, **k)  # type: ignore[method-assign]
    _fit(whole, [batch])
    _fit(split, [batch])
    assert calls == [3, 3, 2]
    for (name, p1), (_, p2) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6, msg=name)


def test_the_automatic_micro_batch_budget_is_cpu_only_and_the_setting_is_checked() -> None:
    auto = _module()
    assert auto._micro_rows(64, 68) == 32  # 4352 tokens > 4096 on a CPU: two micro-batches
    assert auto._micro_rows(32, 20) == 32
    auto.micro_batch_size = 5
    assert auto._micro_rows(64, 68) == 5  # explicit rows win
    with pytest.raises(ValueError, match=r"model.init_args.micro_batch_tokens=-1: must be >= 0"):
        GRPO(policy=SPEC, micro_batch_tokens=-1)


def test_overlong_filtering_masks_truncated_rows_from_the_loss_only() -> None:
    from screl.modules.masks import loss_sample_mask, mask_metrics

    meta, data = _rollouts(2, temperature=1.0)
    data["finish_reason"] = [torch.tensor([c]) for c in (1, 0, 1, 1)]  # length, stop, length, length
    data["sample_mask"] = [torch.tensor([m]) for m in (1.0, 1.0, 0.0, 1.0)]  # the task masked row 2
    batch = collate_chunk(meta, data, pad_id=0)
    assert loss_sample_mask(batch, overlong_filtering=False).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert loss_sample_mask(batch, overlong_filtering=True).tolist() == [0.0, 1.0, 0.0, 0.0]
    m = mask_metrics(batch, overlong_filtering=True)
    assert float(m["train/masked_fraction"]) == 0.75 and float(m["train/truncated_fraction"]) == 0.75
    # the baseline keeps every row: the advantages do not depend on the masks
    plain = _module()._chunk_tensors(batch).advantages
    filtered = _module()
    filtered.algo.overlong_filtering = True
    assert torch.equal(filtered._chunk_tensors(batch).advantages, plain)  # exact: the same ops on the same rewards


class _MaskLetter(CountLetter):
    """Count-a, whose ``masked`` flags every completion holding a 'q' (a rule on the text, as a verifier's)."""

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        return "q" in completion


def test_task_masked_samples_reach_the_trainer_through_the_workflow() -> None:
    """Task.masked, single turn: the real engine generates, SingleTurnWorkflow scores and flags, the rows collate,
    and the GRPO step reports exactly the flagged share as train/masked_fraction."""
    import asyncio

    from screl.envs import decode_completion
    from screl.rollout.workflows.workflow import RolloutItem, SingleTurnWorkflow

    engine, tok, task = TorchGenerationEngine(SPEC, seed=0), SPEC.build_tokenizer(), _MaskLetter()
    items = [RolloutItem(f"p{p.prompt_id}_g{s}", p, tuple(tok(p.text, add_special_tokens=False)["input_ids"]),
                         SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=1.0, seed=11 * i + s))
             for i, p in enumerate(task.prompts()[:4]) for s in range(G)]

    async def generate(requests: list[Any]) -> list[Any]:
        return engine.generate(requests)

    out = asyncio.run(SingleTurnWorkflow(task, tok).run(items, generate))
    assert all(o.status == "sealed" for o in out)
    texts = [decode_completion(tok, o.row["input_ids"][int(o.row["prompt_len"][0]):].tolist()) for o in out]
    flags = [t.__contains__("q") for t in texts]
    assert [float(o.row["sample_mask"][0]) for o in out] == [0.0 if f else 1.0 for f in flags]
    assert 0 < sum(flags) < len(flags), texts  # the seeds give both kinds
    data = ROW_SCHEMA.merge([o.row for o in out])
    meta = {"keys": [i.attempt for i in items], "trainer_version": 0, "step_groups": 4, "last_chunk": True,
            "start_weight": [0] * len(items)}
    cap = _fit(_module(), [collate_chunk(meta, data, pad_id=0)])
    assert cap.metrics[0]["train/masked_fraction"] == pytest.approx(sum(flags) / len(flags), abs=1e-6)


def test_a_step_whose_every_sample_is_filtered_fails_and_never_steps() -> None:
    import pytest

    meta, data = _rollouts(4, temperature=1.0)
    data["sample_mask"] = [torch.tensor([0.0]) for _ in data["sample_mask"]]
    model = _module()
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"step 0: every sample is filtered out of the loss \(8 masked"):
        _fit(model, [collate_chunk(meta, data, pad_id=0)])
    assert all(torch.equal(v, before[k]) for k, v in model.model.state_dict().items())


def _near_tie_batch() -> dict[str, Any]:
    """One group of 4 whose leave-one-out siblings nearly tie for the last row: rewards [0.1, 0.1, 0.11, 0.5]."""
    meta, data = _rollouts(2, temperature=1.0)
    data["reward"] = [torch.tensor([r]) for r in (0.1, 0.1, 0.11, 0.5)]
    batch = collate_chunk(meta, data, pad_id=0)
    batch["step_groups"] = 1
    return batch


def _group_of_four(std_floor: float) -> GRPO:
    return GRPO(policy=SPEC, loss_fn=ClippedPGLoss(), learning_rate=1e-2, max_grad_norm=None,
                algo={"num_prompts_per_step": 1, "num_generations_per_prompt": 4,
                      "adv_estimator": {"std_floor": std_floor}})


def test_an_advantage_blow_up_is_logged_and_warned_and_the_std_floor_bounds_it(
    caplog: Any,
) -> None:
    import logging
    import math

    import pytest

    # the last row's siblings [0.1, 0.1, 0.11]: baseline 0.31/3, Bessel std sqrt((2 (0.01/3)^2 + (0.02/3)^2) / 2)
    gap = 0.5 - 0.31 / 3
    std = math.sqrt((2 * (0.01 / 3) ** 2 + (0.02 / 3) ** 2) / 2)
    with caplog.at_level(logging.WARNING, logger="screl.modules.chunked"):
        cap = _fit(_group_of_four(0.0), [_near_tie_batch()])
    assert cap.metrics[0]["train/advantage_abs_max"] == pytest.approx(gap / (std + 1e-6), rel=1e-5)  # ~68.7
    warned = [r.getMessage() for r in caplog.records if "advantage of magnitude" in r.getMessage()]
    assert len(warned) == 1 and "grpo.adv_estimator.std_floor" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="screl.modules.chunked"):
        cap = _fit(_group_of_four(0.1), [_near_tie_batch()])
    assert cap.metrics[0]["train/advantage_abs_max"] == pytest.approx(gap / (0.1 + 1e-6), rel=1e-5)  # ~3.97
    assert not [r for r in caplog.records if "advantage of magnitude" in r.getMessage()]


def test_the_module_computes_advantages_with_the_named_estimator() -> None:
    """``adv_estimator.name`` picks the registered function (or a path to one): on [0.1, 0.1, 0.11, 0.5] RLOO gives
    each reward minus its siblings' mean, unnormalized (last row: 0.5 - 0.31/3); the plugin its group mean's gap."""
    import pytest

    def advantages(name: str) -> list[float]:
        module = GRPO(policy=SPEC, loss_fn=ClippedPGLoss(), algo={
            "num_prompts_per_step": 1, "num_generations_per_prompt": 4, "adv_estimator": {"name": name}})
        return module._chunk_tensors(_near_tie_batch()).advantages.tolist()

    assert advantages("rloo") == pytest.approx([0.1 - 0.71 / 3, 0.1 - 0.71 / 3, 0.11 - 0.7 / 3, 0.5 - 0.31 / 3],
                                              abs=1e-6)
    assert advantages("tests.estimator_plugins:mean_baseline") == pytest.approx(
        [0.1 - 0.2025, 0.1 - 0.2025, 0.11 - 0.2025, 0.5 - 0.2025], abs=1e-6)  # mean = 0.81 / 4
    assert max(advantages("grpo")) > 10  # the default divides by the near-tied siblings' std


def test_the_policy_entropy_over_the_trained_tokens_is_logged() -> None:
    """``train/entropy``: the mean over the chunk's trained tokens of the full distribution's entropy at the step's
    weights (one micro-batch here), from the chunked head's own softmax."""
    meta, data = _rollouts(4, temperature=1.0, version=0)
    batch = collate_chunk(meta, data, pad_id=0)
    with torch.no_grad():
        logits = SPEC.build_model()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
    full = -(logp.exp() * logp).sum(-1)
    mask = batch["token_mask"].float()
    expected = float((full * mask).sum() / mask.sum())
    cap = _fit(_module(), [batch])
    assert abs(cap.metrics[0]["train/entropy"] - expected) < 2e-5, (cap.metrics[0]["train/entropy"], expected)
    assert 0.5 < expected < 4.0  # a spread distribution: the figure says something
