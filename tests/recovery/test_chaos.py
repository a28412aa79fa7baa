"""The chaos matrix (issue 40 item 1): SIGKILL each kind of process of a real ``screl fit`` (a real Ray cluster on
loopback, real TransferQueue actors, the tiny agent config, which runs every kind) at a seeded point, one kind after
the other across one lineage of resumes:

* a generation worker's stand-in (the raylet's process for a worker forked from the cluster's worker zygote,
  :mod:`screl.dataplane.ray_worker`): the worker dies with it, Ray restarts it, its rollouts in flight are retried
  (infra failures), the run goes on;
* the worker zygote (:mod:`screl.dataplane.worker_zygote`): nothing fails; the workers started after it are started
  by Ray's own program;
* a generation worker (there, one that Ray's own program restarted): as its stand-in (this row replaced the e2e test
  of a killed worker's retry: the lineage's audit also proves nothing was dropped);
* the policy server: Ray does not restart it, so the agents' calls cannot succeed on a retry: the controller's health
  check fails the run naming it (not data failures);
* TransferQueue (one process: its controller holds the run's one storage unit, ``screl.dataplane.tq_host``; the unit
  as an actor of its own, placed by ``data_plane.storage_node_resource``, is killed in
  ``tests/dataplane/test_lifecycle.py`` and lost with its node in ``tests/recovery/test_multinode.py``): the run fails
  within seconds naming it (every data-plane wait checks that TransferQueue's actors live, and so does the
  controller's health check);
* the rollout controller actor: the trainer fails at its next call naming it;
* after each failure the next incarnation resumes from the newest bundle; the last one finishes.

After each lineage the event checker passes with ``final=True`` and an independent count holds: every prompt of the
surviving history trained exactly once, and none both trained and dropped. Each row prints its kill-to-error time.
A trainer rank under DDP is ``tests/recovery/test_multirank.py::test_ddp_bundles_survive_a_kill_and_resume_as_one_process_would_train``
(it prints its kill-to-exit time too)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from screl.checkpoint.store import CheckpointStore
from screl.data.event_check import check_events
from screl.data.event_check_cli import main as events_cli
from screl.data.events import parse_event, read_events
from screl.dataplane.ray_worker import stand_in_name
from screl.dataplane.worker_zygote import NAME as ZYGOTE_NAME

from .conftest import kill_tree, recovery_config, start_fit, wait_for

pytestmark = pytest.mark.slow

IN_ORDER = {"name": "in_order", "max_lookahead_versions": 1}
STAND_IN_PREFIX = stand_in_name(0)[:-1]  # "screl-w": a stand-in's name is it and its worker's pid
STALL_TIMEOUT_S = 60.0
"""The stall watchdog's timeout in these runs: every failure must come well before it."""


def _config(base: Path, steps: int, source: str = "grpo_tiny.yaml") -> Path:
    path = recovery_config(base, str(base / "bundles"), steps=steps, sampler=IN_ORDER, source=source)
    cfg = yaml.safe_load(path.read_text())
    # generation paces the run (up to 0.5 s per call, 3 agent turns): a quiet machine must not run past a kill point
    cfg["data"]["init_args"]["generation"]["injected_latency_s"] = 0.5
    cfg["checkpointing"]["keep_top_k"] = None  # every bundle stays: the test reads which one each resume used
    # a killed worker's retries span Ray's restart of it (a fresh process, its model built, the weights pushed)
    cfg["async_rl"]["rollout_failure"] = {"max_infra_attempts": 10, "backoff_base_s": 0.2, "max_backoff_s": 2.0}
    cfg["async_rl"]["watchdog"] = {"stall_timeout_s": STALL_TIMEOUT_S, "health_check_interval_s": 1.0}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _ray_process(proc: Any, cls: str) -> psutil.Process:
    """The process of ``screl fit``'s tree whose title is ``ray::<cls>`` (an actor's process names its class), or of
    a worker that a stand-in of the tree names (a forked worker whose zygote died left the tree with it)."""
    found: list[psutil.Process] = []

    def look() -> bool:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return False
        for child in list(children):
            try:
                name = child.name()
                if name.startswith(STAND_IN_PREFIX):
                    children.append(psutil.Process(int(name[len(STAND_IN_PREFIX):])))
            except (psutil.Error, ValueError):
                continue
        for child in children:
            try:
                title = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if title.startswith(f"ray::{cls}") or title.startswith("ray::") and f":{cls}." in title.split()[0]:
                found.append(child)
                return True
        return False

    assert wait_for(look, 300, proc), f"no ray::{cls} process in the run's tree"
    return found[0]


def _events(run_dir: Path) -> list[Any]:
    if not (run_dir / "events.jsonl").exists():
        return []
    return [parse_event(line) for _, line in read_events(run_dir)]


def _count(run_dir: Path, name: str) -> int:
    return sum(1 for e in _events(run_dir) if e.name == name)


