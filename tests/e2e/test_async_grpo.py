"""Async GRPO end to end: real Ray, real TransferQueue, real Trainer, a latency-injecting engine."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from lightning.pytorch import Callback

from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events
from screl.dataplane import tq_actors_alive
from screl.threads import available_cores

from .conftest import base_config, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

IS_KEY = "use_importance_sampling_correction"

MODES: dict[str, tuple[dict[str, Any], int, bool]] = {
    # name: (sampler block, min_groups_for_streaming_train, IS correction)
    "sync_in_order_w0": ({"name": "in_order", "max_lookahead_versions": 0}, 4, False),
    "async_in_order_w1": ({"name": "in_order", "max_lookahead_versions": 1}, 4, True),
    "weight_fifo": ({"name": "weight_fifo", "max_staleness_versions": 1}, 2, True),
    "ready_first": ({"name": "ready_first", "max_staleness_versions": 1}, 2, True),
    "windowed_freshest": ({"name": "windowed", "max_staleness_versions": 1, "sample_freshest_first": True,
                           "over_sampling_ratio": 2.0}, 2, True),
}


class ThreadProbe(Callback):
    """Records (trainer threads, generation worker threads) at every training batch."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()

        self.worker_resources: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        workers = trainer.datamodule.runtime.workers
        if not self.worker_resources:
            self.worker_resources = ray.get([w.assigned_resources.remote() for w in workers])
        self.seen.update((torch.get_num_threads(), n) for n in ray.get([w.num_threads.remote() for w in workers]))


def _events(run_dir: Path) -> list[Any]:
    return [parse_event(line) for _, line in read_events(run_dir)]


