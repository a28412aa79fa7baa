"""Start, checkpoint, restart and shut down a real TransferQueue: no leaked actors, data survives."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import ray
import torch
from ray._private import state as ray_state

from screl.dataplane import DataPlane, DataPlaneError, DataPlaneHandle, tq_actors_alive

TQ_CLASSES = {"TransferQueueController", "SimpleStorageUnit"}
Rows = dict[str, list[torch.Tensor]]


def alive_tq_actor_classes() -> list[str]:
    """TQ actors the GCS still counts as alive, named or not (the dashboard-free state API)."""
    return sorted(
        a["ActorClassName"]
        for a in ray_state.actors().values()
        if a["ActorClassName"] in TQ_CLASSES and a["State"] != "DEAD"
    )


@pytest.fixture(scope="module")
def saved(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[str], Rows, DataPlaneHandle]:
    """A one-storage-unit data plane with 4 rows, saved, then shut down (and checked for leaks)."""
    assert tq_actors_alive() == []
    plane = DataPlane.start(num_storage_units=1, timeout_s=30.0)
    keys = [f"ck_g{i}" for i in range(4)]
    g = torch.Generator().manual_seed(0)
    data = {
        "input_ids": [torch.randint(0, 1000, (3 + i,), generator=g) for i in range(4)],
        "generation_logprobs": [-torch.rand(1 + i, generator=g) for i in range(4)],
        "reward": [torch.rand((), generator=g) for _ in range(4)],
    }
    plane.put(keys, data, tags=[{"weight_version": i} for i in range(4)])
    path = tmp_path_factory.mktemp("tq") / "dp"
    plane.save(path, metadata={"step": 7})
    assert len(tq_actors_alive()) == 2  # controller + 1 storage unit
    plane.shutdown()
    plane.shutdown()  # idempotent
    assert tq_actors_alive() == [] and alive_tq_actor_classes() == []
    return path, keys, data, plane.handle()


def test_fresh_data_plane_loads_a_checkpoint(saved: tuple[Path, list[str], Rows, DataPlaneHandle]) -> None:
    path, keys, data, old_handle = saved
    plane = DataPlane.start(num_storage_units=1, timeout_s=30.0)
    try:
        with pytest.raises(DataPlaneError, match=r"TransferQueue was restarted"):
            DataPlane.attach(old_handle)
        assert plane.list_keys() == []
        plane.load(path)
        assert plane.list_keys() == keys
        assert [plane.list_tags()[k]["weight_version"] for k in keys] == [0, 1, 2, 3]
        got = plane.get(keys, list(data))
        for f, want in data.items():
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got[f], want, strict=True)), f
        with pytest.raises(DataPlaneError, match=r"load needs a freshly started data plane"):
            plane.load(path)
    finally:
        plane.shutdown()
    assert tq_actors_alive() == [] and alive_tq_actor_classes() == []


def test_load_needs_the_same_number_of_storage_units(
    saved: tuple[Path, list[str], Rows, DataPlaneHandle],
) -> None:
    plane = DataPlane.start(num_storage_units=2, timeout_s=30.0)
    try:
        with pytest.raises(ValueError, match=r"(?i)storage unit"):
            plane.load(saved[0])
    finally:
        plane.shutdown()
    assert tq_actors_alive() == [] and alive_tq_actor_classes() == []


def test_start_needs_ray_cpus(ray_cluster: None) -> None:
    with pytest.raises(DataPlaneError, match=r"needs 101 free logical CPUs"):
        DataPlane.start(num_storage_units=100)
    assert ray.is_initialized() and tq_actors_alive() == []


def test_a_real_snapshot_passes_the_pickle_scan(saved: tuple[Path, list[str], Rows, DataPlaneHandle]) -> None:
    """TransferQueue's own pickles import only what screl's scan allows (so a resume is never refused for them)."""
    from screl.checkpoint.pickle_scan import check_pickles_under, pickle_globals

    assert check_pickles_under(str(saved[0]), "data_plane") >= 2  # the controller and the storage unit
    imported = {g for p in saved[0].rglob("*.pkl") for g in pickle_globals(p.read_bytes())}
    assert any(g.startswith("torch.") for g in imported), imported  # the rows' tensors are in there


def test_a_killed_storage_unit_fails_the_next_call_at_once_naming_it(ray_cluster: None) -> None:
    """TransferQueue talks to its storage units over ZMQ: a call to a dead one would wait out its whole timeout
    (twice 60 s in a run, then blamed on the object store). Each wait checks that the actors live: the call fails
    within about a second, sync and async, naming the unit (the chaos matrix, tests/recovery/test_chaos.py, kills
    them in a real run)."""
    import asyncio
    import time

    from screl.dataplane import DataPlaneLostError

    plane = DataPlane.start(num_storage_units=1, timeout_s=30.0)
    try:
        plane.put(["lost_g0"], {"reward": [torch.zeros(())]})
        [unit] = [n for n in tq_actors_alive() if "StorageUnit" in n]
        namespace, name = unit.split("/", 1)
        [process] = [p for p in psutil.process_iter(["cmdline"])
                     if (p.info["cmdline"] or [""])[0].startswith("ray::SimpleStorageUnit")]
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        # ray.kill is asynchronous: a get while the unit's process still runs is served (CI), so wait until the
        # process is gone and Ray says so
        _, alive = psutil.wait_procs([process], timeout=10)
        deadline = time.monotonic() + 10
        while unit in tq_actors_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive and unit not in tq_actors_alive(), "the killed storage unit is still alive after 10 s"
        t0 = time.monotonic()
        with pytest.raises(DataPlaneLostError, match=rf"get of 1 rows failed: the TransferQueue storage unit 0 "
                                                     rf"\({unit}\) died .* resumes from the last checkpoint bundle"):
            plane.get(["lost_g0"], ["reward"])
        with pytest.raises(DataPlaneLostError, match=r"put of 1 rows failed: the TransferQueue storage unit 0"):
            asyncio.run(plane.aput(["lost_g1"], {"reward": [torch.zeros(())]}))
        assert time.monotonic() - t0 < 15, "waited for the timeout (30 s) instead"
        assert plane.lost_actors() == [unit]
    finally:
        plane.shutdown()
    assert tq_actors_alive() == []
