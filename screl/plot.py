"""``screl plot RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG charts of runs, from their ``metrics.csv`` and
``events.jsonl``, several runs on one chart (sync against async, say).

Charts: ``reward.png`` (reward and raw reward against step and against wall time), ``staleness.png`` (the
histogram of trained groups' staleness, from the events), ``is_weights.png`` (IS-weight quantiles per step),
``buffer.png`` (buffer fill and in-flight groups per step), ``timeline.png`` (per step: waiting for data,
training, and the generation time of the groups it trained). Every series drawn is also written to
``plots.json`` next to the PNGs. Needs matplotlib (``pip install -e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from screl.data.events import EVENTS_FILENAME, ReserveEvent, TrainStepEvent, parse_event, read_events

Series = dict[str, list[float]]


def resolve_run_dir(path: str | Path) -> Path:
    """A run directory (``metrics.csv`` and/or ``events.jsonl`` in it), or the newest one below ``path`` (a
    ``default_root_dir`` with ``lightning_logs/version_*``)."""
    root = Path(path)
    if (root / "metrics.csv").is_file() or (root / EVENTS_FILENAME).is_file():
        return root
    found = sorted((p.parent for p in root.rglob("metrics.csv")), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"{root} holds no metrics.csv or {EVENTS_FILENAME}: not a screl run directory")
    return found[-1]


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with path.open() as fh:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(fh)]


def _column(rows: list[dict[str, float]], key: str) -> Series:
    picked = [r for r in rows if key in r and "step" in r]
    return {"step": [r["step"] for r in picked], key: [r[key] for r in picked]}


def collect(run_dir: Path) -> dict[str, Any]:
    """Every series the charts draw for one run."""
    rows = read_metrics(run_dir)
    events = [parse_event(line) for _, line in read_events(run_dir)] if (run_dir / EVENTS_FILENAME).is_file() else []
    steps = [e for e in events if isinstance(e, TrainStepEvent)]
    start = events[0].time if events and events[0].time is not None else None
    out: dict[str, Any] = {
        "reward": _column(rows, "reward"), "raw_reward": _column(rows, "train/raw_reward"),
        "buffer_fill": _column(rows, "rollout/buffer_fill"), "inflight": _column(rows, "rollout/inflight"),
        "is_weights": {q: _column(rows, f"train/is_weight_{q}")[f"train/is_weight_{q}"]
                       for q in ("p10", "p50", "p90", "max")},
        "is_step": _column(rows, "train/is_weight_p50")["step"],
        "wait_s": _column(rows, "rollout/wait_s"), "train_s": _column(rows, "time/train_step_s"),
        "generation_s": _column(rows, "rollout/generation_s"),
    }
    # reward against wall time: each step's reward at its train_step event's time
    times = [e.time - start for e in steps if e.time is not None and start is not None]
    out["reward_time"] = {"time_s": times[: len(out["reward"]["reward"])],
                          "reward": out["reward"]["reward"][: len(times)]}
    start_weight = {e.group_id: e.start_weight for e in events if isinstance(e, ReserveEvent)}
    out["staleness"] = [float(e.step - start_weight[g]) for e in steps for g in e.group_ids if g in start_weight]
    return out


def _figure(charts: list[tuple[str, str]]) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(charts), figsize=(6 * len(charts), 4), squeeze=False)
    for ax, (x, y) in zip(axes[0], charts, strict=True):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    return fig, list(axes[0])


def _save(fig: Any, axes: list[Any], path: Path) -> None:
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def draw(runs: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """The PNGs of ``runs`` (label -> :func:`collect`) in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, (by_step, by_time) = _figure([("step", "reward"), ("wall time (s)", "reward")])
    for label, d in runs.items():
        by_step.plot(d["reward"]["step"], d["reward"]["reward"], label=f"{label} reward")
        if d["raw_reward"]["step"]:
            by_step.plot(d["raw_reward"]["step"], d["raw_reward"]["train/raw_reward"], "--", label=f"{label} raw")
        by_time.plot(d["reward_time"]["time_s"], d["reward_time"]["reward"], label=label)
    _save(fig, [by_step, by_time], out / "reward.png")
    fig, (ax,) = _figure([("staleness (versions)", "trained groups")])
    for label, d in runs.items():
        top = int(max(d["staleness"], default=0))
        ax.hist(d["staleness"], bins=[b - 0.5 for b in range(top + 2)], alpha=0.5, label=label)
    _save(fig, [ax], out / "staleness.png")
    fig, (ax,) = _figure([("step", "IS weight")])
    for label, d in runs.items():
        for q, values in d["is_weights"].items():
            ax.plot(d["is_step"][: len(values)], values, label=f"{label} {q}")
    _save(fig, [ax], out / "is_weights.png")
    fig, (ax,) = _figure([("step", "groups")])
    for label, d in runs.items():
        ax.plot(d["buffer_fill"]["step"], d["buffer_fill"]["rollout/buffer_fill"], label=f"{label} buffer fill")
        ax.plot(d["inflight"]["step"], d["inflight"]["rollout/inflight"], ":", label=f"{label} in flight")
    _save(fig, [ax], out / "buffer.png")
    fig, axes = _figure([("step", f"seconds ({label})") for label in runs])
    for ax, d in zip(axes, runs.values(), strict=True):
        wait, train = d["wait_s"]["rollout/wait_s"], d["train_s"]["time/train_step_s"]
        n = min(len(wait), len(train))
        ax.bar(d["wait_s"]["step"][:n], wait[:n], label="waiting for data")
        ax.bar(d["wait_s"]["step"][:n], train[:n], bottom=wait[:n], label="training")
        ax.plot(d["generation_s"]["step"], d["generation_s"]["rollout/generation_s"], "k.-", label="generation")
    _save(fig, axes, out / "timeline.png")
    for name in ("reward", "staleness", "is_weights", "buffer", "timeline"):
        written.append(out / f"{name}.png")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="screl plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (or roots holding lightning_logs/version_*)")
    parser.add_argument("--out", default=None, help="where the PNGs go (default: next to the first run)")
    parser.add_argument("--labels", nargs="*", default=None, help="one label per run (default: directory names)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("screl plot needs matplotlib: pip install -e '.[plot]'")
        return 2
    dirs = [resolve_run_dir(p) for p in args.runs]
    labels = args.labels or [d.name if len(dirs) == 1 else f"{d.parent.parent.name}/{d.name}" for d in dirs]
    if len(labels) != len(dirs):
        parser.error(f"--labels gives {len(labels)} labels for {len(dirs)} runs")
    runs = {label: collect(d) for label, d in zip(labels, dirs, strict=True)}
    out = Path(args.out) if args.out else dirs[0] / "plots"
    written = draw(runs, out)
    (out / "plots.json").write_text(json.dumps(runs, indent=1))
    print(f"screl plot: wrote {', '.join(p.name for p in written)} and plots.json to {out}")
    return 0
