"""windowed's over_sampling_ratio end to end: the cap holds in events.jsonl and fewer groups go to waste."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events

from .conftest import base_config, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

P = 4


def _run(tmp_path: Path, ratio: float | None) -> tuple[int, float, bool]:
    """(most groups outstanding at once, evicted share of reserved groups, events check ok)."""
    cfg = base_config(tmp_path / "run")
    sampler: dict[str, Any] = {"name": "windowed", "max_staleness_versions": 0}
    if ratio is not None:
        sampler["over_sampling_ratio"] = ratio
    cfg["async_rl"].update(sampler=sampler, max_inflight_prompts=16, max_buffered_rollouts=16)
    cfg["trainer"]["max_steps"] = 6
    cfg["grpo"]["max_num_steps"] = 6
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_dir = run_fit(cfg, tmp_path)
    outstanding, peak, reserved, evicted = 0, 0, 0, 0
    for _, line in read_events(run_dir):
        e = parse_event(line)
        if e.name == "reserve":
            outstanding, reserved = outstanding + 1, reserved + 1
            peak = max(peak, outstanding)
        elif e.name == "select":
            outstanding -= len(e.group_ids)
        elif e.name in ("evict", "abort", "drop") and getattr(e, "reason", None) != "shutdown":
            outstanding -= 1
            evicted += e.name != "drop"
        elif e.name in ("evict", "abort"):
            outstanding -= 1
    return peak, evicted / max(reserved, 1), check_events(run_dir, sampler, final=True).ok


def test_the_over_sampling_cap_holds_and_wastes_less(tmp_path: Path) -> None:
    ratio = 1.5
    capped_peak, capped_waste, capped_ok = _run(tmp_path / "capped", ratio)
    free_peak, free_waste, free_ok = _run(tmp_path / "free", None)
    assert capped_ok and free_ok
    assert capped_peak <= math.ceil(ratio * P) < free_peak
    assert capped_waste < free_waste, (capped_waste, free_waste)
