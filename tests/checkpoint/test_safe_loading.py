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


def _tq_like_pickle(obj: Any) -> bytes:
    import pickle

    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_data_plane_pickle_importing_a_callable_is_refused_before_transfer_queue_sees_it(
    tmp_path: Path, protocol: int
) -> None:
    import pickle

    marker = tmp_path / "pwned"
    store = _bundle(tmp_path / "ck", {"train_steps": 3}, {"state_dict": {}})
    info = store.latest()
    assert info is not None
    with store.begin(4) as w:
        w.write_bytes(LIGHTNING_CKPT, _torch_bytes({"state_dict": {}}))
        w.write_bytes(CONTROLLER_STATE, _torch_bytes({"train_steps": 4}))
        w.write_bytes("data_plane/metadata.json", b'{"storage_saved": true}')
        w.write_bytes("data_plane/controller_state.pkl", _tq_like_pickle({"partitions": {}}))
        w.write_bytes("data_plane/simple_storage/unit_0.pkl",
                      pickle.dumps({"rows": [_Payload(marker)]}, protocol=protocol))
        w.commit({"trainer_version": 4})
    with pytest.raises(ValueError, match=r"data_plane/simple_storage/unit_0\.pkl imports posix\.mkdir: "
                                         r"TransferQueue would unpickle it"):
        fetch_resume(str(tmp_path / "ck"), str(tmp_path / "local"), config={})
    assert not marker.exists()


def test_a_stack_global_built_from_unknown_values_is_refused() -> None:
    import pickletools

    from screl.checkpoint.pickle_scan import UnsafePickleError, check_pickle

    # module and name pushed, then a tuple built from them: STACK_GLOBAL cannot tell what is on the stack
    crafted = b"\x80\x04\x8c\x02os\x8c\x06system\x86\x8c\x01a\x93."
    assert [op.name for op, _, _ in pickletools.genops(crafted)][-3:] == ["SHORT_BINUNICODE", "STACK_GLOBAL", "STOP"]
    with pytest.raises(UnsafePickleError, match=r"x\.pkl: a STACK_GLOBAL whose module and name are not the strings"):
        check_pickle(crafted, "x.pkl")
    with pytest.raises(UnsafePickleError, match=r"y\.pkl imports builtins\.eval"):
        check_pickle(b"\x80\x04\x8c\x08builtins\x94\x8c\x04eval\x94\x93.", "y.pkl")
    with pytest.raises(UnsafePickleError, match=r"z\.pkl is not a readable pickle"):
        check_pickle(b"\x80\x04\x8c", "z.pkl")


class _SmuggledStorage:
    """Pickles as ``torch.storage._load_from_bytes(b)`` where ``b`` (a legacy torch.save) carries the payload."""

    def __init__(self, marker: Path) -> None:
        buf = io.BytesIO()
        torch.save({"hook": _Payload(marker)}, buf, _use_new_zipfile_serialization=False)
        self.raw = buf.getvalue()

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (torch.storage._load_from_bytes, (self.raw,))


def test_code_smuggled_inside_a_storage_blob_is_found() -> None:
    import pickle

    from screl.checkpoint.pickle_scan import UnsafePickleError, check_pickle

    smuggled = pickle.dumps({"rows": _SmuggledStorage(Path("/nonexistent/marker"))}, protocol=5)
    with pytest.raises(UnsafePickleError, match=r"unit\.pkl imports posix\.mkdir"):
        check_pickle(smuggled, "unit.pkl")
    zipped = _SmuggledStorage(Path("/nonexistent/marker"))
    zipped.raw = _torch_bytes({"hook": _Payload(Path("/nonexistent/marker"))})  # torch.save's zip format
    with pytest.raises(UnsafePickleError, match=r"unit\.pkl: a bytes value holding a zip or tar archive"):
        check_pickle(pickle.dumps(zipped, protocol=5), "unit.pkl")
    plain = pickle.dumps({"rows": [torch.arange(3).untyped_storage()]}, protocol=5)  # what a real unit holds
    check_pickle(plain, "unit.pkl")
