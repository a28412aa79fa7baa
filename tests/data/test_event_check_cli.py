"""`screl events check`: exit codes, the sampler from the run's config.yaml or --sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_event_log import _step

from screl.data import CommitEvent, Event, ReserveEvent, SelectEvent, TrainStepEvent
from screl.data.event_check_cli import main


def _write_run(tmp_path: Path, events: list[Event], config: str | None = None) -> Path:
    (tmp_path / "events.jsonl").write_text("".join(e.to_json() + "\n" for e in events), encoding="utf-8")
    if config is not None:
        (tmp_path / "config.yaml").write_text(config, encoding="utf-8")
    return tmp_path


CONFIG_YAML = """
data:
  init_args:
    async_rl:
      sampler: {name: in_order, max_lookahead_versions: 1}
      max_buffered_rollouts: 4
"""


def test_cli_ok_run_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path, _step(0, [("a", 0)]), CONFIG_YAML)
    assert main(["check", str(run), "--final"]) == 0
    out = capsys.readouterr().out
    assert "sampler in_order" in out and "OK: no violations" in out


def test_cli_reports_violations_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path, _step(0, [("a", 0)]) + [TrainStepEvent(step=1, group_ids=("a",))], CONFIG_YAML)
    assert main(["check", str(run / "events.jsonl")]) == 1
    assert "[trained-twice]" in capsys.readouterr().out


def test_cli_sampler_flag_overrides_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=1),
        CommitEvent(group_id="a", end_weight=0),
        SelectEvent(trainer_version=0, group_ids=("a",)),
    ]
    run = _write_run(tmp_path, log, CONFIG_YAML)
    assert main(["check", str(run)]) == 1
    assert main(["check", str(run), "--sampler", json.dumps({"name": "ready_first"})]) == 0
    capsys.readouterr()


def test_cli_missing_log_exits_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path)]) == 2
    assert "no event log at" in capsys.readouterr().err
