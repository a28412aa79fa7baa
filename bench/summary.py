#!/usr/bin/env python
"""The performance targets against the last written results: one Markdown table from ``bench/results/*.json``.

    python bench/summary.py                  # reads bench/results/
    python bench/summary.py --results-dir /tmp/my-run

Each row names the JSON file and key it read; a key that is missing (its script not run yet) shows as ``-``.
"""

from __future__ import annotations

import argparse
import json
import operator
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

# (label, file, key, comparison, target)
TARGETS: tuple[tuple[str, str, str, str, float], ...] = (
    ("small: sync / TRL samples/s", "vs_trl", "sync_over_trl_samples", ">=", 1.0),
    ("small: async / TRL samples/s", "vs_trl", "async_over_trl_samples", ">=", 1.5),
    ("tiny: sync / TRL samples/s", "vs_trl", "tiny_sync_over_trl_samples", ">=", 0.8),
    ("tiny: async / TRL samples/s", "vs_trl", "tiny_async_over_trl_samples", ">=", 1.2),
    ("time to first step / TRL's", "startup", "first_step_over_trl", "<=", 1.0),
    ("data-plane share of the tiny step", "dataplane", "dataplane_overhead_fraction_tiny", "<", 0.05),
    ("data-plane share of the small step", "dataplane", "dataplane_overhead_fraction_small", "<", 0.02),
    ("async / sync wall (small, P=4 G=4 L=64)", "async_vs_sync", "async_over_sync_wall", "<=", 0.6),
)
OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


def rows(results: Path) -> list[list[str]]:
    loaded: dict[str, dict[str, Any]] = {}
    written: dict[str, str] = {}
    out = []
    for label, file, key, op, target in TARGETS:
        if file not in loaded:
            path = results / f"{file}.json"
            loaded[file] = json.loads(path.read_text()) if path.is_file() else {}
            stamp = loaded[file].get("machine", {}).get("timestamp_utc")
            if stamp is None and path.is_file():  # a script that records no machine block: the file's time
                stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(path.stat().st_mtime))
            written[file] = stamp or "-"
        value = loaded[file].get(key)
        when = written[file]
        if isinstance(value, (int, float)):
            shown, met = f"{value:.3f}", "met" if OPS[op](value, target) else "missed"
        else:
            shown, met = "-", "-"
        out.append([label, f"`{file}.json` `{key}`", shown, f"{op} {target}", met, when])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    header = ["figure", "read from", "measured", "target", "", "written (UTC)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows(args.results_dir):
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
