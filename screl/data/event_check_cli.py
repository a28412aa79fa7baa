"""``screl events check``: audit a run directory's ``events.jsonl`` with :func:`check_events`, reading the
sampler block (and the buffer bound) from the run's ``config.yaml`` unless given."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from screl.data.event_check import check_events
from screl.data.events import EVENTS_FILENAME


def _find_async_rl(node: Any) -> Mapping[str, Any] | None:
    if isinstance(node, Mapping):
        block = node.get("async_rl")
        if isinstance(block, Mapping) and "sampler" in block:
            return block
        for value in node.values():
            found = _find_async_rl(value)
            if found is not None:
                return found
    return None


def _run_config(run_dir: Path) -> Mapping[str, Any] | None:
    for name in ("config.yaml", "config.yml"):
        path = run_dir / name
        if path.is_file():
            import yaml

            return _find_async_rl(yaml.safe_load(path.read_text(encoding="utf-8")))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``screl events check`` / ``python -m screl.data.event_check_cli check``: audit a run's event
    log; non-zero on violations."""
    parser = argparse.ArgumentParser(prog="screl events", description="Audit a run's events.jsonl.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check", help="check every sampler rule and that no prompt was lost or trained twice"
    )
    check.add_argument("run_dir", help=f"run directory holding {EVENTS_FILENAME}, or the log file itself")
    check.add_argument(
        "--sampler", help="the async_rl.sampler block as JSON (default: from RUN_DIR/config.yaml)"
    )
    check.add_argument("--max-buffered-rollouts", type=int, default=None)
    check.add_argument(
        "--final", action="store_true", help="the run has ended: nothing may be left in flight"
    )
    args = parser.parse_args(argv)
    path = Path(args.run_dir)
    log = path / EVENTS_FILENAME if path.is_dir() else path
    if not log.is_file():
        print(f"error: no event log at {log}", file=sys.stderr)
        return 2
    run_dir = path if path.is_dir() else path.parent
    async_rl = _run_config(run_dir) or {}
    sampler = json.loads(args.sampler) if args.sampler else async_rl.get("sampler")
    cap = args.max_buffered_rollouts or async_rl.get("max_buffered_rollouts")
    report = check_events(log, sampler, max_buffered_rollouts=cap, final=args.final)
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
