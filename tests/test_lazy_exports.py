"""``screl.models`` and ``screl.strategies`` load their names on first use (``screl._lazy``): each exported name
resolves to its module's object, and a process that needs one part does not import the heavy rest."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import screl.strategies

import screl.models

PACKAGES = [screl.models, screl.strategies]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_every_exported_name_is_its_modules_object(package: ModuleType) -> None:
    assert sorted(package.__all__) == sorted(package._WHERE) == dir(package)
    for name in package.__all__:
        module = importlib.import_module(f"{package.__name__}.{package._WHERE[name]}")
        assert getattr(package, name) is getattr(module, name)
    with pytest.raises(AttributeError, match=f"module '{package.__name__}' has no attribute 'Nope'"):
        package.Nope  # noqa: B018


@pytest.mark.parametrize(("stmt", "heavy"), [
    ("from screl.strategies import DDPStrategy", "megatron"),
    ("from screl.models import PolicySpec", "transformers"),
])
def test_one_name_does_not_import_the_rest(stmt: str, heavy: str) -> None:
    code = f"import sys; {stmt}; print(sorted(m for m in sys.modules if m.split('.')[0] == {heavy!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_screl_check_resolves_the_tiny_spec_without_building_anything() -> None:
    """``screl check`` reads the spec's signature and config (jsonargparse also runs a module's TYPE_CHECKING
    imports to resolve annotations): neither Qwen2's modeling code nor Ray nor TransferQueue is imported."""
    heavy = ("transformers.models.qwen2.modeling_qwen2", "ray", "transfer_queue")
    code = ("import sys\nfrom screl.cli import main\n"
            f"sys.argv = ['screl', 'check', '--config', {str(ROOT / 'configs' / 'grpo_tiny.yaml')!r}]\n"
            "try:\n    main()\nexcept SystemExit as err:\n    assert not err.code, err.code\n"
            f"print('loaded:', sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "screl check: the config is valid" in out.stdout, out.stdout[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "loaded: []", out.stdout[-2000:]
