"""A real two-node Ray cluster on loopback: generation placed on the second node by resources, checkpoints on S3,
the second node killed (the run fails fast naming it), a fresh node added, the run resumed from S3."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from screl.checkpoint.store import CheckpointStore
from screl.data.event_check import check_events
from screl.dataplane.cluster import LOOPBACK_IPS, listening_addresses

from .conftest import kill_tree, recovery_config, start_fit, wait_for, with_snapshots
from .ray_nodes import NoPrivateDisk, RayNodes

pytestmark = pytest.mark.slow

IN_ORDER = {"name": "in_order", "max_lookahead_versions": 1}
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def _multinode_config(tmp_path: Path, url: str, s3_options: dict[str, Any], address: str) -> Path:
    config = recovery_config(tmp_path, url, steps=6, sampler=IN_ORDER, storage_options=s3_options)
    cfg = yaml.safe_load(config.read_text())
    cfg["ray"] = {"address": address}
    cfg["data"]["init_args"]["generation"].update(num_workers=1, num_cpus_per_worker=0,
                                                  resources={"rollout_node": 1})
    cfg["data_plane"] = {"storage_node_resource": "head_node"}
    cfg["async_rl"]["watchdog"] = {"health_check_interval_s": 0.5}
    config.write_text(yaml.safe_dump(cfg))
    return config



def test_generation_node_lost_fails_fast_then_resumes_on_a_new_node(tmp_path: Path,
                                                                  s3_options: dict[str, Any]) -> None:
    url = f"s3://screl-ckpt-tests/{uuid.uuid4().hex}/bundles"
    store = CheckpointStore(url, s3_options)
    log = tmp_path / "fit.log"
    with RayNodes(head_cpus=6, node_cpus=0, head_resources={"head_node": 1},
                  node_resources={"rollout_node": 1}) as cluster:
        config = _multinode_config(tmp_path, url, s3_options, cluster.address)
        proc = start_fit(config, log, env=S3_ENV)

        def two_steps_published() -> bool:
            latest = store.latest()
            return latest is not None and latest.step >= 2

        assert wait_for(two_steps_published, 300, proc), log.read_text()[-3000:]
        wide = [a for a in listening_addresses(cluster.pids()) if a[1] not in LOOPBACK_IPS]
        assert not wide, f"listening beyond loopback: {wide}"
        lost = cluster.nodes[0]["node_id"]
        cluster.kill(lost)
        try:
            rc = proc.wait(timeout=120)
        finally:
            kill_tree(proc)
        text = log.read_text()
        assert rc != 0, text[-3000:]
        assert f"worker 0 was on Ray node {lost} (127.0.0.1), which left the Ray cluster" in text, text[-3000:]
        assert "no live node offers {'rollout_node': 1.0}" in text

        resumed_from = store.latest()
        assert resumed_from is not None and resumed_from.step >= 2
        cluster.add()
        proc = start_fit(config, log, env=S3_ENV)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert f"resuming from {url}/step_{resumed_from.step}" in log.read_text()
    report = check_events(tmp_path / "run", IN_ORDER)
    assert report.ok, report.format()
    latest = store.latest()
    assert latest is not None and latest.step == 6


def test_storage_on_a_node_with_its_own_disk_checkpoints_to_s3_and_resumes(tmp_path: Path,
                                                                          s3_options: dict[str, Any]) -> None:
    """The storage unit runs on node 2, which has its own "disk": a private tmpfs over the directory where the
    trainer and the controller stage bundles and snapshots. So TransferQueue's save leaves the unit's rows on a disk
    no other process sees; node 2 uploads them to S3 itself, and before the resume downloads them back itself."""
    disk = tmp_path / "disk"  # the head's local disk; node 2 sees an empty tmpfs here
    disk.mkdir()
    local = {"TMPDIR": str(disk), "RAY_TMPDIR": tempfile.gettempdir()}  # Ray's own files stay shared
    url = f"s3://screl-ckpt-tests/{uuid.uuid4().hex}/bundles"
    store = CheckpointStore(url, s3_options)
    log = tmp_path / "fit.log"
    try:
        cluster = RayNodes(head_cpus=6, node_cpus=1, head_resources={"head_node": 1},
                           node_resources={"store_node": 1}, private_dir=str(disk), env=local)
    except NoPrivateDisk as why:
        pytest.skip(f"no mount namespace for node 2's own disk here: {why}")
    with cluster:
        config = with_snapshots(recovery_config(tmp_path, url, steps=6, sampler=IN_ORDER, storage_options=s3_options))
        cfg = yaml.safe_load(config.read_text())
        cfg["ray"] = {"address": cluster.address}
        cfg["trainer"]["default_root_dir"] = str(disk / "root")  # the resume downloads there: head only
        cfg["data_plane"] = {"storage_node_resource": "store_node"}
        config.write_text(yaml.safe_dump(cfg))
        env = {**S3_ENV, **local}
        proc = start_fit(config, log, env=env)

        def two_steps_published() -> bool:
            latest = store.latest()
            return latest is not None and latest.step >= 2

        assert wait_for(two_steps_published, 300, proc), log.read_text()[-3000:]
        kill_tree(proc)
        resumed_from = store.latest()
        assert resumed_from is not None
        units = [p for p in resumed_from.parts if p.startswith("data_plane/") and "/su_0_" in p]
        assert units and all(resumed_from.parts[p].size > 0 for p in units), sorted(resumed_from.parts)
        assert "data_plane/metadata.json" in resumed_from.parts  # written on the head, beside them
        assert not list(disk.rglob("su_0_*.pkl")), "the unit's rows reached the head's disk"

        proc = start_fit(config, log, env=env)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"resuming from {url}/step_{resumed_from.step}" in text
    assert "resumed the rollout side" in text
    report = check_events(tmp_path / "run", IN_ORDER)
    assert report.ok, report.format()
    latest = store.latest()
    assert latest is not None and latest.step == 6
