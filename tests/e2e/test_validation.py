"""Validation during training end to end: val/* in metrics.csv at the validated versions, the pin in
events.jsonl, training events untouched in sync mode (the resume of a validation: tests/recovery)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events
from screl.envs import CountLetter

from .conftest import base_config, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

SYNC = {"name": "in_order", "max_lookahead_versions": 0}
HOLDOUT = 8


def _config(run_dir: Path, steps: int, validation: dict[str, Any] | None) -> dict[str, Any]:
    cfg = base_config(run_dir)
    cfg["data"]["init_args"]["generation"]["injected_latency_s"] = 0.0  # sync: nothing to reorder
    cfg["trainer"]["max_steps"] = steps
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.CountLetter",
                                        "init_args": {"letter": "a", "holdout": HOLDOUT}}
    cfg["async_rl"]["sampler"] = SYNC
    cfg["model"]["init_args"]["loss_fn"]["init_args"] = {"use_importance_sampling_correction": False}
    cfg["grpo"]["max_num_steps"] = steps
    cfg["grpo"].update(validation or {})
    return cfg


def _events(run_dir: Path) -> list[Any]:
    return [parse_event(line) for _, line in read_events(run_dir)]


def _training_trace(events: list[Any]) -> list[tuple[Any, ...]]:
    """The training events without times or the run's group-id prefix: what validation must not change."""
    def gid(g: str) -> str:
        return g.split("-", 1)[1]

    out: list[tuple[Any, ...]] = []
    for e in events:
        if e.name == "reserve":
            out.append(("reserve", gid(e.group_id), e.prompt_id, e.target_step, e.start_weight))
        elif e.name in ("select", "train_step"):
            out.append((e.name, tuple(gid(g) for g in e.group_ids)))
        elif e.name in ("admit", "refit"):
            out.append((e.name, e.trainer_version))
    return out


def test_val_period_logs_the_validated_versions_and_leaves_training_alone(tmp_path: Path) -> None:
    steps = 5  # validations at the start, every val_period (2, 4) and at the end (5, not a multiple of the period)
    val = {"val_period": 2, "val_at_start": True, "val_at_end": True,
           "validation": {"num_samples": 2, "temperature": 1.0, "pass_threshold": 0.25}}
    (tmp_path / "val").mkdir()
    run_dir = run_fit(_config(tmp_path / "val", steps, val), tmp_path / "val")
    rows = [r for r in metrics(run_dir) if "val/version" in r]
    assert [(r["step"], r["val/version"]) for r in rows] == [(v, v) for v in (0.0, 2.0, 4.0, 5.0)]
    for r in rows:
        assert r["val/prompts"] == HOLDOUT and 0.0 <= r["val/pass@1"] <= r["val/pass@2"] <= 1.0
        assert 0.0 < r["val/response_length"] <= 8.0 and 0.0 <= r["val/truncated_fraction"] <= 1.0
    events = _events(run_dir)
    validations = [e for e in events if e.name == "validate"]
    assert [e.trainer_version for e in validations] == [0, 2, 4, 5]
    assert all(e.extra["token_versions"] == [e.trainer_version] and e.extra["samples"] == 2 * HOLDOUT
               for e in validations), "every validation token came from the version it names"
    held = {p.prompt_id for p in CountLetter(holdout=HOLDOUT).val_prompts()}
    assert not held & {e.prompt_id for e in events if e.name == "reserve"}, "held-out prompts never train"
    assert check_events(run_dir, SYNC, final=True).ok

    (tmp_path / "plain").mkdir()
    plain_dir = run_fit(_config(tmp_path / "plain", steps, None), tmp_path / "plain")
    assert _training_trace(_events(plain_dir)) == _training_trace(events), "validation changed the training"
    assert not any("val/version" in r for r in metrics(plain_dir))


def test_validation_in_an_async_run_is_pinned_while_rollouts_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also the loggers from config: CSV (the default), TensorBoard and an offline W&B run side by side, as
    docs/running.md shows."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    cfg = _config(tmp_path / "run", 4, {"val_period": 2})
    cfg["async_rl"]["sampler"] = {"name": "in_order", "max_lookahead_versions": 1}
    cfg["model"]["init_args"]["loss_fn"]["init_args"] = {"use_importance_sampling_correction": True}
    root = str(tmp_path / "run")
    cfg["trainer"]["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": root}},
                                {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                 "init_args": {"save_dir": root, "name": "tb"}},
                                {"class_path": "lightning.pytorch.loggers.WandbLogger",
                                 "init_args": {"save_dir": root, "offline": True}}]
    run_dir = run_fit(cfg, tmp_path)
    assert list((tmp_path / "run").rglob("metrics.csv"))
    assert list((tmp_path / "run").rglob("*.wandb")), "no offline wandb run was written"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(next((tmp_path / "run" / "tb").rglob("events.out.tfevents.*")).parent)).Reload()
    assert [(s.step, s.value) for s in tb.Scalars("val/version")] == [(2, 2.0), (4, 4.0)]
    assert len(tb.Scalars("reward")) == 4
    events = _events(run_dir)
    assert [(e.trainer_version, e.extra["token_versions"]) for e in events if e.name == "validate"] == [
        (2, [2]), (4, [4])]
    # the lookahead kept generating: step 2's rollouts (target step 3) were reserved before validation 2 ended
    v2 = next(i for i, e in enumerate(events) if e.name == "validate" and e.trainer_version == 2)
    refit2 = next(i for i, e in enumerate(events) if e.name == "refit" and e.trainer_version == 2)
    assert any(e.name == "reserve" for e in events[refit2:v2]), "rollouts waited for validation"
    assert check_events(run_dir, cfg["async_rl"]["sampler"], final=True).ok
