"""A mixture-of-experts policy and rollout routing replay (R3), without Ray: the tiny Qwen3-MoE, the routers'
record and replay, the torch engine's routing record, the rows that carry it, and GRPO's replayed forward."""

from __future__ import annotations

import pytest
import torch

from screl.models.moe import TinyMoECausalLM, moe_routers, record_routing, replay_routing, replay_rows
from screl.rollout import GenerationRequest, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import ROUTING_SCHEMA

SPEC = TinyMoECausalLM(num_experts=8, top_k=2)
IDS = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return SPEC.build_model().eval()


@pytest.mark.parity
def test_recording_leaves_the_forward_unchanged_and_replaying_it_gives_the_same_logits(model: torch.nn.Module) -> None:
    with torch.no_grad():
        plain = model(IDS).logits
        with record_routing(model) as calls:
            recorded = model(IDS).logits
        with replay_routing(model, [c[0] for c in calls]):
            replayed = model(IDS).logits
    assert len(calls) == len(moe_routers(model)) == 2 and calls[0][0].shape == (20, 2)
    # exact: the patched router runs the class forward's ops (linear, fp32 softmax, top-k, renormalize) and a replay
    # of its own choice gathers the very probabilities top-k returned; the rest of the model is untouched
    assert torch.equal(plain, recorded) and torch.equal(plain, replayed)
    assert all(len(set(c[0][t].tolist())) == 2 for c in calls for t in range(20))  # top-2: two distinct experts


def test_forced_experts_change_the_logits_and_minus_one_keeps_the_routers_choice(model: torch.nn.Module) -> None:
    with torch.no_grad():
        plain = model(IDS).logits
        with record_routing(model) as calls:
            model(IDS)
        own = [c[0] for c in calls]
        other = [(c + 1) % 8 for c in own]  # every token to two other experts
        with replay_routing(model, other):
            forced = model(IDS).logits
        with replay_routing(model, [torch.full_like(c, -1) for c in own]):
            unforced = model(IDS).logits
    assert (forced - plain).abs().max() > 1e-3
    assert torch.equal(unforced, plain)  # exact: -1 keeps the router's own experts, the same ops as above
    with pytest.raises(RuntimeError, match="already being recorded or replayed"), record_routing(model):
        with replay_routing(model, other):
            pass
    assert all("forward" not in vars(r) for r in moe_routers(model))  # both blocks undone


def test_replay_refuses_experts_of_the_wrong_shape(model: torch.nn.Module) -> None:
    with record_routing(model) as calls, torch.no_grad():
        model(IDS)
    with pytest.raises(ValueError, match=r"experts for 1 layer\(s\), the model routes in 2"):
        with replay_routing(model, [calls[0][0]]):
            pass
    with pytest.raises(ValueError, match=r"the forced experts have shape \(19, 2\), the router sees 20 tokens"):
        with replay_routing(model, [c[0][:19] for c in calls]), torch.no_grad():
            model(IDS)


@pytest.mark.parity
def test_the_torch_engine_records_every_fed_positions_routing_and_the_trainer_replays_it_exactly() -> None:
    engine = TorchGenerationEngine(SPEC, decode="hf", record_routing=True, seed=0)
    trainer = SPEC.build_model().eval()
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=8, seed=i))
            for i, p in enumerate([[5, 9, 17, 3], [7, 8], [12, 4, 4, 4, 20, 21]])]
    results = engine.generate(reqs)  # left-padded prompts of three lengths in one batch
    for r in results:
        n = len(r.prompt_token_ids) + len(r.token_ids)
        assert r.routing is not None and tuple(r.routing.shape) == (n, 2, 2) and r.routing.dtype == torch.int16
        assert (r.routing[:-1] >= 0).all() and (r.routing[-1] == -1).all()  # the last sampled token was never fed
        seq = torch.tensor([r.prompt_token_ids + r.token_ids])
        with torch.no_grad(), record_routing(trainer) as own:
            trainer(seq)
        assert torch.equal(torch.stack([c[0] for c in own], 1)[:-1], r.routing[:-1].long())  # fp32 both sides
        row = ROUTING_SCHEMA.build(r, 1.0)
        assert torch.equal(row["routing"], r.routing)
        with torch.no_grad(), replay_rows(trainer, row["routing"][None].long()):
            logits = trainer(seq).logits[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(1, seq[0, 1:, None])[:, 0][len(r.prompt_token_ids) - 1:]
        assert (lp - torch.tensor(r.logprobs)).abs().max() < 1e-5


def test_routing_rows_collate_right_padded_with_minus_one() -> None:
    rows = [torch.arange(12, dtype=torch.int16).reshape(3, 2, 2), torch.zeros((5, 2, 2), dtype=torch.int16)]
    data = {"input_ids": [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3, 4, 5])], "prompt_len": [torch.tensor([2])] * 2,
            "loss_mask": [torch.ones(1), torch.ones(3)], "generation_logprobs": [torch.zeros(1), torch.zeros(3)],
            "token_versions": [torch.zeros(1, dtype=torch.long), torch.zeros(3, dtype=torch.long)],
            "reward": [torch.ones(1)] * 2, "raw_reward": [torch.ones(1)] * 2, "finish_reason": [torch.zeros(1)] * 2,
            "sample_mask": [torch.ones(1)] * 2, "routing": rows}
    out = ROUTING_SCHEMA.collate({"keys": ["a", "b"], "trainer_version": 0, "start_weight": [0, 0]}, data, 0)
    assert out["routing"].shape == (2, 5, 2, 2)
    assert torch.equal(out["routing"][0, :3], rows[0]) and (out["routing"][0, 3:] == -1).all()


def test_grpo_refuses_routing_replay_without_experts_or_with_checkpointing() -> None:
    from screl import GRPO
    from screl.models import TinyCausalLM

    with pytest.raises(ValueError, match=r"routing_replay: true needs a mixture-of-experts policy"):
        GRPO(policy=TinyCausalLM(), routing_replay=True)
    with pytest.raises(ValueError, match=r"routing_replay: true with activation_checkpointing='full'"):
        GRPO(policy=SPEC, routing_replay=True, activation_checkpointing=True)
    module = GRPO(policy=SPEC, routing_replay=True)
    assert "routing" in module.row_schema.names
    with pytest.raises(ValueError, match=r"the chunk's rows carry no routing"):
        from screl.modules.routing_replay import replayed

        replayed(True, module.model, {"input_ids": IDS}, slice(0, 2))
