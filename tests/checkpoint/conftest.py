"""Checkpoint stores on a local directory and on a real S3 endpoint (``moto_server`` on 127.0.0.1)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from screl.checkpoint import CheckpointStore

BUCKET = "screl-ckpt-tests"


def _moto_server_binary() -> str | None:
    candidate = Path(sys.executable).parent / "moto_server"
    if candidate.exists():
        return str(candidate)
    return shutil.which("moto_server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_options() -> Iterator[dict[str, Any]]:
    """Storage options for a fresh moto S3 server (started once per session, stopped by PID)."""
    binary = _moto_server_binary()
    if binary is None:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {endpoint}") from None
                time.sleep(0.05)
        options: dict[str, Any] = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
        fs = fsspec.filesystem("s3", **options)
        fs.mkdir(BUCKET)
        yield options
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """``(root_url, storage_options)`` of an empty checkpoint directory on each backend."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), {}
    options = request.getfixturevalue("s3_options")
    return f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt", options


@pytest.fixture
def store(backend: tuple[str, dict[str, Any]]) -> CheckpointStore:
    url, options = backend
    return CheckpointStore(url, options)

