"""The device map (screl.placement) and ``screl check``'s placement refusals: pure, no Ray, nothing started."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from _check_helpers import load_config as _load
from _check_helpers import run_check as _check

from screl.cli import main
from screl.placement import DeviceMap, device_map, trainer_memory_bytes
from screl.placement_env import ENV_DEVICE_MAP, apply_trainer_devices

ROOT = Path(__file__).resolve().parents[1]
GEN = "data.init_args.generation"


def _gpu_tiny(**generation: Any) -> dict[str, Any]:
    """grpo_tiny.yaml with a GPU trainer (1 device) and a torch engine on cuda."""
    cfg = _load("grpo_tiny.yaml")
    cfg["trainer"].update(accelerator="gpu", devices=1)
    cfg["data"]["init_args"]["generation"].update(device="cuda", **generation)
    return cfg


def test_check_prints_the_device_map_and_the_budget_of_a_shared_gpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _gpu_tiny(num_gpus_per_worker=0.4, colocated={"resources": {"gpu_memory_gb": 80}})
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("devices "))
    assert "node 0: trainer GPU 0, inference GPU 0 (shared with the trainer) (1 worker(s))" in line, line
    assert "shared GPU: 1 worker(s) x 0.4 GPU" in line and "GB of 80 GB left to the trainer" in line, line


def test_check_prints_separate_devices_per_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _gpu_tiny(num_workers=2, colocated={"resources": {"num_nodes": 1, "gpus_per_node": 2, "node_gpus": 8}})
    cfg["trainer"]["devices"] = 4
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert "devices              node 0: trainer GPU 0,1,2,3, inference GPU 6,7 (2 worker(s)), left over 4,5" in out


def test_check_refuses_every_bad_placement_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Overlapping trainer and inference devices, oversubscribed inference GPUs, a trainer larger than its node:
    every one named with its key and fix, in one run of screl check."""
    cfg = _gpu_tiny(num_workers=6, num_gpus_per_worker=1,
                    colocated={"resources": {"num_nodes": 1, "gpus_per_node": 2, "node_gpus": 4}})
    cfg["trainer"]["devices"] = 4
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc == 2, out
    assert f"{GEN}.colocated.resources.gpus_per_node = 2: node 0 has 4 GPU(s): the trainer's 4" in out, out
    assert "overlap, so a worker would land on a trainer's device. Fix: make trainer.devices + inference GPUs <= 4" \
        in out, out
    assert f"{GEN}.num_gpus_per_worker = 1.0: 6 worker(s) x 1 GPU = 6 GPUs, but colocated.resources gives " \
        "generation 1 x 2 = 2: the inference devices are oversubscribed" in out, out
    cfg["trainer"]["devices"] = 6
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc == 2 and "trainer.devices = 6: the trainer takes 6 GPU(s) per node but node 0 has 4" in out, out


def test_check_refuses_a_device_list_on_the_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _gpu_tiny(num_gpus_per_worker=1)
    cfg["trainer"]["devices"] = [2, 3]
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc == 2 and "trainer.devices = [2, 3]: screl gives the trainer the node's first GPUs" in out, out


def test_a_shared_gpu_whose_engines_take_all_memory_is_refused() -> None:
    cfg = _gpu_tiny(backend="vllm", num_workers=2, num_gpus_per_worker=0.4,
                    backend_args={"gpu_memory_utilization": 0.6})
    problems = device_map(cfg).problems
    assert [p[0] for p in problems] == [f"{GEN}.backend_args.gpu_memory_utilization"], problems
    assert "2 engine(s) on the shared GPU take 2 x 0.6 = 1.20 of its memory" in problems[0][2]
    cfg["data"]["init_args"]["generation"]["backend_args"]["gpu_memory_utilization"] = 0.3
    assert device_map(cfg).problems == ()


def test_a_memory_share_that_leaves_the_trainer_less_than_its_estimate_is_refused() -> None:
    """Qwen2.5-1.5B at 8192 tokens per micro-batch (the GPU recipe): about 52 GB; a 24 GB GPU with a quarter to the
    engine leaves 18 GB. Without gpu_memory_gb nothing is checked; at 80 GB it fits."""
    cfg = _load("grpo_qwen2.5_1.5b_gpu.yaml")
    estimate = trainer_memory_bytes(cfg)
    assert estimate is not None and 40e9 < estimate < 70e9, estimate
    assert device_map(cfg).problems == ()
    res = cfg["data"]["init_args"]["generation"].setdefault("colocated", {}).setdefault("resources", {})
    res["gpu_memory_gb"] = 80
    assert device_map(cfg).problems == ()
    res["gpu_memory_gb"] = 24
    problems = device_map(cfg).problems
    assert len(problems) == 1 and problems[0][0] == f"{GEN}.backend_args.gpu_memory_utilization", problems
    assert f"leave the trainer 18.0 GB, less than its estimated peak of {estimate / 1e9:.1f} GB" in problems[0][2]


