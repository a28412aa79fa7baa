"""``screl check`` imports Lightning without ``torch._dynamo`` and torchmetrics' extras
(:mod:`screl.lightning_import`), and what Lightning holds of Dynamo behaves as Dynamo's own once it is imported.
Each case runs in a fresh interpreter: the test process has imported Lightning already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LEAN = """
import json, sys, torch
real_disable = torch.compiler.disable
from screl.lightning_import import lean_lightning_import
with lean_lightning_import(True):
    import lightning.pytorch
    from lightning.pytorch.cli import LightningCLI
from lightning.fabric import wrappers
from lightning.pytorch.utilities import compile as pl_compile
from torchmetrics.utilities.imports import _MATPLOTLIB_AVAILABLE, _TRANSFORMERS_GREATER_EQUAL_4_4
import torchmetrics.functional.text as tm_text
out = {"dynamo": "torch._dynamo" in sys.modules, "sympy": "sympy" in sys.modules,
       "matplotlib": "matplotlib" in sys.modules, "bert_score": hasattr(tm_text, "bert_score"),
       "flags": [bool(_MATPLOTLIB_AVAILABLE), bool(_TRANSFORMERS_GREATER_EQUAL_4_4)],
       "disable_restored": torch.compiler.disable is real_disable}
module = torch.nn.Linear(2, 2)
out["plain_is_compiled"] = isinstance(module, wrappers.OptimizedModule)
compiled = torch.compile(module, backend="eager")  # imports Dynamo
out["compiled_is_compiled"] = [isinstance(compiled, wrappers.OptimizedModule),
                               isinstance(compiled, pl_compile.OptimizedModule),
                               issubclass(type(compiled), wrappers.OptimizedModule)]
out["unwrapped"] = wrappers._unwrap_compiled(compiled)[0] is module
print(json.dumps(out))
"""


def _run(script: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_lean_import_leaves_dynamo_out_and_lightning_sees_compiled_modules_once_it_is_in() -> None:
    out = _run(LEAN)
    assert out == {"dynamo": False, "sympy": False, "matplotlib": False, "bert_score": False, "flags": [False, False],
                   "disable_restored": True, "plain_is_compiled": False,
                   "compiled_is_compiled": [True, True, True], "unwrapped": True}


def test_the_stand_in_hands_any_other_name_to_the_real_dynamo() -> None:
    script = """
import json, sys
from screl.lightning_import import lean_lightning_import, OptimizedModule
with lean_lightning_import(True):
    from torch._dynamo import OptimizedModule as stand_in
    before = "sympy" in sys.modules
    from torch._dynamo import disable  # not the stand-in's: the real module is imported for it
    real = sys.modules["torch._dynamo"]
print(json.dumps([stand_in is OptimizedModule, before, disable is real.disable,
                  type(real).__name__, sys.modules["torch._dynamo"] is real]))
"""
    assert _run(script) == [True, False, True, "module", True]


def test_without_check_nothing_changes() -> None:
    script = """
import json, sys
sys.argv = ["screl", "fit"]
import screl.cli
from lightning.fabric import wrappers
import torch._dynamo
from screl.prestart import cli_command
print(json.dumps([wrappers.OptimizedModule is torch._dynamo.OptimizedModule,
                  cli_command(["screl", "check"]), cli_command(["/x/screl/cli.py", "check"]),
                  cli_command(["screl", "fit"]), cli_command(["pytest", "check"]), cli_command(["screl"])]))
"""
    assert _run(script) == [True, "check", "check", "fit", None, None]


def test_a_lean_import_that_meets_a_dynamo_submodule_is_done_again_in_full(tmp_path: Path) -> None:
    """A module imported at Lightning's import that imports a ``torch._dynamo`` submodule (which the stand-in cannot
    serve) fails the lean block naming it; :func:`import_lightning` then imports in full."""
    (tmp_path / "needs_dynamo_submodule.py").write_text("import torch._dynamo.eval_frame\nOK = True\n")
    script = f"""
import json, sys
sys.path.insert(0, {str(tmp_path)!r})
from screl.lightning_import import import_lightning, lean_lightning_import
try:
    with lean_lightning_import(True):
        import needs_dynamo_submodule
    failed = None
except ModuleNotFoundError as err:
    failed = err.name
left = "torch._dynamo" in sys.modules
import_lightning(True, modules=("json", "needs_dynamo_submodule"))
import needs_dynamo_submodule, torch._dynamo
print(json.dumps([failed, left, needs_dynamo_submodule.OK, type(sys.modules["torch._dynamo"]).__name__]))
"""
    assert _run(script) == ["torch._dynamo.eval_frame", False, True, "module"]
