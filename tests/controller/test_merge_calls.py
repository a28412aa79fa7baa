"""The controller merges the groups it sends one worker at once into as few calls as the batch size allows."""

from __future__ import annotations

from screl.controller.controller import merge_group_calls
from screl.data.core_types import Dispatch


def _calls(*groups: tuple[str, int, float, int], step: int = 0) -> dict[tuple[str, int, float], list[Dispatch]]:
    return {(g, w, delay): [Dispatch(f"{g}_a{i}", g, i, 0, i, step, w, delay) for i in range(n)]
            for g, w, delay, n in groups}


def _shape(calls: dict[tuple[str, int, float], list[Dispatch]]) -> list[tuple[int, float, list[str]]]:
    return [(w, delay, [d.attempt for d in ds]) for (_, w, delay), ds in calls.items()]


def test_groups_for_one_worker_merge_up_to_the_batch_size_in_dispatch_order() -> None:
    merged = merge_group_calls(_calls(("a", 0, 0.0, 4), ("b", 1, 0.0, 4), ("c", 0, 0.0, 4), ("d", 0, 0.0, 4)), 8)
    assert _shape(merged) == [
        (0, 0.0, ["a_a0", "a_a1", "a_a2", "a_a3", "c_a0", "c_a1", "c_a2", "c_a3"]),
        (1, 0.0, ["b_a0", "b_a1", "b_a2", "b_a3"]),
        (0, 0.0, ["d_a0", "d_a1", "d_a2", "d_a3"]),  # the first call was full
    ]


def test_retries_with_a_backoff_and_oversized_groups_keep_their_own_calls() -> None:
    merged = merge_group_calls(_calls(("a", 0, 0.5, 2), ("b", 0, 0.0, 10), ("c", 0, 0.0, 2), ("e", 0, 0.5, 2)), 8)
    assert [(w, delay, len(ds)) for w, delay, ds in _shape(merged)] == [(0, 0.5, 2), (0, 0.0, 10), (0, 0.0, 2),
                                                                         (0, 0.5, 2)]


def test_groups_of_different_steps_never_share_a_call() -> None:
    calls = _calls(("a", 0, 0.0, 2)) | _calls(("b", 0, 0.0, 2), step=1) | _calls(("c", 0, 0.0, 2))
    assert _shape(merge_group_calls(calls, 64)) == [(0, 0.0, ["a_a0", "a_a1", "c_a0", "c_a1"]),
                                                     (0, 0.0, ["b_a0", "b_a1"])]