def test_fractional_workers_beyond_the_trainers_gpus_oversubscribe_the_node() -> None:
    cfg = _gpu_tiny(num_workers=3, num_gpus_per_worker=0.5)
    problems = device_map(cfg).problems
    assert len(problems) == 1 and "share 2 GPU(s) but the trainer has 1 on node 0" in problems[0][2], problems


def test_a_multi_node_plan_splits_the_workers_over_the_nodes() -> None:
    cfg = _gpu_tiny(num_workers=4, colocated={"resources": {"num_nodes": 2, "gpus_per_node": 2}})
    cfg["trainer"].update(devices=6, num_nodes=2)
    dmap = device_map(cfg, node_gpus=8)
    assert dmap.problems == ()
    assert [(n.node, n.trainer, n.inference, n.workers) for n in dmap.nodes] == [
        (0, (0, 1, 2, 3, 4, 5), (6, 7), 2), (1, (0, 1, 2, 3, 4, 5), (6, 7), 2)]
    assert DeviceMap.from_json(dmap.to_json()) == dmap


def test_auto_trainer_devices_take_the_rest_of_the_node() -> None:
    cfg = _gpu_tiny(num_workers=2, colocated={"resources": {"gpus_per_node": 2}})
    cfg["trainer"]["devices"] = "auto"
    node = device_map(cfg, node_gpus=8).nodes[0]
    assert (node.trainer, node.inference, node.left_over) == ((0, 1, 2, 3, 4, 5), (6, 7), ())


def test_fit_narrows_the_trainers_visible_devices_and_is_idempotent() -> None:
    cfg = _gpu_tiny(num_workers=2, colocated={"resources": {"gpus_per_node": 2}})
    cfg["trainer"]["devices"] = 2
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # the launcher gave this job four GPUs
    apply_trainer_devices(cfg, env)
    assert (env["CUDA_VISIBLE_DEVICES"], env["SCREL_INFERENCE_GPUS"], env["SCREL_NODE_GPUS"]) == ("4,5", "6,7",
                                                                                                 "4,5,6,7")
    first = dict(env)
    apply_trainer_devices(cfg, env)  # a rank Lightning launched runs the CLI again with the narrowed variable
    assert env == first
    other_node = {**first, "NODE_RANK": "1"}
    cfg["trainer"]["num_nodes"] = 2
    cfg["data"]["init_args"]["generation"]["colocated"]["resources"]["num_nodes"] = 2
    apply_trainer_devices(cfg, other_node)
    assert other_node["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_fit_refuses_a_plan_the_node_cannot_hold_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """screl check cannot see the node (node_gpus unset) and passes; screl fit counts it (one GPU here) and stops
    before the Trainer, Ray or any run directory exists."""
    cfg = _gpu_tiny(num_gpus_per_worker=1)
    cfg["trainer"]["default_root_dir"] = str(tmp_path / "run")
    rc, out = _check(copy.deepcopy(cfg), tmp_path, capsys)
    assert rc == 0, out
    for var in ("SCREL_NODE_GPUS", "SCREL_INFERENCE_GPUS", ENV_DEVICE_MAP):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{GEN}.num_gpus_per_worker = 1.0: node 0 has 1 GPU(s): the trainer's 1 (trainer.devices) and " \
        "generation's 1 overlap" in err, err
    assert not (tmp_path / "run").exists()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0" and ENV_DEVICE_MAP not in os.environ


def test_a_continuous_kv_cache_that_leaves_the_trainer_too_little_of_a_shared_gpu_is_refused() -> None:
    """The torch engine's continuous path holds its KV cache from the start: on a shared GPU of known size, the
    engines' caches and the trainer's estimate must fit (the batched paths allocate as they go: not checked)."""
    res = {"resources": {"gpu_memory_gb": 80}}
    cfg = _gpu_tiny(num_gpus_per_worker=0.4, colocated=res, backend_args={"decode": "continuous", "kv_cache_gb": 100})
    problems = device_map(cfg).problems
    assert [p[0] for p in problems] == [f"{GEN}.backend_args.kv_cache_gb"], problems
    assert "1 engine(s) x 100 GiB of KV cache on the shared 80 GB GPU" in problems[0][2], problems
    assert problems[0][3].startswith("lower kv_cache_gb to <= 7"), problems  # 80 GB less the tiny trainer's estimate
    cfg = _gpu_tiny(num_gpus_per_worker=0.4, colocated=res, backend_args={"decode": "continuous", "kv_cache_gb": 20})
    assert device_map(cfg).problems == ()
    cfg = _gpu_tiny(num_gpus_per_worker=0.4, colocated=res, backend_args={"decode": "static", "kv_cache_gb": 100})
    assert device_map(cfg).problems == ()
