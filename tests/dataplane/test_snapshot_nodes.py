"""The node-side half of a TransferQueue snapshot without a shared disk (``screl.dataplane.snapshot``): the tasks run
for real, pinned to a node of the test's Ray cluster (this one, so the "other node" and the client share a disk
here; tests/recovery/test_multinode.py runs them on a node with its own)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import ray

from screl.dataplane import DataPlaneError
from screl.dataplane.snapshot import (
    RemoteTree,
    download_shares,
    prepare_save,
    remove_on,
    tq_nodes,
    upload_shares,
)


@pytest.fixture
def node(ray_cluster: None) -> dict[str, list[str]]:
    return {ray.get_runtime_context().get_node_id(): ["TransferQueueStorageUnit#0"]}


def test_a_share_left_in_the_staging_dir_is_uploaded_and_removed(node: dict[str, list[str]], tmp_path: Path) -> None:
    staging = tmp_path / "stage" / "data_plane"
    prepare_save(str(staging), node, 30)
    units = tmp_path / "stage" / "data_plane.tmp" / "simple_storage"
    assert units.is_dir()  # where TQ's storage units write on that node (TQ's client creates it on its own only)
    unit = units / "su_0_ab.pkl"
    unit.write_bytes(b"rows" * 50)
    (unit.parent / "su_0_ab.pkl.blobs").mkdir()
    (unit.parent / "su_0_ab.pkl.blobs" / "v1").write_bytes(b"ssd")
    target = tmp_path / "bundle" / "data_plane"
    sent = upload_shares(str(staging), node, RemoteTree(target.as_uri()), 30)
    assert sent == ["simple_storage/su_0_ab.pkl", "simple_storage/su_0_ab.pkl.blobs/v1"]
    assert (target / "simple_storage" / "su_0_ab.pkl").read_bytes() == b"rows" * 50
    assert not (tmp_path / "stage" / "data_plane.tmp").exists()
    # a node sharing the client's disk: TQ already renamed <dir>.tmp into place, there is nothing left to send
    assert upload_shares(str(staging), node, RemoteTree(target.as_uri()), 30) == []


def test_a_node_downloads_the_published_snapshot_checked_against_the_manifest(
    node: dict[str, list[str]], tmp_path: Path
) -> None:
    published = tmp_path / "bundle" / "data_plane"
    (published / "storage_units").mkdir(parents=True)
    files = {"metadata.json": b"{}", "storage_units/su_0_ab.pkl": b"rows" * 50}
    for rel, data in files.items():
        (published / rel).write_bytes(data)
    digests = {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
    local = tmp_path / "node2" / "data_plane"
    tree = RemoteTree(published.as_uri(), {}, digests)
    assert download_shares(str(local), node, tree, 30) == list(node)
    assert (local / "storage_units" / "su_0_ab.pkl").read_bytes() == b"rows" * 50
    assert download_shares(str(local), node, tree, 30) == []  # already there (a shared disk): not fetched again
    remove_on(str(local), list(node), 30)
    assert not local.exists()
    tampered = RemoteTree(published.as_uri(), {}, {**digests, "metadata.json": "0" * 64})
    with pytest.raises(DataPlaneError, match=r"metadata.json: its SHA-256 differs from the bundle manifest's"):
        download_shares(str(local), node, tampered, 30)


def test_the_nodes_of_a_running_data_plane(dp: object) -> None:
    here = ray.get_runtime_context().get_node_id()
    found = tq_nodes()
    assert list(found) == [here]
    assert found[here] == ["TransferQueueController"]  # one storage unit: it lives in the controller's process
