"""The controller merges the groups it sends one worker at once into as few calls as the batch size allows."""

from __future__ import annotations

from screl.controller.dispatch import merge_group_calls, plan_calls
from screl.data.core_types import Burst, Dispatch


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


def test_each_workers_immediate_calls_form_one_burst_and_retries_none() -> None:
    dispatches = [d for ds in _calls(("a", 0, 0.0, 2), ("b", 1, 0.0, 2), ("c", 0, 0.5, 2)).values() for d in ds]
    calls = plan_calls(dispatches, merge=False, max_rows=64, burst_ids=iter(range(10, 20)))
    assert [(c.worker, c.delay_s, c.burst) for c in calls] == [(0, 0.0, Burst(10, 1)), (1, 0.0, Burst(11, 1)),
                                                              (0, 0.5, None)]
    merged = plan_calls(dispatches + [Dispatch("d_a0", "d", 0, 0, 0, 0, 0)], merge=True, max_rows=64,
                        burst_ids=iter(range(3)))
    assert [(c.worker, [d.attempt for d in c.dispatches], c.burst) for c in merged] == [
        (0, ["a_a0", "a_a1", "d_a0"], Burst(0, 1)), (1, ["b_a0", "b_a1"], Burst(1, 1)), (0, ["c_a0", "c_a1"], None)]


def test_groups_merge_only_for_an_engine_that_decodes_a_call_to_its_end() -> None:
    """The controller merges when the engine declares ``whole_call_batches`` (resolved on the driver) and nothing
    makes a step's groups land apart (another workflow, injected latency)."""
    from screl.config import GenerationConfig
    from screl.controller.dispatch import groups_land_together
    from screl.rollout.engines.registry import engine_capabilities

    plain = GenerationConfig()
    assert engine_capabilities("torch").whole_call_batches
    assert not engine_capabilities("megatron").whole_call_batches  # as before: only the torch engine merged
    assert not engine_capabilities("tests.engine_plugins.PlainEngine").whole_call_batches
    assert groups_land_together(plain, whole_call_batches=True)
    assert not groups_land_together(plain, whole_call_batches=False)
    assert not groups_land_together(GenerationConfig(injected_latency_s=0.1), whole_call_batches=True)
    assert not groups_land_together(GenerationConfig(workflow="screl.rollout.MultiTurnWorkflow"), whole_call_batches=True)
