"""A real three-node Ray cluster on loopback, joined with ``ray.address``: generation placed on one node by
resources, TransferQueue's storage unit on another whose "disk" is its own, checkpoints on S3. The generation node
is killed (the run fails fast naming it), a fresh one is added, and the run resumes from S3, its rollout side
downloaded by the storage node itself."""

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
ROLLOUT = 0
"""The generation node's kind (no CPU of its own to offer, so nothing else lands there); kind 1 is the storage
unit's node."""


def _multinode_config(tmp_path: Path, url: str, s3_options: dict[str, Any], address: str, disk: Path) -> Path:
    config = with_snapshots(recovery_config(tmp_path, url, steps=6, sampler=IN_ORDER, storage_options=s3_options))
    cfg = yaml.safe_load(config.read_text())
    cfg["ray"] = {"address": address}
    cfg["trainer"]["default_root_dir"] = str(disk / "root")  # the resume downloads there: the head's disk only
    cfg["data"]["init_args"]["generation"].update(num_workers=1, num_cpus_per_worker=0,
                                                  resources={"rollout_node": 1})
    cfg["data_plane"] = {"storage_node_resource": "store_node"}
    cfg["async_rl"]["watchdog"] = {"health_check_interval_s": 0.5}
    config.write_text(yaml.safe_dump(cfg))
    return config


def test_a_lost_generation_node_fails_fast_and_the_run_resumes_from_s3_with_storage_on_its_own_disk(
        tmp_path: Path, s3_options: dict[str, Any]) -> None:
    """The storage unit's node has its own disk: a private tmpfs over the directory where the trainer and the
    controller stage bundles and snapshots. So TransferQueue's save leaves the unit's rows on a disk no other
    process sees; that node uploads them to S3 itself, and before the resume downloads them back itself."""
    disk = tmp_path / "disk"  # the head's local disk; the other nodes see an empty tmpfs here
    disk.mkdir()
    local = {"TMPDIR": str(disk), "RAY_TMPDIR": tempfile.gettempdir()}  # Ray's own files stay shared
    env = {**S3_ENV, **local}
    url = f"s3://screl-ckpt-tests/{uuid.uuid4().hex}/bundles"
    store = CheckpointStore(url, s3_options)
    log = tmp_path / "fit.log"
    try:
        cluster = RayNodes(head_cpus=6, head_resources={"head_node": 1},
                           kinds=[(0, {"rollout_node": 1}), (1, {"store_node": 1})], private_dir=str(disk), env=local)
    except NoPrivateDisk as why:
        pytest.skip(f"no mount namespace for a node's own disk here: {why}")
    with cluster:
        config = _multinode_config(tmp_path, url, s3_options, cluster.address, disk)
        proc = start_fit(config, log, env=env)

        def two_steps_published() -> bool:
            latest = store.latest()
            return latest is not None and latest.step >= 2

        assert wait_for(two_steps_published, 300, proc), log.read_text()[-3000:]
        wide = [a for a in listening_addresses(cluster.pids()) if a[1] not in LOOPBACK_IPS]
        assert not wide, f"listening beyond loopback: {wide}"
        lost = cluster.nodes[ROLLOUT]["node_id"]
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
        units = [p for p in resumed_from.parts if p.startswith("data_plane/") and "/su_0_" in p]
        assert units and all(resumed_from.parts[p].size > 0 for p in units), sorted(resumed_from.parts)
        assert "data_plane/metadata.json" in resumed_from.parts  # written on the head, beside them
        assert not list(disk.rglob("su_0_*.pkl")), "the unit's rows reached the head's disk"
        cluster.add(ROLLOUT)
        proc = start_fit(config, log, env=env)
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"resuming from {url}/step_{resumed_from.step}" in text
    assert "resumed the rollout side" in text
    report = check_events(tmp_path / "run", IN_ORDER)
    assert report.ok, report.format()
    latest = store.latest()
    assert latest is not None and latest.step == 6
