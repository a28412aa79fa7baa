"""A Hugging Face cache laid out on disk as the hub lays it out: ``models--org--name/refs/main`` naming a snapshot
folder, the files in ``snapshots/<commit>/``. The suite runs offline (``HF_HUB_OFFLINE=1``) against one such cache
holding the shipped configs' models as ``config.json`` alone (``configs/recipes/shapes/hub.json``): what ``screl
check`` reads for the memory estimate, as it would read a user's cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lay_out(cache: Path, repo_id: str, revision: str, files_from: Path) -> Path:
    """Copy ``files_from``'s files into ``cache`` as ``repo_id`` at ``revision`` (also ``refs/main``)."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files_from.iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return snapshot


def shipped_models_cache(cache: Path) -> Path:
    """The cache of every model the shipped configs name by hub id, config.json only."""
    table = json.loads((ROOT / "configs" / "recipes" / "shapes" / "hub.json").read_text())
    for folder, entry in table.items():
        lay_out(cache, entry["repo_id"], entry["revision"], ROOT / folder)
    return cache
