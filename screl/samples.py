"""``screl samples RUN_DIR``: the newest completions a run logged (``completions.jsonl``, written by
``screl.callbacks.Completions``)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

COMPLETIONS_FILE = "completions.jsonl"


def read_samples(run_dir: str, last: int = 8) -> list[dict[str, Any]]:
    """The newest ``last`` rows of a run's ``completions.jsonl`` (``run_dir``: the run folder, or a folder above it
    holding one run)."""
    path = os.path.join(run_dir, COMPLETIONS_FILE)
    if not os.path.isfile(path):
        found = sorted((os.path.join(d, COMPLETIONS_FILE) for d, _, files in os.walk(run_dir)
                        if COMPLETIONS_FILE in files), key=os.path.getmtime)
        if not found:
            raise FileNotFoundError(f"no {COMPLETIONS_FILE} in {run_dir}: the run logged no completions (the "
                                    "screl.callbacks.Completions callback, every_n_steps > 0, writes it)")
        path = found[-1]
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    return [json.loads(line) for line in lines[-last:] if line.strip()]


def format_sample(row: dict[str, Any]) -> str:
    extra = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
    figures = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
    return f"── {figures}\n[prompt]\n{row.get('prompt', '')}\n[completion]\n{row.get('completion', '')}\n"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="screl samples", description="print the newest completions a run logged")
    parser.add_argument("run_dir")
    parser.add_argument("--last", type=int, default=8, help="how many rows (default 8)")
    args = parser.parse_args(list(argv))
    try:
        rows = read_samples(args.run_dir, args.last)
    except FileNotFoundError as err:
        print(f"screl samples: {err}")
        return 1
    for row in rows:
        print(format_sample(row))
    return 0
