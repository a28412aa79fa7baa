"""Start, checkpoint, restart and shut down a real TransferQueue: no leaked actors, data survives."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import ray
import torch
from ray._private import state as ray_state

from screl.dataplane import DataPlane, DataPlaneError, DataPlaneHandle, tq_actors_alive

TQ_CLASSES = {"TransferQueueController", "SimpleStorageUnit", "TransferQueueHost"}
Rows = dict[str, list[torch.Tensor]]


def alive_tq_actor_classes() -> list[str]:
    """TQ actors the GCS still counts as alive, named or not (the dashboard-free state API)."""
    return sorted(
        a["ActorClassName"]
        for a in ray_state.actors().values()
        if a["ActorClassName"] in TQ_CLASSES and a["State"] != "DEAD"
    )


def cluster_processes(title: str | tuple[str, ...]) -> list[psutil.Process]:
    """The processes of this test's Ray cluster (it descends from this process) whose proctitle starts with
    ``title`` (another test process's cluster on the machine is not counted)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (p.cmdline() or [""])[0].startswith(title):
                found.append(p)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def tq_processes() -> list[str]:
    """The proctitles of this cluster's TransferQueue processes."""
    return sorted(p.cmdline()[0] for p in cluster_processes(("ray::TransferQueue", "ray::SimpleStorage")))


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
    # one storage unit placed anywhere: one process, TQ's controller holding the unit (screl.dataplane.tq_host)
    assert tq_actors_alive() == ["transfer_queue/TransferQueueController"]
    assert alive_tq_actor_classes() == ["TransferQueueHost"] and tq_processes() == ["ray::TransferQueueHost"]
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
    try:  # several units: TransferQueue's own actors, one process each
        assert len(tq_actors_alive()) == 3 and tq_processes() == ["ray::SimpleStorageUnit"] * 2 + [
            "ray::TransferQueueController"]
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


def _kill_and_wait(names: list[str], title: str) -> None:
    """``ray.kill`` the TQ actors ``names`` and wait until their processes (proctitle ``title``) are gone and Ray says
    so: ray.kill is asynchronous, and a get while the process still runs is served (CI)."""
    import time

    processes = cluster_processes(title)
    assert len(processes) == len(names), (processes, names)
    for full in names:
        namespace, name = full.split("/", 1)
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    _, alive = psutil.wait_procs(processes, timeout=10)
    deadline = time.monotonic() + 10
    while set(names) & set(tq_actors_alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive and not set(names) & set(tq_actors_alive()), f"{names} still alive after 10 s"


@pytest.mark.parametrize("units", [1, 2], ids=["one-process", "unit-actors"])
def test_a_killed_storage_unit_fails_the_next_call_at_once_naming_it(ray_cluster: None, units: int) -> None:
    """TransferQueue talks to its storage units over ZMQ: a call to a dead one would wait out its whole timeout
    (twice 60 s in a run, then blamed on the object store). Each wait checks that the actors live: the call fails
    within about a second, sync and async, naming what died: the controller and the unit it holds (one unit), or
    the unit actors (several; both are killed, as the row may be in either). The chaos matrix,
    tests/recovery/test_chaos.py, kills them in a real run."""
    import asyncio
    import time

    from screl.dataplane import DataPlaneLostError

    plane = DataPlane.start(num_storage_units=units, timeout_s=30.0)
    try:
        plane.put(["lost_g0"], {"reward": [torch.zeros(())]})
        if units == 1:
            lost = ["transfer_queue/TransferQueueController"]
            _kill_and_wait(lost, "ray::TransferQueueHost")
            said = rf"the TransferQueue controller with the storage unit it holds \({lost[0]}\) died"
        else:
            lost = [n for n in tq_actors_alive() if "StorageUnit" in n]
            _kill_and_wait(lost, "ray::SimpleStorageUnit")
            said = rf"the TransferQueue storage unit 0 \({lost[0]}\), the TransferQueue storage unit 1 .* died"
        t0 = time.monotonic()
        with pytest.raises(DataPlaneLostError,
                           match=rf"get of 1 rows failed: {said} .* resumes from the last checkpoint bundle"):
            plane.get(["lost_g0"], ["reward"])
        with pytest.raises(DataPlaneLostError, match=rf"put of 1 rows failed: {said}"):
            asyncio.run(plane.aput(["lost_g1"], {"reward": [torch.zeros(())]}))
        assert time.monotonic() - t0 < 15, "waited for the timeout (30 s) instead"
        assert plane.lost_actors() == sorted(lost)
    finally:
        plane.shutdown()
    assert tq_actors_alive() == []
