"""A checkpoint bundle runs no code when it is loaded: every part loads with ``torch.load(weights_only=True)``,
and a part that holds anything but tensors and plain containers is refused, naming it."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from screl.checkpoint import CheckpointStore
from screl.checkpoint.resume import CONTROLLER_STATE, LIGHTNING_CKPT, fetch_resume


class _Payload:
    """Pickles as a call that makes a marker directory: what a tampered bundle could carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _bundle(root: Path, state: Any, ckpt: Any) -> CheckpointStore:
    store = CheckpointStore(str(root))
    with store.begin(3) as w:
        w.write_bytes(LIGHTNING_CKPT, _torch_bytes(ckpt))
        w.write_bytes(CONTROLLER_STATE, _torch_bytes(state))
        w.commit({"trainer_version": 3})
    return store


def test_a_controller_state_holding_a_callable_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _bundle(tmp_path / "ck", {"train_steps": 3, "hook": _Payload(marker)}, {"state_dict": {}})
    with pytest.raises(ValueError, match=r"controller_state\.pt of .*step_3 holds more than tensors and plain "
                                         r"containers .*weights_only=True"):
        fetch_resume(str(tmp_path / "ck"), str(tmp_path / "local"), config={})
    assert not marker.exists(), "loading the bundle ran its code"
    # the payload is live: an unrestricted load would have run it
    torch.load(io.BytesIO(_torch_bytes({"hook": _Payload(marker)})), weights_only=False)
    assert marker.is_dir()


def test_a_plain_controller_state_loads(tmp_path: Path) -> None:
    state = {"train_steps": 3, "in_flight": [("g-1", 0, (1, 2))], "weights": torch.arange(3)}
    _bundle(tmp_path / "ck", state, {"state_dict": {}})
    resume = fetch_resume(str(tmp_path / "ck"), str(tmp_path / "local"), config={})
    assert resume is not None and resume.step == 3
    assert resume.controller_state["in_flight"] == state["in_flight"] and torch.equal(resume.controller_state["weights"], torch.arange(3))
