"""GRPO's policy under MegatronStrategy: the provider fitted to the policy (architecture fields, activation
recompute) and the layouts it refuses, both at setup and in ``screl check``."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from _check_helpers import run_check as _check

ROOT = Path(__file__).resolve().parents[1]
CP_KEY = "trainer.strategy.init_args.parallelism.context_parallel_size"


def _megatron_tiny() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "configs" / "grpo_megatron_tiny.yaml").read_text())  # type: ignore[no-any-return]


def test_screl_check_refuses_context_parallel_grpo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = copy.deepcopy(_megatron_tiny())
    cfg["trainer"]["strategy"]["init_args"]["parallelism"] = {"context_parallel_size": 2}
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc != 0, out
    lines = [line for line in out.splitlines() if f"{CP_KEY} = 2" in line]
    assert lines, out
    assert "does not support context parallelism" in lines[0]
    assert "Fix: set context_parallel_size: 1" in lines[0]


def test_screl_check_passes_context_parallel_size_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = copy.deepcopy(_megatron_tiny())
    cfg["trainer"]["strategy"]["init_args"]["parallelism"]["context_parallel_size"] = 1
    rc, out = _check(cfg, tmp_path, capsys)
    assert CP_KEY not in out
    assert rc == 0, out


def _tiny_policy() -> Any:
    from screl.models import TinyCausalLM

    return TinyCausalLM(scale="tiny").build_model()


def _strategy(provider: Any = None, cp: int = 1) -> SimpleNamespace:
    from screl.strategies import GPTModelProvider, ParallelismConfig

    return SimpleNamespace(
        model_provider=provider or GPTModelProvider(),
        model_provider_is_default=provider is None,
        parallelism=ParallelismConfig(context_parallel_size=cp),
    )


def test_context_parallel_policy_is_refused_at_setup() -> None:
    from screl.modules.megatron_policy import fit_provider_to_policy

    with pytest.raises(ValueError, match=r"context_parallel_size=2: GRPO under MegatronStrategy does not support "
                                         r"context parallelism.*Fix: set context_parallel_size: 1"):
        fit_provider_to_policy(_strategy(cp=2), _tiny_policy())


@pytest.mark.parametrize(
    ("knob", "expected"),
    [
        (None, (None, None, None)),
        ("full", ("full", "uniform", 1)),
        (True, ("full", "uniform", 1)),
        ("selective", ("selective", None, None)),
    ],
)
def test_activation_checkpointing_reaches_the_derived_provider(knob: Any, expected: tuple[Any, ...]) -> None:
    from screl.modules.megatron_policy import fit_provider_to_policy

    strategy = _strategy()
    fit_provider_to_policy(strategy, _tiny_policy(), recompute_granularity=knob)
    p = strategy.model_provider
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == expected
    assert p.hidden_size == 64 and not strategy.model_provider_is_default


def test_activation_checkpointing_reaches_an_explicit_provider() -> None:
    from screl.strategies import GPTModelProvider

    from screl.modules.megatron_policy import fit_provider_to_policy

    policy = _tiny_policy()
    strategy = _strategy(GPTModelProvider.from_hf_config(policy.config, layer_spec="local"))
    fit_provider_to_policy(strategy, policy, recompute_granularity="selective")
    assert strategy.model_provider.recompute_granularity == "selective"
    assert strategy.model_provider.layer_spec == "local"  # the explicit provider's own knobs stay


def test_unknown_activation_checkpointing_is_refused() -> None:
    from screl.modules.megatron_policy import fit_provider_to_policy

    with pytest.raises(ValueError, match=r"activation_checkpointing='sometimes' under MegatronStrategy must be"):
        fit_provider_to_policy(_strategy(), _tiny_policy(), recompute_granularity="sometimes")


def test_an_explicit_provider_with_implicit_head_width_still_matches() -> None:
    """``kv_channels=None`` means hidden/heads: a provider written without it matches a policy of that width."""
    from screl.strategies import GPTModelProvider

    from screl.modules.megatron_policy import fit_provider_to_policy

    policy = _tiny_policy()
    derived = GPTModelProvider.from_hf_config(policy.config)
    assert derived.kv_channels == 16
    fit_provider_to_policy(_strategy(dataclasses.replace(derived, kv_channels=None)), policy)
    with pytest.raises(ValueError, match=r"kv_channels=8 \(policy: 16\)"):
        fit_provider_to_policy(_strategy(dataclasses.replace(derived, kv_channels=8)), policy)


def test_arch_fields_cover_everything_from_hf_config_derives() -> None:
    """An explicit provider is checked on every field the mapping sets, so none can silently differ."""
    from screl.strategies.hf_config import provider_kwargs
    from transformers import LlamaConfig

    from screl.modules.megatron_policy import ARCH_FIELDS

    llama3 = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    assert set(provider_kwargs(llama3)) == set(ARCH_FIELDS)
