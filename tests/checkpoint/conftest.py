"""Checkpoint stores on a local directory and on a real S3 endpoint (``moto_server`` on 127.0.0.1)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from screl.checkpoint import CheckpointStore

BUCKET = "screl-ckpt-tests"


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
