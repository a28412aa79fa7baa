"""A real ``moto_server`` on 127.0.0.1 for the storage-fault tests (``test_storage_faults.py`` and
``test_storage_faults_e2e.py``): it records every request, so that a stopped server comes back with what it held.
The ``moto`` fixture (one server per test, with the bucket) is in ``conftest.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import fsspec
import pytest

BUCKET = "screl-storage-faults"


class Moto:
    """A real ``moto_server`` on 127.0.0.1 that records every request, so that a stopped server comes back with
    what it held (a real object store keeps its objects while it is unreachable)."""

    def __init__(self, tmp: Path) -> None:
        self.binary = str(Path(sys.executable).parent / "moto_server")
        if not os.path.exists(self.binary):
            pytest.skip("moto_server is not installed (pip install 'moto[server]')")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.recording = str(tmp / "moto_recording.jsonl")
        self.proc: subprocess.Popen[bytes] | None = None
        self.options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self, replay: bool = False) -> None:
        env = {**os.environ, "MOTO_RECORDER_FILEPATH": self.recording}
        if not replay:
            env["MOTO_ENABLE_RECORDING"] = "1"
        self.proc = subprocess.Popen([self.binary, "-H", "127.0.0.1", "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=0.5).close()
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.05)
        if replay:
            req = urllib.request.Request(f"{self.endpoint}/moto-api/recorder/replay-recording", data=b"",
                                         method="POST")
            urllib.request.urlopen(req, timeout=60).close()
        fsspec.filesystem("s3", **self.options).invalidate_cache()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
