"""``bench/startup.py`` splits the launch -> first step at the run's own start-up lines: the lines it waits for are
the ones the rollout side prints, and each phase is the time between their arrivals. ``bench/startup_ab.py`` reads
its sides as ``LABEL:NAME=VALUE,...``."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from screl.controller import runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench scripts import each other as bench.*

from bench import startup  # noqa: E402
from bench.startup_ab import side  # noqa: E402


def test_the_phase_lines_are_the_ones_the_rollout_side_prints() -> None:
    source = inspect.getsource(runtime)
    for _, text in startup.PHASE_LINES:
        assert text.strip() in source, text


def test_each_phase_is_the_time_between_its_lines() -> None:
    read_fd, write_fd = os.pipe()
    seen: dict[str, float] = {}
    lines: list[str] = []
    t0 = time.time()
    with os.fdopen(read_fd) as stream, os.fdopen(write_fd, "w") as out:
        reader = threading.Thread(target=startup._time_lines, args=(stream, t0, seen, lines))
        reader.start()
        out.write("Seed set to 0\n")
        out.flush()
        time.sleep(0.3)
        out.write("screl: Ray started at launch, beside the driver's start-up (up 1.0 s before it was needed)\n")
        out.flush()
        time.sleep(0.4)
        out.write("screl: 1 generation worker(s) and the controller ready in 0.4 s (torch backend, weights loaded)\n")
        out.write("screl: Ray started in 9.0 s\n")  # a phase's line counts once, when it first comes
        out.close()
        reader.join(10)
    assert len(lines) == 4
    phases = startup._phases(seen, first_s=seen["fleet"] + 0.5)
    assert 0.3 <= phases["driver"] < 0.3 + 0.2
    assert 0.4 <= phases["fleet"] < 0.4 + 0.2
    assert phases["first_rollout_and_step"] == pytest.approx(0.5, abs=0.01)
    with pytest.raises(RuntimeError, match="did not print its start-up lines containing"):
        startup._phases({"driver": 1.0}, first_s=3.0)


def test_an_ab_side_is_a_label_and_its_settings() -> None:
    assert side("base:") == ("base", {})
    assert side("change:PYTHONPATH=/tmp/wt,SCREL_RAY_PRESTART=0") == (
        "change", {"PYTHONPATH": "/tmp/wt", "SCREL_RAY_PRESTART": "0"})
    assert side("eq:X=a=b") == ("eq", {"X": "a=b"})  # the first '=' splits
    with pytest.raises(argparse.ArgumentTypeError, match="a side is LABEL: or LABEL:NAME=VALUE"):
        side("base")
    with pytest.raises(argparse.ArgumentTypeError, match="'FLAG' in 'x:FLAG' is not NAME=VALUE"):
        side("x:FLAG")
