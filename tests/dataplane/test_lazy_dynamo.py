"""The processes that hold a TransferQueue client import tensordict without ``torch._dynamo``
(:mod:`screl.dataplane.lazy_dynamo`), and Dynamo, once something imports it, marks tensordict's functions as
tensordict asked."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
import screl.controller.controller, screl.dataplane.tq_host  # the controller's and the TQ host's imports
from screl.dataplane import lazy_dynamo
out = {"dynamo_before": "torch._dynamo" in sys.modules, "pending_before": len(lazy_dynamo.pending())}
import tensordict.base as base, tensordict.utils as utils
import torch._dynamo
from torch._dynamo import trace_rules
out["pending_after"] = len(lazy_dynamo.pending())
out["allowed"] = [id(f) in trace_rules._allowed_callable_ids for f in (utils._add_batch_dim_c, base._foreach_copy_compiled)]
out["constant"] = bool(getattr(utils._lock_warn, "_dynamo_marked_constant", False))
out["compiler_restored"] = __import__("torch").compiler.allow_in_graph.__module__
print(json.dumps(out))
"""


def test_tensordict_imports_without_dynamo_and_dynamo_marks_its_functions_later() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dynamo_before"] is False
    assert out["pending_before"] >= 3  # allow_in_graph and assume_constant_result calls at tensordict's import
    assert out == {**out, "pending_after": 0, "allowed": [True, True], "constant": True,
                   "compiler_restored": "torch.compiler"}


def test_where_dynamo_is_already_imported_nothing_is_deferred() -> None:
    script = ("import torch._dynamo, json; import screl.dataplane.tq_host; from screl.dataplane import lazy_dynamo; "
              "import tensordict.utils as u; from torch._dynamo import trace_rules; "
              "print(json.dumps([len(lazy_dynamo.pending()), id(u._add_batch_dim_c) in trace_rules._allowed_callable_ids]))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0, True]
