"""The SmolLM2 demo's verdict: held-out accuracy, its binomial standard error and the 2-SE bar, from a metrics log."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "smollm2_demo.py"
_spec = importlib.util.spec_from_file_location("smollm2_demo", SCRIPT)
assert _spec is not None and _spec.loader is not None
demo: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)


def _rows(val: dict[int, float], rewards: list[float]) -> list[dict[str, float]]:
    rows = [{"step": float(v), "val/version": float(v), "val/pass@1": p} for v, p in val.items()]
    return rows + [{"step": float(s), "reward": r} for s, r in enumerate(rewards)]


def test_the_rise_is_measured_in_standard_errors_of_the_difference() -> None:
    c = demo.curve(_rows({0: 0.25, 20: 0.5, 40: 0.75}, [0.1 * (s % 10) for s in range(40)]), 128)
    se0, se1 = math.sqrt(0.25 * 0.75 / 128), math.sqrt(0.75 * 0.25 / 128)
    assert c["validation"][0] == (0, 0.25, se0)
    assert c["initial"] == 0.25 and c["final"] == 0.75 and c["rise"] == 0.5
    assert c["se_diff"] == math.sqrt(se0**2 + se1**2)
    assert c["rise_over_se"] == 0.5 / c["se_diff"]
    text = demo.table(c)
    assert "clears the 2-SE bar" in text and "0.250 -> 0.750" in text
    # the train reward column is the mean of the steps between two validations: steps 0..19 -> 0.45 at step 20
    assert [line.split()[:2] for line in text.splitlines()[1:4]] == [["0", "-"], ["20", "0.450"], ["40", "0.450"]]


def test_a_rise_within_noise_does_not_clear_the_bar() -> None:
    c = demo.curve(_rows({0: 0.30, 40: 0.35}, [0.5] * 40), 128)
    assert c["rise_over_se"] < 2
    assert "does NOT clear the 2-SE bar" in demo.table(c)
