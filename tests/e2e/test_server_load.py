"""The policy server under load, the short version of ``bench/server_load.py`` (issue 40 item 4): 64 concurrent
3-turn sessions through the official ``AsyncOpenAI`` client for 30 s on loopback; every request must succeed and
every session's record must be taken back out of the server. The figures (requests/s, p50/p99, RSS) are the
benchmark's to report, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _fit_env import fit_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_64_sessions_for_30_s_get_every_reply(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "server_load.py"), "--sessions", "64", "--duration-s", "30",
         "--out-dir", str(tmp_path), "--out-name", "quick"],
        capture_output=True, text=True, timeout=300, env=fit_env(), cwd=ROOT)
    out = proc.stdout + proc.stderr
    print(proc.stdout[-2000:])
    assert (tmp_path / "quick.json").exists(), out[-3000:]
    result = json.loads((tmp_path / "quick.json").read_text())
    [level] = result["levels"]
    assert level["errors"] == 0, level["error_samples"]
    assert proc.returncode == 0, out[-3000:]
    assert level["requests"] >= 64 * 3, level  # every session got through its 3 turns at least once
    assert level["server_sessions_left"] == 0, level  # nothing kept per session once it was taken
