"""Start, checkpoint, restart and shut down a real TransferQueue: no leaked actors, data survives."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from ray._private import state as ray_state

from screl.dataplane import DataPlane, DataPlaneError, tq_actors_alive

TQ_CLASSES = {"TransferQueueController", "SimpleStorageUnit"}


def alive_tq_actor_classes() -> list[str]:
    """TQ actors the GCS still counts as alive (named or not; the dashboard-free state API)."""
    return sorted(
        a["ActorClassName"]
        for a in ray_state.actors().values()
        if a["ActorClassName"] in TQ_CLASSES and a["State"] != "DEAD"
    )


def rows(n: int) -> tuple[list[str], dict[str, list[torch.Tensor]]]:
    keys = [f"ck_g{i}" for i in range(n)]
    g = torch.Generator().manual_seed(n)
    return keys, {
        "input_ids": [torch.randint(0, 1000, (3 + i,), generator=g) for i in range(n)],
        "generation_logprobs": [-torch.rand(1 + i, generator=g) for i in range(n)],
        "reward": [torch.rand((), generator=g) for _ in range(n)],
    }


def test_save_restart_load_and_shutdown_leaves_no_actors(ray_cluster: None, tmp_path: Path) -> None:
    assert tq_actors_alive() == []
    first = DataPlane.start(num_storage_units=2, timeout_s=30.0)
    keys, data = rows(4)
    first.put(keys, data, tags=[{"weight_version": i} for i in range(4)])
    first.save(tmp_path / "dp", metadata={"step": 7})
    assert (tmp_path / "dp" / "metadata.json").exists()
    old_handle = first.handle()
    assert len(tq_actors_alive()) == 3  # controller + 2 storage units
    first.shutdown()
    first.shutdown()  # idempotent
    assert tq_actors_alive() == [] and alive_tq_actor_classes() == []

    second = DataPlane.start(num_storage_units=2, timeout_s=30.0)
    try:
        with pytest.raises(DataPlaneError, match=r"TransferQueue was restarted"):
            DataPlane.attach(old_handle)
        assert second.list_keys() == []
        second.load(tmp_path / "dp")
        assert second.list_keys() == keys
        assert [second.list_tags()[k]["weight_version"] for k in keys] == [0, 1, 2, 3]
        got = second.get(keys, list(data))
        for f, want in data.items():
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got[f], want, strict=True)), f
        with pytest.raises(DataPlaneError, match=r"load needs a freshly started data plane"):
            second.load(tmp_path / "dp")
    finally:
        second.shutdown()
    assert tq_actors_alive() == [] and alive_tq_actor_classes() == []


def test_load_rejects_other_storage_unit_counts_and_remote_paths(ray_cluster: None, tmp_path: Path) -> None:
    plane = DataPlane.start(num_storage_units=1, timeout_s=30.0)
    try:
        keys, data = rows(2)
        plane.put(keys, data)
        with pytest.raises(ValueError, match=r"need a local path"):
            plane.save("s3://bucket/dp")
        plane.save(tmp_path / "one")
        plane.clear(keys)
        with pytest.raises(FileNotFoundError, match=r"is not a TransferQueue checkpoint"):
            plane.load(tmp_path / "missing")
    finally:
        plane.shutdown()
    plane = DataPlane.start(num_storage_units=2, timeout_s=30.0)
    try:
        with pytest.raises(ValueError, match=r"(?i)storage unit"):
            plane.load(tmp_path / "one")
    finally:
        plane.shutdown()
    assert alive_tq_actor_classes() == []


def test_start_needs_ray_cpus(ray_cluster: None) -> None:
    with pytest.raises(DataPlaneError, match=r"needs 101 free logical CPUs"):
        DataPlane.start(num_storage_units=100)
    assert ray.is_initialized() and tq_actors_alive() == []
