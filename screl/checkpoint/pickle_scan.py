"""A static check of the pickles TransferQueue writes into a bundle's ``data_plane/``, before it loads them.

TransferQueue saves its controller and storage units with ``pickle`` and loads them with ``pickle.load``, so a
tampered ``data_plane/`` could run code inside its actors on resume. screl reads every pickle there first,
opcode by opcode, *without unpickling it* (``pickletools.genops``), and refuses a file that imports anything
outside :data:`ALLOWED_GLOBALS`: the classes and tensor-rebuild functions TransferQueue's own snapshots use.
Bytes values that hold pickles themselves (a torch storage pickles as a legacy ``torch.save``, which
``torch.storage._load_from_bytes`` unpickles without restriction) are scanned the same way.

How a global is found: ``GLOBAL`` and ``INST`` name it inline; ``STACK_GLOBAL`` takes the module and the name
from the two values just pushed, which a pickler writes as two strings (or memo reads of strings) right before
it. Any other opcode in between makes the names unknowable, and the file is refused: a well-formed pickle never
does that. The extension registry (``EXT1/2/4``) is refused too.
"""

from __future__ import annotations

import io
import os
import pickletools
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["ALLOWED_GLOBALS", "UnsafePickleError", "check_pickle", "check_pickles_under"]

ALLOWED_GLOBALS: frozenset[str] = frozenset({
    "collections.OrderedDict", "builtins.set", "builtins.frozenset",
    "torch._utils._rebuild_tensor_v2", "torch.storage._load_from_bytes",
    "torch.float32", "torch.float16", "torch.bfloat16", "torch.float64", "torch.int64", "torch.int32",
    "torch.int16", "torch.int8", "torch.uint8", "torch.bool",
    "transfer_queue.controller.DataPartitionStatus", "transfer_queue.controller.FieldMeta",
    # storage types named inside a legacy torch.save (the persistent ids of its storages)
    "torch.storage.UntypedStorage", "torch.storage.TypedStorage", "torch.FloatStorage", "torch.DoubleStorage",
    "torch.HalfStorage", "torch.BFloat16Storage", "torch.LongStorage", "torch.IntStorage", "torch.ShortStorage",
    "torch.CharStorage", "torch.ByteStorage", "torch.BoolStorage",
})
"""``module.name`` of every global a TransferQueue 0.1.11 snapshot imports (its controller's partition status and
field metadata, torch tensors and storages, dtypes). ``torch.storage._load_from_bytes`` unpickles the bytes it is
given without restriction, so those bytes are scanned too (:func:`_embedded_pickles`)."""

_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                         "SHORT_BINSTRING"})
_BYTES_OPS = frozenset({"SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"})
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_NEUTRAL = frozenset({"MEMOIZE", "FRAME", "PROTO"})
_LEGACY_TORCH_PICKLES = 5
"""A legacy ``torch.save`` (what a storage pickles to) is five pickles (magic number, protocol, system info, the
object, the storage keys) followed by raw storage bytes."""


class UnsafePickleError(ValueError):
    """A pickle in a bundle imports something that could run code when TransferQueue loads it."""


def _allowed(qualname: str) -> bool:
    return qualname in ALLOWED_GLOBALS


def _embedded_pickles(data: bytes) -> Iterator[str]:
    """The globals of the pickles inside a bytes value that looks like a pickle (legacy ``torch.save`` output).
    ``torch.load`` also reads zip and tar archives, unpickling their members: a bytes value in either is refused."""
    if data.startswith(b"PK") or data[257:262] == b"ustar":
        raise UnsafePickleError("a bytes value holding a zip or tar archive (torch.load would unpickle its members)")
    if not data.startswith(b"\x80"):
        return
    stream = io.BytesIO(data)
    for _ in range(_LEGACY_TORCH_PICKLES):
        if stream.read(1) != b"\x80":
            return
        stream.seek(-1, io.SEEK_CUR)
        start = stream.tell()
        for _op in pickletools.genops(stream):  # advances the stream past this pickle's STOP
            pass
        yield from pickle_globals(data[start:stream.tell()])


def pickle_globals(data: bytes) -> Iterator[str]:
    """Every ``module.name`` the pickle ``data`` imports, in order, those of pickles inside its bytes values
    included (raises on one it cannot determine)."""
    memo: dict[Any, Any] = {}
    pushed: list[Any] = []  # the values pushed since the last opcode that was not a string push or a memo op
    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name in _BYTES_OPS:
            if isinstance(arg, (bytes, bytearray)):
                yield from _embedded_pickles(bytes(arg))
            pushed = []
        elif name in _STRING_OPS:
            pushed.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in _MEMO_PUTS:
            memo[arg] = pushed[-1] if pushed else None
        elif name in _MEMO_GETS:
            pushed.append(memo.get(arg))
        elif name in ("GLOBAL", "INST"):
            yield str(arg).replace(" ", ".", 1)
            pushed = []
        elif name == "STACK_GLOBAL":
            if len(pushed) < 2 or not all(isinstance(v, str) for v in pushed[-2:]):
                raise UnsafePickleError("a STACK_GLOBAL whose module and name are not the strings just pushed")
            yield f"{pushed[-2]}.{pushed[-1]}"
            pushed = []
        elif name.startswith("EXT"):
            raise UnsafePickleError(f"an extension-registry import ({name})")
        elif name not in _NEUTRAL:
            pushed = []


def check_pickle(data: bytes, what: str) -> None:
    """Refuse the pickle ``data`` (named ``what`` in the error) if it imports anything not allowed."""
    try:
        bad = sorted({g for g in pickle_globals(data) if not _allowed(g)})
    except UnsafePickleError as err:
        raise UnsafePickleError(f"{what}: {err}; screl refuses to hand it to TransferQueue") from None
    except Exception as err:  # noqa: BLE001 - truncated or not a pickle at all
        raise UnsafePickleError(f"{what} is not a readable pickle ({type(err).__name__}: {err})") from None
    if bad:
        raise UnsafePickleError(
            f"{what} imports {', '.join(bad)}: TransferQueue would unpickle it, which could run code. Resume only "
            "from bundles screl wrote, or drop the bundle's data_plane/ (checkpointing.save_data_plane: false)."
        )


def _pickles(root: str) -> Iterable[str]:
    for dirpath, _dirnames, filenames in os.walk(root):
        for fname in sorted(filenames):
            if fname.endswith(".pkl"):
                yield os.path.join(dirpath, fname)


def check_pickles_under(root: str, label: str) -> int:
    """:func:`check_pickle` every ``.pkl`` file under ``root`` (names relative to ``label``); returns the count."""
    count = 0
    for path in _pickles(root):
        with open(path, "rb") as f:
            check_pickle(f.read(), f"{label}/{os.path.relpath(path, root)}")
        count += 1
    return count