def _trains_after_start(proc: Any, run_dir: Path, log: Path, steps: int = 1) -> None:
    """Wait until this incarnation has trained ``steps`` steps and published their bundles."""
    before = _count(run_dir, "checkpoint")
    assert wait_for(lambda: _count(run_dir, "checkpoint") >= before + steps, 300, proc, poll_s=0.1), \
        log.read_text()[-3000:]


def _kill(proc: Any, cls: str, rng: random.Random, run_dir: Path, log: Path,
          pick: Callable[[psutil.Process], psutil.Process] = lambda p: p) -> float:
    """SIGKILL the ``ray::<cls>`` process (or what ``pick`` takes from it) at a seeded point of the step after this
    incarnation's next bundle; returns the kill's time."""
    target = pick(_ray_process(proc, cls))  # found first: the kill follows the bundle closely
    _trains_after_start(proc, run_dir, log)
    wait_for(lambda: False, rng.uniform(0.0, 0.3), proc)  # a seeded point: polls the run meanwhile
    assert proc.poll() is None, "the run ended before its kill point"
    target.kill()
    return time.monotonic()


def _stand_in(worker: psutil.Process) -> psutil.Process:
    """The raylet's process for a forked worker (``screl.dataplane.ray_worker``): it carries the worker's pid."""
    name = stand_in_name(worker.pid)
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == name:
            return p
    raise AssertionError(f"no stand-in ({name}) for the worker {worker.pid}: it was not forked")


def _zygote(worker: psutil.Process) -> psutil.Process:
    """The worker zygote a worker was forked from (its parent; forked from ``screl fit``, it has its command line)."""
    parent = worker.parent()
    assert parent is not None and parent.name() == ZYGOTE_NAME, f"the worker {worker.pid} was not forked"
    return parent


def _parent_kind(worker: psutil.Process) -> str:
    parent = worker.parent()
    if parent is None:
        return "none"
    return "zygote" if parent.name() == ZYGOTE_NAME else "raylet" if parent.name() == "raylet" else parent.name()


def _recovers(run: tuple[Any, int], kill: Callable[[], float], run_dir: Path, log: Path, row: str) -> float:
    """Kill (``kill`` returns the kill's time); the rollouts in flight fail as infra failures (if any was hit) and
    groups commit again; returns (and prints) the kill-to-failure time."""
    fails = _count(run_dir, "fail")
    killed_at = kill()
    killed_wall = time.time()  # the event log's clock
    failed = wait_for(lambda: _count(run_dir, "fail") > fails, 30, run[0], poll_s=0.05)
    took = time.monotonic() - killed_at

    def committed_since() -> bool:
        return any(e.name == "commit" and (e.time or 0.0) > killed_wall + 0.5 for e in _events(run_dir))

    assert wait_for(committed_since, 120, run[0], poll_s=0.2), log.read_text()[-3000:]
    print(f"chaos: {row}: kill -> its rollouts in flight failed (infra) in {took:.1f} s (hit rollouts in flight: "
          f"{failed}); -> groups commit again after {time.monotonic() - killed_at:.1f} s")
    assert all(e.reason == "infra" for e in _events(run_dir) if e.name == "fail")
    return took


def _start(config: Path, log: Path) -> tuple[Any, int]:
    """``screl fit``, and where its output starts in the shared log."""
    offset = log.stat().st_size if log.exists() else 0
    return start_fit(config, log), offset


def _fails_naming(started: tuple[Any, int], log: Path, killed_at: float, names: str, row: str) -> float:
    """The run exits non-zero, its own output naming ``names``; returns (and prints) the kill-to-exit time."""
    proc, offset = started
    try:
        rc = proc.wait(timeout=STALL_TIMEOUT_S + 120)
    finally:
        kill_tree(proc)
    took = time.monotonic() - killed_at
    text = log.read_bytes()[offset:].decode(errors="replace")
    print(f"chaos: {row}: kill -> the run failed in {took:.1f} s")
    assert rc != 0, text[-3000:]
    assert names in text, text[-3000:]
    assert took < STALL_TIMEOUT_S, f"{row}: found after {took:.0f} s, not before the stall watchdog"
    return took


