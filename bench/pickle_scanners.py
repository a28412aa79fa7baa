#!/usr/bin/env python
"""screl's data-plane pickle scanner against the maintained ones (picklescan, fickling), on the same payloads.

screl scans every ``.pkl`` of a bundle's ``data_plane/`` before TransferQueue unpickles it
(``screl.checkpoint.pickle_scan``: an allowlist of the globals TransferQueue's snapshots use, opcode by opcode,
nested torch storages included). The payloads: those of ``tests/checkpoint/test_safe_loading.py``, a few that
picklescan's and fickling's own test suites use (``os.system``, ``builtins.exec``, ``subprocess.Popen``,
``runpy._run_code``, ``webbrowser.open``), the same through ``STACK_GLOBAL`` at protocols 0, 2 and 5, and two
benign snapshots that every scanner must let through. Each cell: ``flag`` (refused) or ``pass``.

    pip install -e '.[bench]'        # picklescan and fickling
    python bench/pickle_scanners.py  # prints the table; --json PATH writes it

Written to bench/results/pickle_scanners.json (see docs/checkpointing.md).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch


class _Call:
    """Pickles as ``fn(*args)`` (what a tampered snapshot would carry)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.fn, self.args)


class _SmuggledStorage:
    """Pickles as ``torch.storage._load_from_bytes(b)``, ``b`` a legacy ``torch.save`` carrying ``os.system``."""

    def __init__(self) -> None:
        buf = io.BytesIO()
        torch.save({"hook": _Call(os.system, "true")}, buf, _use_new_zipfile_serialization=False)
        self.raw = buf.getvalue()

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (torch.storage._load_from_bytes, (self.raw,))


def payloads() -> dict[str, tuple[bytes, bool]]:
    """name -> (pickle bytes, whether a scanner must refuse it). A class no TransferQueue snapshot holds is counted
    as one to refuse: harmless here, but an allowlist cannot tell it from one that is not."""
    import runpy
    import subprocess
    import webbrowser

    out: dict[str, tuple[bytes, bool]] = {}
    for proto in (0, 2, 5):
        out[f"os.mkdir in a row (protocol {proto})"] = (pickle.dumps({"rows": [_Call(os.mkdir, "/tmp/x")]},
                                                                      protocol=proto), True)
    out["os.system"] = (pickle.dumps(_Call(os.system, "true"), protocol=4), True)
    out["builtins.exec"] = (pickle.dumps(_Call(exec, "print(1)"), protocol=4), True)
    out["builtins.eval via STACK_GLOBAL"] = (b"\x80\x04\x8c\x08builtins\x94\x8c\x04eval\x94\x93.", True)
    out["subprocess.Popen"] = (pickle.dumps(_Call(subprocess.Popen, ["true"]), protocol=4), True)
    out["runpy._run_code"] = (pickle.dumps(_Call(runpy._run_code, "1", {}), protocol=4), True)  # type: ignore[attr-defined]
    out["webbrowser.open"] = (pickle.dumps(_Call(webbrowser.open, "http://x"), protocol=4), True)
    out["STACK_GLOBAL from a built tuple"] = (b"\x80\x04\x8c\x02os\x8c\x06system\x86\x8c\x01a\x93.", True)
    out["os.system inside a torch storage blob"] = (pickle.dumps({"rows": _SmuggledStorage()}, protocol=5), True)
    out["a class no snapshot holds (collections.Counter)"] = (pickle.dumps(__import__("collections").Counter("ab"), protocol=4),
                                                  True)
    out["benign: tensors' storages (a storage unit)"] = (
        pickle.dumps({"rows": [torch.arange(3).untyped_storage()]}, protocol=5), False)
    out["benign: plain containers (a controller)"] = (
        pickle.dumps({"partitions": {"train": {"keys": ["a", "b"], "sizes": (1, 2)}}}, protocol=5), False)
    return out


def ours(data: bytes) -> bool:
    from screl.checkpoint.pickle_scan import UnsafePickleError, check_pickle

    try:
        check_pickle(data, "x.pkl")
    except UnsafePickleError:
        return True
    return False


def picklescan(data: bytes) -> bool:
    from picklescan.scanner import scan_pickle_bytes

    result = scan_pickle_bytes(io.BytesIO(data), "x.pkl")
    return bool(result.issues_count or result.infected_files or result.scan_err)


def fickling(data: bytes) -> bool:
    import fickling as fk

    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as fh:
        fh.write(data)
    try:
        return not bool(fk.scan_file(fh.name, graceful=True))
    finally:
        os.unlink(fh.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    scanners = {"screl": ours, "picklescan": picklescan, "fickling": fickling}
    rows = []
    for name, (data, malicious) in payloads().items():
        flags = {s: fn(data) for s, fn in scanners.items()}
        rows.append({"payload": name, "malicious": malicious, **flags})
    width = max(len(r["payload"]) for r in rows)
    print(f"{'payload':<{width}}  {'':9}  " + "  ".join(f"{s:>10}" for s in scanners))
    for r in rows:
        kind = "malicious" if r["malicious"] else "benign"
        print(f"{r['payload']:<{width}}  {kind:9}  " + "  ".join(f"{('flag' if r[s] else 'pass'):>10}"
                                                          for s in scanners))
    summary = {s: {"missed": [r["payload"] for r in rows if r["malicious"] and not r[s]],
                   "false_alarms": [r["payload"] for r in rows if not r["malicious"] and r[s]]} for s in scanners}
    for s, v in summary.items():
        print(f"{s}: missed {len(v['missed'])}, false alarms {len(v['false_alarms'])}")
    if args.json:
        import importlib.metadata as md

        versions = {p: md.version(p) for p in ("picklescan", "fickling")}
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "summary": summary, "versions": versions}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
