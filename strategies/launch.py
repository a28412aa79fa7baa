"""Starting the process group on one machine without a listening socket.

torch's TCP store, which ``init_process_group``'s default ``env://`` rendezvous starts on rank 0, listens on every
interface, whatever ``MASTER_ADDR`` says. When Lightning starts the ranks itself (``screl fit`` with
``trainer.devices: N`` on one node), screl's strategies (:class:`~screl.strategies.MegatronStrategy`,
:class:`~screl.strategies.DDPStrategy`, both through :class:`FileRendezvous`) rendezvous through a file
instead (``init_method="file://..."``): the launching process picks the file before it starts the others, which
inherit its name in :data:`INIT_FILE_ENV`. Nothing listens, so nothing can be reached from outside.

Launchers that start the processes themselves (torchrun, SLURM, several nodes) keep their own rendezvous: a
multi-node job needs a store its peers can reach, on the cluster's network (docs/scaling.md).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _Base
else:
    _Base = object

INIT_FILE_ENV = "SCREL_DIST_INIT_FILE"
"""The rendezvous file of one launch, set by the launching process for the ranks it starts."""


class FileRendezvous(_Base):
    """Mixin for a subclass of Lightning's ``DDPStrategy`` (listed before it): ranks Lightning starts on one node
    meet through a file, not a TCP store listening on every interface; other launches keep ``env://``."""

    @override
    def _configure_launcher(self) -> None:
        """In the process that launches the ranks (one node, Lightning's own launcher): name the rendezvous file,
        which the ranks it starts inherit."""
        super()._configure_launcher()
        env = self.cluster_environment
        if self.num_nodes == 1 and env is not None and not env.creates_processes_externally:
            # a fresh file per launch, never one an earlier trainer of this process (or of its parent, through the
            # environment) used: a used file holds that group's rendezvous, and the new ranks would wait on it
            os.environ[INIT_FILE_ENV] = os.path.join(tempfile.gettempdir(), f"screl-pg-{uuid.uuid4().hex}")

    @override
    def setup_distributed(self) -> None:
        path = os.environ.get(INIT_FILE_ENV)
        if path is not None and self.num_nodes == 1 and not torch.distributed.is_initialized():
            self.set_world_ranks()
            torch.distributed.init_process_group(self._get_process_group_backend(), init_method=f"file://{path}",
                                                 rank=self.global_rank, world_size=self.world_size,
                                                 timeout=self._timeout)
        super().setup_distributed()  # an initialized group is kept as it is; other launches keep ``env://``
