"""`screl plot`: the PNGs exist and plots.json holds exactly the series read from the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from screl.cli import main
from screl.data.events import EventLogWriter, ReserveEvent, TrainStepEvent

HEADER = "step,reward,train/raw_reward,rollout/buffer_fill,rollout/inflight,rollout/wait_s,time/train_step_s," \
         "rollout/generation_s,train/is_weight_p10,train/is_weight_p50,train/is_weight_p90,train/is_weight_max"


def _run(root: Path, rewards: list[float], starts: list[int]) -> Path:
    """A run directory as `screl fit` leaves it: one metrics row and one trained group per step."""
    run = root / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    lines = [HEADER] + [f"{s},{r},{r / 2},{s + 1},{2 * s},0.5,1.5,0.25,0.9,1.0,1.1,1.5" for s, r in enumerate(rewards)]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    with (run / "events.jsonl").open("w") as fh:
        w = EventLogWriter(fh)
        for step, start in enumerate(starts):
            w.write(ReserveEvent(group_id=f"g{step}", prompt_id=step, start_weight=start, time=10.0 + step))
            w.write(TrainStepEvent(step=step, group_ids=(f"g{step}",), time=12.0 + 2 * step))
    return run


def test_plot_writes_every_chart_and_the_series_it_drew(tmp_path: Path) -> None:
    _run(tmp_path / "sync", [0.1, 0.2, 0.4], [0, 1, 2])
    asyn = _run(tmp_path / "async", [0.1, 0.3, 0.5], [0, 0, 1])
    out = tmp_path / "plots"
    assert main(["plot", str(tmp_path / "sync"), str(asyn), "--labels", "sync", "async", "--out", str(out)]) == 0
    for name in ("reward", "staleness", "is_weights", "buffer", "timeline"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    data = json.loads((out / "plots.json").read_text())
    assert data["sync"]["reward"] == {"step": [0.0, 1.0, 2.0], "reward": [0.1, 0.2, 0.4]}
    assert data["async"]["raw_reward"]["train/raw_reward"] == [0.05, 0.15, 0.25]
    # staleness = train step - start weight of each trained group, from events.jsonl
    assert data["sync"]["staleness"] == [0.0, 0.0, 0.0] and data["async"]["staleness"] == [0.0, 1.0, 1.0]
    # reward against wall time: each step at its train_step, counted from the first event (t = 10)
    assert data["async"]["reward_time"] == {"time_s": [2.0, 4.0, 6.0], "reward": [0.1, 0.3, 0.5]}
    assert data["sync"]["is_weights"]["p90"] == [1.1, 1.1, 1.1] and data["sync"]["inflight"]["rollout/inflight"] == [
        0.0, 2.0, 4.0]


def test_plot_names_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no metrics.csv or events.jsonl: not a screl run directory"):
        main(["plot", str(tmp_path)])