def independent_count(run_dir: Path, steps: int, per_step: int) -> None:
    """From the raw log, apart from the checker: the surviving history (a restore at step R supersedes the steps
    >= R before it) trains steps 0..steps-1, ``per_step`` groups each, every ``(epoch, prompt)`` once, and no
    prompt it trained was also dropped (a drop at a shutdown is not one: the prompt comes back at the resume, which
    the checker's prompt accounting follows)."""
    epoch_of: dict[int, int] = {}
    prompt_of: dict[str, tuple[int, int]] = {}
    trained: dict[int, tuple[str, ...]] = {}
    dropped: set[tuple[int, int]] = set()
    for e in _events(run_dir):
        if e.name == "admit":
            for pid in e.prompt_ids or ():
                epoch_of[int(pid)] = int((e.extra or {}).get("epoch", 0))
        elif e.name == "reserve":
            prompt_of[e.group_id] = (epoch_of.get(e.prompt_id, 0), e.prompt_id)
        elif e.name == "restore":
            trained = {s: g for s, g in trained.items() if s < e.step}
        elif e.name == "train_step":
            trained[e.step] = tuple(e.group_ids)
        elif e.name == "drop" and e.reason != "shutdown":  # a shutdown's drops come back at the resume
            dropped.add(prompt_of[e.group_id] if e.group_id is not None else (epoch_of.get(e.prompt_id, 0), e.prompt_id))
    assert sorted(trained) == list(range(steps)), sorted(trained)
    prompts = [prompt_of[g] for s in sorted(trained) for g in trained[s]]
    assert len(prompts) == steps * per_step, (len(prompts), steps * per_step)
    assert len(set(prompts)) == len(prompts), "a prompt trained twice"
    assert not set(prompts) & dropped, "a prompt both trained and dropped"


def _audit(run_dir: Path, steps: int) -> None:
    """``screl events check --final`` over the whole lineage's log, then the independent count."""
    assert events_cli(["check", str(run_dir), "--final", "--sampler", json.dumps(IN_ORDER)]) == 0, \
        check_events(run_dir, IN_ORDER, final=True).format()
    independent_count(run_dir, steps, per_step=4)


def test_killing_each_process_kind_fails_fast_or_recovers_and_the_lineage_loses_nothing(tmp_path: Path) -> None:
    """One lineage of ``configs/grpo_agent_tiny.yaml`` (the tiny agent config: it runs every kind of process, the
    policy server too), four incarnations, one kind of process SIGKILLed at a time at a seeded point after a bundle:
    a generation worker's stand-in, the worker zygote, then a generation worker (each recovers), then the policy server, TransferQueue (its controller with the storage unit it
    holds) and the rollout controller (each fails the run naming it; the next incarnation resumes from the newest
    bundle); the last one finishes."""
    rng = random.Random(40)
    steps = 18  # room for the kill points, each in the step after a bundle of its incarnation
    config = _config(tmp_path, steps, source="grpo_agent_tiny.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "fit.log"
    store = CheckpointStore(str(tmp_path / "bundles"))
    times: dict[str, float] = {}

    # a generation worker's stand-in (the raylet's process for a worker forked from the worker zygote,
    # screl.dataplane.ray_worker): the worker dies with it, Ray restarts it (forked again; the controller hands it the
    # data plane, the latest weights and the policy server again), its rollouts in flight are retried, the run goes on
    run = _start(config, log)
    times["stand-in"] = _recovers(
        run, lambda: _kill(run[0], "GenerationWorker", rng, run_dir, log, pick=_stand_in), run_dir, log,
        "a generation worker's stand-in")
    # the worker zygote: nothing fails (the workers it forked are the raylet's); a generation worker killed after it
    # is restarted by Ray's own program (cold) and the run goes on
    zygote = _zygote(_ray_process(run[0], "GenerationWorker"))
    _kill(run[0], "GenerationWorker", rng, run_dir, log, pick=lambda worker: zygote)
    _trains_after_start(run[0], run_dir, log)
    times["generation worker"] = _recovers(
        run, lambda: _kill(run[0], "GenerationWorker", rng, run_dir, log), run_dir, log,
        "generation worker (the zygote killed before it)")
    assert _parent_kind(_ray_process(run[0], "GenerationWorker")) == "raylet", "the restart after the zygote was cold"

    # the policy server (same incarnation), then one kind per resumed incarnation: each run fails naming what died
    kills = [("PolicyServer", "RuntimeError: the controller's health check stopped the run: PolicyServerLostError(",
              "policy server"),
             ("TransferQueueHost", "the TransferQueue controller with the storage unit it holds (", "TransferQueue"),
             ("RolloutController", "class_name: RolloutController", "rollout controller")]
    for cls, names, row in kills:
        if cls != "PolicyServer":
            bundle = store.latest()
            assert bundle is not None
            run = _start(config, log)
        killed_at = _kill(run[0], cls, rng, run_dir, log)
        if cls != "PolicyServer":
            assert f"resuming from {tmp_path / 'bundles'}/step_{bundle.step} " in \
                log.read_bytes()[run[1]:].decode(errors="replace")
        times[row] = _fails_naming(run, log, killed_at, names, row)

    # a last resume finishes the run
    proc = start_fit(config, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert log.read_text().count("screl: resumed the rollout side") == 3, "every failed incarnation was resumed"
    latest = store.latest()
    assert latest is not None and latest.step == steps
    _audit(run_dir, steps)
    print("chaos: kill -> error:", {k: round(v, 1) for k, v in times.items()})
