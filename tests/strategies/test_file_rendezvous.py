"""The file rendezvous of ranks Lightning starts on one node (``strategies/launch.py``): each launch names a file
of its own. A process that ran a trainer before (a test worker, a notebook) keeps the variable in its environment,
and a ``screl fit`` it starts inherits it: reusing that file made the new job's two ranks wait on the old group's
rendezvous (a recipe twin hung 600 s after in-process Megatron runs in the same test worker)."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch import Trainer
from screl.strategies import DDPStrategy
from screl.strategies.launch import INIT_FILE_ENV


def test_every_launch_names_a_fresh_rendezvous_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INIT_FILE_ENV, "/tmp/screl-pg-a-used-one")  # left by an earlier trainer of this process
    # LOCAL_RANK, which an in-process trainer earlier in this test worker may have left, makes Lightning take the
    # ranks for externally started ones (no launch at all): this test is about the process that launches them
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen = []
    for _ in range(2):
        Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), logger=False, enable_checkpointing=False)
        seen.append(os.environ[INIT_FILE_ENV])
    assert "/tmp/screl-pg-a-used-one" not in seen
    assert len(set(seen)) == 2 and all(os.path.basename(p).startswith("screl-pg-") for p in seen)
    assert not any(os.path.exists(p) for p in seen)  # named, not created: the ranks create it as they meet
