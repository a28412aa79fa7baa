"""Statistics and output of the screl benchmarks: medians and spreads, the machine record, result files,
tables and figures, and :func:`finish`, the common end of a benchmark's ``main``. ``bench/_common.py``
re-exports every name, so scripts call them as ``c.median`` and so on.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def median(xs: Iterable[float]) -> float:
    vals = [float(x) for x in xs if x is not None and not math.isnan(float(x))]
    return statistics.median(vals) if vals else float("nan")


def skip_first(xs: Sequence[float], n: int = 1) -> list[float]:
    """Drop the first ``n`` values (start-up/first-generation effects) when enough remain."""
    return list(xs[n:]) if len(xs) > n + 1 else list(xs)


def summary(xs: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the relative spread ``(max - min) / median`` of repetitions."""
    vals = [float(x) for x in xs if not math.isnan(float(x))]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "spread": float("nan"), "n": 0}
    med = statistics.median(vals)
    return {"median": med, "min": min(vals), "max": max(vals),
            "spread": (max(vals) - min(vals)) / med if med else float("nan"), "n": len(vals)}


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "torch": torch.__version__,
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for mod in ("lightning", "ray", "transformers", "trl"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages
            pass
    return info


def _plain(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def write_result(script: str, data: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``bench/results/<script>.json`` (NaN/inf become null)."""
    out = (out_dir or RESULTS) / f"{script}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_plain(data), indent=1) + "\n")
    return out


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay ``fig`` out, write it to ``path`` (its directory made) and close it."""
    plt = pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def staleness_bars(ax: Any, fractions: dict[str, dict[str, float]], ylabel: str = "fraction of groups") -> None:
    """Grouped bars of each mode's staleness distribution (``{mode: {staleness: fraction}}``) on ``ax``."""
    modes = list(fractions)
    keys = sorted({int(k) for fr in fractions.values() for k in fr})
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        ax.bar([k + i * width for k in keys], [fractions[mode].get(str(k), 0.0) for k in keys], width=width,
               label=mode)
    ax.set_xticks([k + 0.4 - width / 2 for k in keys], [str(k) for k in keys])
    ax.set_xlabel("staleness (trainer version - start weight)")
    ax.set_ylabel(ylabel)
    ax.set_title("staleness distribution")
    ax.legend(fontsize=8)


def parse_modes(parser: Any, text: str, allowed: Sequence[str]) -> list[str]:
    """The comma-separated ``--modes``, each one of ``allowed`` and ``sync`` among them (else a parser error)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if [m for m in modes if m not in allowed] or "sync" not in modes:
        parser.error(f"--modes must include sync and be drawn from {list(allowed)} (got {modes})")
    return modes



def finish(
    script: str,
    result: dict[str, Any],
    out_dir: Path,
    started: float,
    load_before: list[float],
    report: Callable[[dict[str, Any]], None],
    plot: Callable[[dict[str, Any], Path], None] | None = None,
) -> Path:
    """Stamp ``result`` with the machine and the bench's wall time, print its tables, write its JSON (and PNG)."""
    result["machine"] = machine_info() | {"loadavg_before": load_before}
    result["bench_wall_s"] = time.time() - started
    report(result)
    out = write_result(script, result, out_dir)
    figure = ""
    if plot is not None:
        plot(result, out_dir / f"{script}.png")
        figure = f" and {out_dir / f'{script}.png'}"
    print(f"\nwrote {out}{figure} ({result['bench_wall_s']:.0f}s)")
    return out
