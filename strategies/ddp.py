"""Lightning's DDP for screl runs: the same strategy, with ranks on one node meeting through a file.

``trainer.strategy: {class_path: screl.strategies.DDPStrategy}`` with ``trainer.devices: N``. Every rank holds
the whole policy and trains on its share of each step's groups; rank 0 runs the controller and refits the
generation workers from its copy. Lightning's own ``ddp`` would start torch's TCP store on every interface
(:mod:`screl.strategies.launch`), so ``screl check`` refuses it and names this class. See ``docs/scaling.md``.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy as _LightningDDP
from screl.strategies.launch import FileRendezvous

__all__ = ["DDPStrategy"]


class DDPStrategy(FileRendezvous, _LightningDDP):
    """Lightning's ``DDPStrategy`` (same arguments); on one node the ranks rendezvous through a file."""
