"""``screl.strategies`` loads its names on first use: each exported name resolves to its module's object, and a
DDP run's import of the package does not pull in megatron-core."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import screl.strategies as strategies


@pytest.mark.parametrize("name", strategies.__all__)
def test_every_exported_name_is_its_modules_object(name: str) -> None:
    module = importlib.import_module(f"screl.strategies.{strategies._WHERE[name]}")
    assert getattr(strategies, name) is getattr(module, name)


def test_the_lazy_map_and_all_list_the_same_names() -> None:
    assert sorted(strategies.__all__) == sorted(strategies._WHERE)
    with pytest.raises(AttributeError, match="module 'screl.strategies' has no attribute 'Nope'"):
        strategies.Nope  # noqa: B018


def test_the_ddp_strategy_does_not_import_megatron() -> None:
    code = ("import sys; from screl.strategies import DDPStrategy; "
            "from lightning.pytorch.strategies import DDPStrategy as L; assert issubclass(DDPStrategy, L); "
            "print(sorted(m for m in sys.modules if m.startswith('megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
