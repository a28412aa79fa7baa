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


def test_screl_check_resolves_the_specs_without_their_modeling_code() -> None:
    """``screl check`` reads a spec's signature and config (jsonargparse also runs a module's TYPE_CHECKING imports
    to resolve annotations): neither transformers' modeling code (``PreTrainedModel``, Qwen2's, Llama's) nor Ray nor
    TransferQueue is imported, for the in-memory tiny model and for SmolLM2 (``HFCausalLM``'s subclass); nor, as
    ``screl check``'s own process imports Lightning (``screl.lightning_import``), ``torch._dynamo``, sympy or
    matplotlib."""
    heavy = ("transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2",
             "transformers.models.llama.modeling_llama", "ray", "transfer_queue", "torch._dynamo", "sympy",
             "matplotlib")
    configs = [str(ROOT / "configs" / name) for name in ("grpo_tiny.yaml", "grpo_smollm2.yaml")]
    code = ("import sys\nsys.argv = ['screl', 'check']\nfrom screl.cli import main\n"
            f"for config in {configs!r}:\n"
            "    sys.argv = ['screl', 'check', '--config', config]\n"
            "    try:\n        main()\n    except SystemExit as err:\n        assert not err.code, (config, err.code)\n"
            f"print('loaded:', sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("screl check: the config is valid") == 2, out.stdout[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "loaded: []", out.stdout[-2000:]
