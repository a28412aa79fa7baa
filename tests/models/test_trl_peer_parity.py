"""screl's model, tokenizer, prompts and rewards equal the TRL benchmark peer's (read from its source)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from screl.envs import Addition, CountLetter, arithmetic_prompts
from screl.models import CHARS, MODEL_SCALES, SPECIAL_TOKENS


def test_model_and_tokenizer_definitions(trl_peer: dict[str, Any]) -> None:
    assert MODEL_SCALES["tiny"] == trl_peer["MODEL_KWARGS"]
    assert MODEL_SCALES["small"] == trl_peer["SMALL_KWARGS"]
    assert list(SPECIAL_TOKENS) == trl_peer["SPECIAL_TOKENS"] and CHARS == trl_peer["CHARS"]


def test_rewards_equal_the_peer_functions(trl_peer: dict[str, Any]) -> None:
    prompts = arithmetic_prompts()
    completions = ["", "a", "aaa", "7", "18", "1", "0a", "abca", " 10", "12?", "<x>", "9a9a9"]
    pairs = [(p, c) for p in prompts[::7] for c in completions]
    a = [p.metadata["a"] for p, _ in pairs]
    b = [p.metadata["b"] for p, _ in pairs]
    comps = [c for _, c in pairs]
    assert Addition().rewards([p for p, _ in pairs], comps) == trl_peer["reward_add"](comps, a=a, b=b)
    # exact: both are the one correctly rounded division count / max(1, len) of the same Python ints
    assert CountLetter("a").rewards([p for p, _ in pairs], comps) == trl_peer["reward_count_a"](comps)


def test_the_repositorys_peer_is_the_shared_one() -> None:
    """The tests read ``bench/trl_peer.py`` (so a fresh clone runs them); it must be the project's shared peer,
    byte for byte, wherever that one is checked out beside the repository."""
    repo = Path(__file__).resolve().parents[2]
    shared = repo.parent / "shared" / "bench" / "trl_peer.py"
    if not shared.is_file():
        pytest.skip(f"no shared peer at {shared} to compare with (a clone without ../shared)")
    assert (repo / "bench" / "trl_peer.py").read_bytes() == shared.read_bytes(), "copy ../shared/bench/trl_peer.py"
