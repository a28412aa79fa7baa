"""Routing replay is exact or refused: every router class in ``screl.models.moe.REPLAYS`` is proven here on a tiny
model of its family (built from the family's transformers config class): replaying the model's own expert choices
gives its own logits bit for bit (fp32), and other experts other logits. Any other router is refused by the trainer
and by ``screl check``, naming the key and the router and MoE block classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _check_helpers import load_config, run_check
from torch import Tensor

from screl.models import moe
from screl.models.moe import (
    REPLAYS,
    config_replay_problem,
    moe_routers,
    record_routing,
    replay_problem,
    replay_routing,
)

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
_SIZES: dict[str, Any] = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "num_experts_per_tok": 2, "max_position_embeddings": 64,
                          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _qwen2(norm: bool) -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**_SIZES, num_experts=8, intermediate_size=32, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=norm)


def _qwen3() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_SIZES, num_experts=8, intermediate_size=32, moe_intermediate_size=32, head_dim=8,
                          decoder_sparse_step=1, norm_topk_prob=True)


def _mixtral(**extra: Any) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(**_SIZES, num_local_experts=8, intermediate_size=32, **extra)


def _olmoe() -> Any:
    from transformers import OlmoeConfig

    return OlmoeConfig(**_SIZES, num_experts=8, intermediate_size=32)


FAMILIES = {"qwen2_moe": lambda: _qwen2(False), "qwen2_moe_norm_topk": lambda: _qwen2(True), "qwen3_moe": _qwen3,
            "mixtral": _mixtral, "olmoe": _olmoe}


def _model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():  # transformers leaves some routers at zero (every expert tied): draw them
            for router in moe_routers(model):
                router.weight.normal_(0.0, 0.5)  # type: ignore[operator]
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module]:
    return request.param, _model(FAMILIES[request.param]())


@pytest.mark.parity
def test_replaying_a_models_own_choices_gives_its_own_logits_bit_for_bit(family: tuple[str, torch.nn.Module]) -> None:
    name, model = family
    assert replay_problem(model) is None, name
    with torch.no_grad():
        plain = model(IDS).logits
        with record_routing(model) as calls:
            recorded = model(IDS).logits
        own = [c[0] for c in calls]
        with replay_routing(model, own):
            replayed = model(IDS).logits
        with replay_routing(model, [(c + 1) % 8 for c in own]):
            other = model(IDS).logits
    assert len(own) == 2 and own[0].shape == (24, 2)
    assert torch.equal(plain, recorded), f"{name}: recording changed the forward"
    assert torch.equal(plain, replayed), f"{name}: replaying its own routing changed the logits"
    assert (other - plain).abs().max() > 1e-3, f"{name}: forced experts were not used"


def test_every_registered_router_is_proven_above() -> None:
    proven = {moe._class_path(r) for make in FAMILIES.values() for r in moe_routers(_meta(make()))}
    assert proven == set(REPLAYS), "a REPLAYS entry without its exactness case in FAMILIES (or the reverse)"


def _meta(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)  # type: ignore[no-any-return]


def _qwen_gate_on_mixtral(router: Any, hidden: Tensor, forced: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The replay screl had before the registry: Qwen's gate, renormalizing only where ``norm_topk_prob`` is."""
    logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, index = moe._choose(probs, router.top_k, forced)
    if getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def test_the_exactness_check_sees_a_replay_that_computes_another_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(_mixtral())
    with torch.no_grad():
        plain = model(IDS).logits
        with record_routing(model) as calls:
            model(IDS)
        key = moe._class_path(moe_routers(model)[0])
        monkeypatch.setitem(REPLAYS, key, _qwen_gate_on_mixtral)
        with replay_routing(model, [c[0] for c in calls]):
            wrong = model(IDS).logits
    assert not torch.equal(plain, wrong)  # the same experts, weights not renormalized: another model


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(**_SIZES, num_local_experts=8, intermediate_size=32, head_dim=8, layer_types=None)


def test_a_router_outside_the_registry_is_refused_naming_its_classes() -> None:
    from screl.modules.routing_replay import check_routing_replay

    model = _meta(_gpt_oss())  # top-k of the logits (with a bias), then a softmax over the k: not Qwen's gate
    problem = config_replay_problem(_gpt_oss())
    assert problem is not None and "router GptOssTopKRouter (in GptOssMLP)" in problem
    with pytest.raises(ValueError, match=r"routing_replay: true on GptOssForCausalLM: its router GptOssTopKRouter "
                                         r"\(in GptOssMLP\) computes a gate routing replay does not reproduce"):
        check_routing_replay(True, model, None)
    with pytest.raises(ValueError, match=r"router \['GptOssTopKRouter'\] is not one routing replay reproduces"):
        with record_routing(model):
            pass
    assert check_routing_replay(False, model, None) is False


def test_mixtral_with_router_jitter_is_refused() -> None:
    problem = config_replay_problem(_mixtral(router_jitter_noise=0.1))
    assert problem is not None and "MixtralSparseMoeBlock multiplies its input by random jitter" in problem
    assert config_replay_problem(_mixtral()) is None


def _twin_config(tmp_path: Path, config: Any) -> dict[str, Any]:
    """``grpo_moe_tiny.yaml`` with its policy a ``ShapeTwin`` of ``config`` (a config.json, shrunk)."""
    config.save_pretrained(tmp_path / "src")
    cfg = load_config("grpo_moe_tiny.yaml")
    cfg["model"]["init_args"]["policy"] = {"class_path": "screl.models.ShapeTwin",
                                           "init_args": {"config": str(tmp_path / "src")}}
    return cfg


def test_screl_check_refuses_replay_on_a_router_outside_the_registry(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_check(_twin_config(tmp_path, _gpt_oss()), tmp_path, capsys)
    assert rc == 2, out
    assert "model.init_args.routing_replay = True: replay would not be exact on screl.models.ShapeTwin" in out
    assert "GptOssTopKRouter (in GptOssMLP)" in out and "screl.models.moe.REPLAYS" in out


def test_screl_check_accepts_replay_on_a_registered_family(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_check(_twin_config(tmp_path, _mixtral()), tmp_path, capsys)
    assert json.loads((tmp_path / "src" / "config.json").read_text())["model_type"] == "mixtral"
    assert rc == 0, out
