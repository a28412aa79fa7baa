"""The device map enforced on one node: the local Ray cluster ``screl fit`` starts holds only the inference GPUs.

Ray runs here with logical GPUs: the node has 4 (``CUDA_VISIBLE_DEVICES=0,1,2,3``), the trainer takes 2 and
generation 2 (``colocated.resources.gpus_per_node``). The generation workers' actor options are the runtime's own
(``worker_resources``); a small probe actor with those options reads ``ray.get_gpu_ids()`` and the
``CUDA_VISIBLE_DEVICES`` Ray gives it. One cluster for the file."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from _ray_session import ray_set_aside

from screl.config import GenerationConfig, from_dict
from screl.controller.resources import check_cluster_fits, worker_resources
from screl.dataplane import start_local_ray, stop_ray_if_started
from screl.placement import DeviceMap
from screl.placement_env import apply_trainer_devices, local_ray_gpu_ids

GEN = {"backend": "torch", "device": "cuda", "num_workers": 2, "num_cpus_per_worker": 0.5,
       "colocated": {"resources": {"num_nodes": 1, "gpus_per_node": 2}}}
CFG: dict[str, Any] = {"trainer": {"accelerator": "gpu", "devices": 2, "num_nodes": 1},
                       "data": {"init_args": {"generation": GEN}}}


class Probe:
    """Stands in for a generation worker: the same Ray options, and it reports what Ray gave it."""

    def gpus(self) -> tuple[list[str], str | None]:
        return [str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import the test module


@pytest.fixture(scope="module")
def placed() -> Iterator[tuple[dict[str, str], DeviceMap, GenerationConfig]]:
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # the node as the screl fit process finds it
    dmap = apply_trainer_devices(CFG, env)
    assert not dmap.problems, dmap.problems
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with ray_set_aside():  # this file's cluster has logical GPUs: not the worker's shared one
        started = start_local_ray(num_cpus=4, gpu_ids=local_ray_gpu_ids(env))
        assert started, "Ray was already running in this process"
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before, "the driver's CUDA_VISIBLE_DEVICES must not change"
        try:
            yield env, dmap, from_dict(GenerationConfig, GEN)
        finally:
            stop_ray_if_started(started)


def test_the_workers_get_only_inference_gpus_and_the_trainer_only_its_own(
        placed: tuple[dict[str, str], DeviceMap, GenerationConfig]) -> None:
    env, dmap, g = placed
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # the trainer's processes see only theirs
    assert dmap.inference_ids(0, ["0", "1", "2", "3"]) == ["2", "3"]
    assert ray.cluster_resources().get("GPU") == 2.0  # Ray was told the inference GPUs only
    opts = worker_resources(g).actor_options()
    probes = [ray.remote(Probe).options(**opts).remote() for _ in range(g.num_workers)]  # type: ignore[attr-defined]
    got = ray.get([p.gpus.remote() for p in probes], timeout=60)
    worker_ids = [ids for ids, _ in got]
    assert sorted(i for ids in worker_ids for i in ids) == ["2", "3"], got  # each worker one inference GPU
    assert all(len(ids) == 1 for ids in worker_ids), got
    assert {cvd for _, cvd in got} == {"2", "3"}, got  # what CUDA in the worker will see: the physical device
    trainer = set(env["CUDA_VISIBLE_DEVICES"].split(","))
    assert trainer.isdisjoint(i for ids in worker_ids for i in ids)
    for p in probes:
        ray.kill(p)


def test_a_third_worker_does_not_fit_the_inference_gpus(
        placed: tuple[dict[str, str], DeviceMap, GenerationConfig]) -> None:
    """Ray has no trainer GPU to hand out, so a worker beyond the inference GPUs is refused before any starts."""
    _, _, g = placed
    more = from_dict(GenerationConfig, {**GEN, "num_workers": 3, "num_gpus_per_worker": 1})
    with pytest.raises(RuntimeError, match=r"3 worker\(s\) x 1 GPU = 3 GPU, the Ray cluster has 2"):
        check_cluster_fits(more, ray.cluster_resources())
    check_cluster_fits(g, ray.cluster_resources())  # the planned two fit
