"""TransferQueue in one process: its controller and its one storage unit in a single Ray actor.

``transfer_queue.init()`` starts the controller, waits for it, then starts each storage unit as an actor of its own:
on one node with one unit (screl's default) that is two Python processes, each importing torch and tensordict
(about 3.5 CPU-seconds each), one after the other. :class:`TransferQueueHost` is TQ's controller class with the
storage unit built inside it: the same ZMQ servers, the same controller name (``transfer_queue/
TransferQueueController``) other processes attach by, the same config they read from it, one process.

:func:`start_hosted` is ``transfer_queue.init()``'s first-time path for that shape; a run that places its storage
(``data_plane.storage_node_resource``) or asks for several units gets TQ's own actors (:func:`hosts_storage`).
Losing the host loses the controller and the rows together, as losing either actor did before (a run stops with
``DataPlaneLostError`` and resumes from its last bundle: ``docs/failures.md``).
"""

from __future__ import annotations

from importlib import resources
from typing import Any
from uuid import uuid4

import ray
from omegaconf import DictConfig, OmegaConf
from transfer_queue import interface as _tqi
from transfer_queue.controller import TransferQueueController
from transfer_queue.storage.simple_storage import SimpleStorageUnit

HOSTED_UNIT = "TransferQueueStorageUnit#0"
"""The hosted unit's name in the config's ``zmq_info`` (TQ's own name for unit 0: snapshots keep their layout)."""


def hosts_storage(conf: DictConfig) -> bool:
    """Whether ``conf`` (a data plane's TQ config) runs as one process: one storage unit, placed anywhere."""
    simple = conf.backend.SimpleStorage
    return int(simple.num_data_storage_units) == 1 and simple.get("required_node_resource") is None


class TransferQueueHost(TransferQueueController.__ray_actor_class__):  # type: ignore[name-defined,misc]
    """TQ's controller, holding storage unit 0 in the same process (its ZMQ server threads run beside the
    controller's)."""

    def __init__(self, storage_config: dict[str, Any], **controller_kwargs: Any) -> None:
        super().__init__(**controller_kwargs)
        self._unit = SimpleStorageUnit.__ray_actor_class__(config=storage_config)  # type: ignore[attr-defined]

    def storage_zmq_info(self) -> dict[str, Any]:
        return {HOSTED_UNIT: self._unit.get_zmq_server_info()}


def start_hosted(conf: DictConfig, name: str, namespace: str) -> None:
    """Start TQ as one :class:`TransferQueueHost` actor named ``namespace/name`` and build this process's client
    (what ``transfer_queue.init(conf)`` does the first time, with the unit inside the controller)."""
    final = OmegaConf.merge(OmegaConf.create({}, flags={"allow_objects": True}),
                            OmegaConf.load(str(resources.files("transfer_queue") / "config.yaml")), conf)
    assert isinstance(final, DictConfig)
    storage = dict(final.backend.SimpleStorage)
    storage["_run_id"] = uuid4().hex  # TQ's bootstrap gives its units one run id (their SSD files' prefix)
    sampler = getattr(_tqi, str(final.controller.sampler))
    actor = ray.remote(TransferQueueHost).options(  # type: ignore[attr-defined]
        name=name, namespace=namespace, num_cpus=2  # the controller's CPU and its unit's, as TQ's two actors asked
    )
    host: Any = actor.remote(storage, sampler=sampler, polling_mode=bool(final.controller.polling_mode))
    _tqi._TQ_CONTROLLER = host
    final.controller.zmq_info = ray.get(host.get_zmq_server_info.remote())
    final.backend.SimpleStorage.zmq_info = ray.get(host.storage_zmq_info.remote())
    ray.get(host.store_config.remote(final))
    _tqi._maybe_create_tq_client(final)
