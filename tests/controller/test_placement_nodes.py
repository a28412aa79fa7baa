"""A two-node plan on a real two-node Ray cluster on loopback with logical GPUs (``ray start --num-gpus 4``, the
multi-node test's way: ``tests/recovery/ray_nodes.py``): the trainer's node (the head, 4 GPUs) and a generation node
(4 GPUs, offering ``rollout_node``). Inference lands on the generation node only; a plan that would share the
trainer's node with a raylet offering every GPU is refused before any worker starts. One cluster for the file."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from _ray_session import ray_set_aside
from recovery.ray_nodes import RayNodes

from screl.config import GenerationConfig, from_dict
from screl.controller.resources import check_cluster_fits, worker_resources
from screl.controller.runtime import check_joined_cluster
from screl.dataplane import start_local_ray, stop_ray_if_started
from screl.placement_env import apply_trainer_devices

GEN = {"backend": "torch", "device": "cuda", "num_workers": 4, "num_cpus_per_worker": 0.25,
       "resources": {"rollout_node": 1}, "colocated": {"resources": {"num_nodes": 1, "gpus_per_node": 4}}}
CFG: dict[str, Any] = {"trainer": {"accelerator": "gpu", "devices": 2, "num_nodes": 1},
                       "data": {"init_args": {"generation": GEN}}}


class Probe:
    """Stands in for a generation worker: the same Ray options; it reports its node and GPU ids."""

    def where(self) -> tuple[str, list[str]]:
        return ray.get_runtime_context().get_node_id(), [str(i) for i in ray.get_gpu_ids()]


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import the test module


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayNodes]:
    with RayNodes(head_cpus=2, head_resources={"head_node": 1}, head_gpus=4,
                  kinds=[(2, {"rollout_node": 4}, 4)]) as nodes, ray_set_aside():
        started = start_local_ray(namespace="placement", address=nodes.address)
        assert started, "Ray was already running in this process"
        try:
            yield nodes
        finally:
            stop_ray_if_started(started)


def test_a_two_node_plan_places_inference_on_the_generation_node(cluster: RayNodes) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    dmap = apply_trainer_devices(CFG, env)
    assert not dmap.problems, dmap.problems
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    node0, node1 = dmap.node(0), dmap.node(1)
    assert node0 is not None and node1 is not None
    assert (node0.trainer, node0.inference, node0.left_over) == ((0, 1), (), (2, 3))
    assert (node1.trainer, node1.inference, node1.workers) == ((), (0, 1, 2, 3), 4)
    g = from_dict(GenerationConfig, GEN)
    check_cluster_fits(g, ray.cluster_resources())
    check_joined_cluster(g, env)  # the head offers GPUs, but not rollout_node: no worker can land there
    probes = [ray.remote(Probe).options(**worker_resources(g).actor_options()).remote()  # type: ignore[attr-defined]
              for _ in range(g.num_workers)]
    got = ray.get([p.where.remote() for p in probes], timeout=60)
    generation_node = cluster.nodes[0]["node_id"]
    assert {node for node, _ in got} == {generation_node}, got
    assert sorted(i for _, ids in got for i in ids) == ["0", "1", "2", "3"], got
    for p in probes:
        ray.kill(p)


def test_a_joined_trainer_node_that_offers_the_trainers_gpus_is_refused(cluster: RayNodes) -> None:
    """Without ``resources`` the plan puts generation on the trainer's node (GPUs 2,3); the head's raylet offers
    all 4, so Ray could hand a worker GPU 0: refused before any worker starts, naming the fix."""
    cfg = copy.deepcopy(CFG)
    gen = cfg["data"]["init_args"]["generation"]
    gen.pop("resources")
    gen.update(num_workers=2, colocated={"resources": {"num_nodes": 1, "gpus_per_node": 2}})
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    dmap = apply_trainer_devices(cfg, env)
    assert not dmap.problems and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    g = from_dict(GenerationConfig, gen)
    with pytest.raises(RuntimeError, match=r"offers 4 GPU\(s\) but the device map gives generation 2 there.*"
                       r"CUDA_VISIBLE_DEVICES=2,3 ray start --num-gpus 2"):
        check_joined_cluster(g, env)
