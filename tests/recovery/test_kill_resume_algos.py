"""The kill chain on PPO (across its critic warmup, with colocated generation) and on dynamic sampling (its
replacement reserve)."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch
import yaml

from screl.checkpoint.store import CheckpointStore
from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events

from .conftest import recovery_config, with_snapshots
from .kill_chain import IN_ORDER, final_outcome, kill_chain

pytestmark = pytest.mark.slow


PPO_SAMPLER = {"name": "in_order", "max_lookahead_versions": 1, "warmup_lookahead_versions": 2}


def test_kill9_a_colocated_ppo_run_across_its_critic_warmup_loses_no_group(tmp_path: Path) -> None:
    """The kill chain on PPO with colocated generation (the engine in the trainer's process, standing down for
    each step's policy and critic updates): the kills land in the critic warmup (each incarnation is killed in its
    first step; CI's runs restored step 0 three times), one of them mid-generation in the trainer itself; the resumed
    run trains every step once, its critic and both optimizers come back, and warmup steps are never refit."""
    rng = random.Random(1)
    ck_root = tmp_path / "bundles"
    steps = 10
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=steps, sampler=PPO_SAMPLER,
                                            source="ppo_tiny.yaml"))
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["init_args"]["generation"]["colocated"] = {"enabled": True}
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    points = ["generation", "mid_step", "checkpoint_write"]  # the warmup is steps 0-2: the kills land in it
    kills = kill_chain(config, points, run_dir, ck_root, rng)
    assert len(kills) == 3, f"only {len(kills)} kills landed before the run finished: {kills}"
    final_outcome(run_dir, steps, PPO_SAMPLER)
    events = [parse_event(line) for _, line in read_events(run_dir)]
    start = 3  # configs/ppo_tiny.yaml's ppo.policy_training_start_step
    assert all(e.trainer_version > start for e in events if e.name == "refit"), "a critic-warmup step was refit"
    latest = CheckpointStore(str(ck_root)).latest()
    assert latest is not None and latest.step == steps
    ckpt = torch.load(io.BytesIO(CheckpointStore(str(ck_root)).read_bytes(latest, "lightning.ckpt")),
                      weights_only=False)
    assert len(ckpt["optimizer_states"]) == 2 and any(k.startswith("critic.") for k in ckpt["state_dict"])
    # every update of every incarnation up to the last bundle is counted once: none lost, none repeated
    assert ckpt["ppo_update_counts"] == {"policy": (steps - start) * 2, "critic": steps * 2}
    log = (tmp_path / "fit.log").read_text()
    assert log.count("the colocated torch engine (the trainer's module)") == len(kills) + 1  # every incarnation
    assert "generation worker(s)" not in log


SNAPSHOT_EVERY_S = 0.1
"""These runs take about 0.2 s a step and a snapshot's write about 5-20 ms: at the default 0.5 s a whole run of
8 steps held three writes, and once (CI on 45e7fa5) the chain's `snapshot_write` kill found none to land in."""

def test_kill9_a_dynamic_sampling_run_keeps_its_replacement_reserve(tmp_path: Path) -> None:
    """The kill chain with dynamic sampling and a replacement reserve: every incarnation resumes the reserve the
    bundle holds, so the checker's prompt accounting (spares held, handed out, released) balances across the
    restores, and every step trains in full."""
    rng = random.Random(2)
    ck_root = tmp_path / "bundles"
    steps = 8
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=steps, sampler=IN_ORDER),
                            snapshot_attempt_interval_s=SNAPSHOT_EVERY_S)
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.CountLetter",
                                        "init_args": {"letter": "a", "threshold": 0.125}}
    cfg["grpo"].update(use_dynamic_sampling=True, num_generations_per_prompt=4)
    cfg["async_rl"]["rollout_failure"] = {"on_dropped_prompt": "replace", "replacement_reserve_prompts": 4,
                                          "max_replacement_attempts": 12, "min_step_batch_fraction": 0.5}
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    kills = kill_chain(config, ["mid_step"], run_dir, ck_root, rng)
    assert kills == ["mid_step"], f"the kill did not land before the run finished: {kills}"
    final_outcome(run_dir, steps, IN_ORDER)
    report = check_events(run_dir, IN_ORDER, final=True)
    assert report.prompts["replacements"] > 0 and report.outcomes["replaced"] > 0
    events = [parse_event(line) for _, line in read_events(run_dir)]
    last = max(i for i, e in enumerate(events) if e.name == "restore")
    assert [len(e.group_ids) for e in events[last:] if e.name == "train_step"] == [4] * (steps - events[last].step)
    store = CheckpointStore(str(ck_root))
    latest = store.latest()
    assert latest is not None and latest.step == steps
    reserve = torch.load(io.BytesIO(store.read_bytes(latest, "replacement_reserve.pt")), weights_only=False)
    assert reserve["started"] and len(reserve["spares"]) >= 4, "the reserve is held in every bundle"


def test_kill9_a_multi_turn_tool_run_loses_no_finished_conversation(tmp_path: Path) -> None:
    """The kill chain on the calculator tool task (MultiTurnWorkflow, token capture): every conversation that
    was sealed before a kill is trained once after the resume, unfinished ones are redispatched."""
    rng = random.Random(2)
    ck_root = tmp_path / "bundles"
    steps = 8
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=steps, sampler=IN_ORDER,
                                            source="grpo_tool_tiny.yaml"), snapshot_attempt_interval_s=SNAPSHOT_EVERY_S)
    run_dir = tmp_path / "run"
    kills = kill_chain(config, ["snapshot_write"], run_dir, ck_root, rng)  # sealed conversations in the snapshot
    assert kills == ["snapshot_write"], f"the kill did not land before the run finished: {kills}"
    final_outcome(run_dir, steps, IN_ORDER)
    latest = CheckpointStore(str(ck_root)).latest()
    assert latest is not None and latest.step == steps
