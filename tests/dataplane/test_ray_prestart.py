"""``screl fit`` begins Ray's local start before it imports Lightning (:mod:`screl.prestart`), and the rollout side
takes that cluster over when it asks for the same one (:func:`screl.dataplane.cluster.start_local_ray`)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from screl.prestart import prestart_for_command, ray_block

CLI = str(Path(__file__).resolve().parents[2] / "screl" / "cli.py")


def _config(tmp_path: Path, ray: dict[str, object] | None) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"max_steps": 1}, **({"ray": ray} if ray is not None else {})}))
    return str(path)


def test_the_ray_block_follows_the_config_files_then_the_command_line(tmp_path: Path) -> None:
    first = _config(tmp_path, {"num_cpus": 3})
    second = tmp_path / "d.yaml"
    second.write_text(yaml.safe_dump({"ray": {"namespace": "other"}}))
    assert ray_block(["--config", first]) == {"num_cpus": 3, "namespace": "screl", "address": None}
    assert ray_block(["--config", first, f"--config={second}", "--ray.num_cpus", "5"]) == {
        "num_cpus": 5, "namespace": "other", "address": None}
    assert ray_block(["--config", first, "--ray.address=127.0.0.1:6379"])["address"] == "127.0.0.1:6379"  # type: ignore[index]


@pytest.mark.parametrize("args", [["--ray", "{num_cpus: 2}"], ["--print_config"], ["--config", "/nonexistent.yaml"],
                                  ["--help"]])
def test_arguments_it_does_not_read_leave_ray_to_the_run(args: list[str]) -> None:
    assert ray_block(args) is None


def test_only_a_first_screl_fit_on_a_machine_without_gpus_and_a_local_cluster_prestarts(tmp_path: Path) -> None:
    joined = _config(tmp_path, {"address": "127.0.0.1:6379"})
    no_gpus = {"CUDA_VISIBLE_DEVICES": ""}
    assert prestart_for_command(["screl", "check", "--config", joined], no_gpus) is False
    assert prestart_for_command(["pytest", "fit"], no_gpus) is False
    assert prestart_for_command([CLI, "fit", "--config", joined], no_gpus) is False  # joins a cluster
    assert prestart_for_command([CLI, "fit"], {**no_gpus, "LOCAL_RANK": "1"}) is False  # a launched rank
    assert prestart_for_command([CLI, "fit"], {**no_gpus, "SCREL_RAY_PRESTART": "0"}) is False


def _spawned_child_prestarts(cli: str, queue: Any) -> None:
    from screl.prestart import prestart_for_command as child_prestart

    queue.put(child_prestart([cli, "fit"], {"CUDA_VISIBLE_DEVICES": ""}))


def test_a_process_that_multiprocessing_spawned_does_not_prestart() -> None:
    """A spawned child re-imports the CLI with its parent's arguments (Lightning's ddp_spawn): it must not start a
    second cluster."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_spawned_child_prestarts, args=(CLI, queue))
    child.start()
    child.join(120)
    assert child.exitcode == 0 and queue.get(timeout=5) is False


SCRIPT = """
import json, sys, ray
from screl.dataplane import cluster
out = {}
cluster.prestart_local_ray(3, "screl", log_to_driver=False)
out["same"] = cluster.start_local_ray(num_cpus=3, namespace="screl", gpu_ids=[])
out["same_cpus"] = ray.cluster_resources().get("CPU")
out["adopted"] = cluster.adopted_prestart_s() is not None
ray.shutdown()
cluster.prestart_local_ray(3, "screl", log_to_driver=False)
out["other"] = cluster.start_local_ray(num_cpus=4, namespace="screl", gpu_ids=[])
out["other_cpus"] = ray.cluster_resources().get("CPU")
out["other_adopted"] = cluster.adopted_prestart_s() is not None
ray.shutdown()
cluster.prestart_local_ray(2, "screl", log_to_driver=False)  # nobody takes it: shut down at exit
print(json.dumps(out))
"""


def test_a_prestarted_cluster_is_taken_over_when_it_matches_and_replaced_when_it_does_not() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"same": True, "same_cpus": 3.0, "adopted": True,
                   "other": True, "other_cpus": 4.0, "other_adopted": False}
    assert "SIGTERM handler is not set" not in proc.stderr
