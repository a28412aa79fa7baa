"""``screl check`` from a test: write a config mapping to a file, run the command, return its exit code and output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from screl.cli import check

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load_config(name: str) -> dict[str, Any]:
    """A shipped config (``configs/<name>``) as a mapping."""
    return yaml.safe_load((CONFIGS / name).read_text())  # type: ignore[no-any-return]


def run_check(cfg: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``screl check --config`` on ``cfg``: its exit code and everything it printed."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc = check(["--config", str(path)])
    out = capsys.readouterr()
    return rc, out.out + out.err
