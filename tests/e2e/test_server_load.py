"""The policy server under load, the short version of ``bench/server_load.py`` (issue 40 item 4, issue 51 item 4):
64 concurrent 3-turn sessions through the official ``AsyncOpenAI`` client on loopback for 3,000 requests, the
server's RSS noted every 1,000; every request must succeed and every session's record must be taken back out of
the server. The figures (requests/s, p50/p99, RSS growth) are the benchmark's to report, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _fit_env import fit_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_64_sessions_for_3000_requests_get_every_reply(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "server_load.py"), "--sessions", "64", "--requests", "3000",
         "--mark", "1000", "--out-dir", str(tmp_path), "--out-name", "quick"],
        capture_output=True, text=True, timeout=300, env=fit_env(), cwd=ROOT)
    out = proc.stdout + proc.stderr
    print(proc.stdout[-2000:])
    assert (tmp_path / "quick.json").exists(), out[-3000:]
    result = json.loads((tmp_path / "quick.json").read_text())
    assert result["errors"] == 0, result["error_samples"]
    assert proc.returncode == 0, out[-3000:]
    assert result["requests"] == 3000 and result["sessions_completed"] >= 64, result
    assert result["server_sessions_left"] == 0, result  # nothing kept per session once it was taken
    assert sorted(map(int, result["rss_mb_at_requests"])) == [1000, 2000, 3000], result
