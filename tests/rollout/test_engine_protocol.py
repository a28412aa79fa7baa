from __future__ import annotations

from typing import Any

import pytest

from screl.rollout import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens=5"),
        ({"min_new_tokens": -1}, "min_new_tokens=-1"),
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": 0}, "top_k=0"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_request() -> None:
    sp = SamplingParams()
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_new_tokens, sp.seed) == (
        16,
        1.0,
        1.0,
        None,
        0,
        None,
    )
    req = GenerationRequest("r0", [5, 6])
    assert req.sampling == sp


def test_weight_version_spans() -> None:
    res = GenerationResult("r", [1], [4, 5, 6, 7], [0.0] * 4, "length", [0, 0, 2, 2], 0, 2)
    assert res.weight_version_spans() == [(0, 0, 2), (2, 2, 4)]
    empty = GenerationResult("r", [1], [], [], "abort", [], 3, 3)
    assert empty.weight_version_spans() == []


def test_protocol_is_runtime_checkable() -> None:
    assert not isinstance(object(), GenerationEngine)