@pytest.mark.parametrize("mode", list(MODES))
def test_sampler_mode_end_to_end(mode: str, tmp_path: Path) -> None:
    sampler, min_groups, is_on = MODES[mode]
    cfg = base_config(tmp_path / "run")
    cfg["async_rl"]["sampler"] = sampler
    cfg["async_rl"]["min_groups_for_streaming_train"] = min_groups
    cfg["model"]["init_args"]["loss_fn"]["init_args"][IS_KEY] = is_on
    if not is_on:
        del cfg["model"]["init_args"]["loss_fn"]["init_args"]["is_truncation"]
    cfg["data"]["init_args"]["generation"]["num_cpus_per_worker"] = 1.5  # what Ray reserves comes from the config
    probe = ThreadProbe()
    run_dir = run_fit(cfg, tmp_path, callbacks=[probe])
    assert probe.worker_resources == [{"CPU": 1.5}]

    # the thread budget: sync takes turns (every core for each phase), async splits the cores
    cores = available_cores()
    if mode.startswith("sync"):
        assert probe.seen == {(cores, cores)}
    else:
        assert probe.seen == {(max(1, cores - cores // 2), max(1, cores // 2))}

    report = check_events(run_dir, sampler)
    assert report.ok, report.format()
    events = _events(run_dir)
    steps = [e for e in events if e.name == "train_step"]
    assert [e.step for e in steps] == [0, 1, 2, 3]
    assert all(len(e.group_ids) == 4 for e in steps)
    commits = [e.group_id for e in events if e.name == "commit"]
    reserves = [e.group_id for e in events if e.name == "reserve"]
    # injected latency: groups complete in an order different from dispatch order
    assert commits != [g for g in reserves if g in set(commits)], "completions arrived in dispatch order"

    rows = metrics(run_dir)
    staleness = column(rows, "staleness")
    w_min, w_max = column(rows, "train/is_weight_min"), column(rows, "train/is_weight_max")
    assert len(staleness) >= 4
    if mode.startswith("sync"):
        assert set(staleness) == {0.0}
        assert max(column(rows, "train/logprob_mismatch")) < 1e-5  # every token on-policy, engine = trainer
    else:
        assert max(staleness) > 0.0
        assert any(abs(w - 1.0) > 1e-3 for w in w_min + w_max)  # stale tokens get real IS weights


def test_tiny_default_config_reward_rises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The README's main job, shortened: the mean reward of the last 10 steps beats the first 10, and the run
    warns about none of its own settings (the advantage warning fired at step 3 before std_floor: 0.1)."""
    import logging

    import yaml

    from .conftest import ROOT

    cfg = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=40, default_root_dir=str(tmp_path / "run"), enable_progress_bar=False)
    cfg["grpo"]["max_num_steps"] = 40
    with caplog.at_level(logging.WARNING, logger="screl"):
        run_dir = run_fit(cfg, tmp_path)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("screl")] \
        == []
    rows = metrics(run_dir)
    rewards = column(rows, "reward")
    assert len(rewards) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.3, (first, last)
    assert max(column(rows, "train/advantage_abs_max")) <= 10.0  # std_floor 0.1 bounds |A| by 10 x the reward gap
    assert check_events(run_dir, cfg["async_rl"]["sampler"]).ok


def test_an_engine_from_outside_screl_that_declares_less_trains(tmp_path: Path) -> None:
    """``tests.engine_plugins.PlainEngine`` by class path declares none of the torch engine's extras: the controller
    sends each group in its own call (no whole-call batches) and the worker merges each refit's buckets into one
    state dict (no streamed refit). The run trains: the reward rises over 30 steps (the engine decodes with every
    refit's weights) and the event log is clean."""
    import yaml

    from .conftest import ROOT

    cfg = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=30, default_root_dir=str(tmp_path / "run"), enable_progress_bar=False)
    cfg["grpo"]["max_num_steps"] = 30
    cfg["data"]["init_args"]["generation"].update(backend="tests.engine_plugins.PlainEngine", refit_bucket_mb=0.02)
    run_dir = run_fit(cfg, tmp_path)
    rewards = column(metrics(run_dir), "reward")
    assert len(rewards) == 30
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.3, (first, last)
    assert check_events(run_dir, cfg["async_rl"]["sampler"]).ok


class _KillWorker(Callback):
    """SIGKILLs a generation worker's process after the first optimizer step."""

    def __init__(self) -> None:
        self.killed: list[int] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.killed and batch.get("last_chunk"):
            pid = trainer.datamodule.runtime.worker_pids()[0]
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)


def test_a_worker_killed_for_good_hands_its_work_to_the_other(tmp_path: Path) -> None:
    """``max_worker_restarts: 0``: Ray does not bring a SIGKILLed worker back. The health check (or the failed
    call) finds it dead for good, its rollouts are retried on the other worker, and every step trains."""
    cfg = base_config(tmp_path / "run")
    cfg["trainer"]["max_steps"] = 5
    cfg["grpo"]["max_num_steps"] = 5
    gen = cfg["data"]["init_args"]["generation"]
    gen.update(num_workers=2, max_worker_restarts=0, injected_latency_s=0.5)
    cfg["async_rl"]["watchdog"] = {"health_check_interval_s": 0.5}
    cfg["async_rl"]["rollout_failure"] = {"max_infra_attempts": 3, "backoff_base_s": 0.2, "max_backoff_s": 0.5}
    killer = _KillWorker()
    run_dir = run_fit(cfg, tmp_path, callbacks=[killer])
    assert killer.killed
    events = _events(run_dir)
    assert [e.step for e in events if e.name == "train_step"] == [0, 1, 2, 3, 4]
    assert not [e for e in events if e.name == "drop"]
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()


def test_the_last_worker_killed_for_good_fails_the_run_naming_it(tmp_path: Path) -> None:
    import time

    cfg = base_config(tmp_path / "run")
    cfg["trainer"]["max_steps"] = 5
    cfg["grpo"]["max_num_steps"] = 5
    cfg["data"]["init_args"]["generation"].update(max_worker_restarts=0, injected_latency_s=0.5)
    cfg["data"]["init_args"]["step_timeout_s"] = 300
    cfg["async_rl"]["watchdog"] = {"health_check_interval_s": 0.5}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the rollout pump failed: WorkersLostError\('every generation worker is "
                                           r"dead for good \(workers \[0\]; .*generation.max_worker_restarts"):
        run_fit(cfg, tmp_path, callbacks=[_KillWorker()])
    assert time.monotonic() - t0 < 100, "found late: the run waited for step_timeout_s"


def test_a_hung_request_passes_its_deadline_and_is_retried(tmp_path: Path) -> None:
    """The engine wedges on its first batch; ``generation_timeout_s`` aborts it, the siblings are retried as
    infrastructure failures (``fail`` events with reason ``timeout``) and every step trains."""
    cfg = base_config(tmp_path / "run")
    cfg["trainer"]["max_steps"] = 3
    cfg["grpo"]["max_num_steps"] = 3
    gen = cfg["data"]["init_args"]["generation"]
    gen.update(backend="screl.rollout.faults.HangsOnceEngine", generation_timeout_s=2.0, injected_latency_s=0.0)
    cfg["async_rl"]["rollout_failure"] = {"max_infra_attempts": 3, "backoff_base_s": 0.1, "max_backoff_s": 0.2}
    run_dir = run_fit(cfg, tmp_path)
    events = _events(run_dir)
    timeouts = [e for e in events if e.name == "fail" and e.reason == "timeout"]
    assert timeouts and all(e.extra["detail"] == "generation_timeout_s=2 passed" for e in timeouts), timeouts
    assert not [e for e in events if e.name == "fail" and e.reason != "timeout"]
    assert [e.step for e in events if e.name == "train_step"] == [0, 1, 2]
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()


def test_a_crash_in_the_rollout_pump_surfaces_in_the_trainer(tmp_path: Path) -> None:
    cfg = base_config(tmp_path / "run")
    cfg["data"]["init_args"]["task"] = {
        "class_path": "screl.envs.CustomReward",
        "init_args": {"task": {"class_path": "screl.envs.CountLetter"}, "reward_fn": "builtins:divmod"},
    }
    cfg["async_rl"]["rollout_failure"] = {"max_data_attempts": 1}
    with pytest.raises(RuntimeError, match=r"the rollout pump failed: RolloutFailure.*data_attempts_exhausted"):
        run_fit(cfg, tmp_path)


class _ControllerLatency(Callback):
    """Times a controller round trip at every training batch: it stalls if anything blocks its event loop."""

    def __init__(self) -> None:
        self.latency_s: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        import time

        t0 = time.perf_counter()
        trainer.datamodule.runtime.stats()
        self.latency_s.append(time.perf_counter() - t0)


def test_a_slow_reward_runs_on_the_workers_and_never_stalls_the_controller(tmp_path: Path) -> None:
    delay = 0.2
    cfg = base_config(tmp_path / "run")
    cfg["data"]["init_args"]["task"] = {
        "class_path": "screl.envs.SlowReward",
        "init_args": {"task": {"class_path": "screl.envs.CountLetter"}, "delay_s": delay},
    }
    cfg["data"]["init_args"]["generation"]["injected_latency_s"] = 0.0
    probe = _ControllerLatency()
    run_dir = run_fit(cfg, tmp_path, callbacks=[probe])
    events = _events(run_dir)
    assert [e.step for e in events if e.name == "train_step"] == [0, 1, 2, 3]
    commits = [e for e in events if e.name == "commit"]
    assert all(e.extra is None or e.extra.get("generation_s", delay) >= delay for e in commits)
    # a reward on the controller's loop would hold every round trip for a whole group's scoring (2 x 0.2 s)
    assert len(probe.latency_s) == 4 and max(probe.latency_s) < delay, probe.latency_s
    assert check_events(run_dir, cfg["async_rl"]["sampler"], final=True).ok


def test_a_hung_engine_trips_the_stall_watchdog_naming_what_is_stuck(tmp_path: Path) -> None:
    """An engine that hangs (every reply held back up to an hour): with a 3 s stall timeout the run fails within
    seconds, not after step_timeout_s, and the error names the stuck worker and the knob."""
    import time

    cfg = base_config(tmp_path / "run")
    cfg["data"]["init_args"]["generation"]["injected_latency_s"] = 3600.0
    cfg["data"]["init_args"]["step_timeout_s"] = 300
    cfg["async_rl"]["watchdog"] = {"stall_timeout_s": 3}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)the rollout side is stalled: no group committed for \d+ s while the "
                                           r"trainer waited for step 0 \(async_rl.watchdog.stall_timeout_s = 3\).*"
                                           r"open longer than the timeout: worker 0 \(\d+ s\).*answer a ping: none"):
        run_fit(cfg, tmp_path)
    assert time.monotonic() - t0 < 120, "the watchdog fired late"
    assert tq_actors_alive() == [], "TransferQueue actors leaked"
