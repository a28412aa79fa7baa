"""``bench/engine_gpu.py --cpu`` runs in CI so the GPU engine benchmark cannot rot between GPU runs: every system
(screl's engine, HF ``generate``, transformers' continuous batching, the roofline) has its figures, and each
generated exactly the workload's requested output tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "engine_gpu.py"
SYSTEMS = ("engine", "hf_generate", "hf_continuous", "roofline")


def test_engine_gpu_bench_cpu_mode_measures_every_system(tmp_path: Path) -> None:
    out = tmp_path / "engine_gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    assert result["mode"] == "cpu" and result["device"] == "cpu" and result["copy_bandwidth_gb_s"] > 0
    [model] = result["models"]
    assert model["sequences"] == 8 and 8 * 8 <= model["requested_output_tokens"] <= 8 * 16
    for name in SYSTEMS:
        got = model["systems"][name]
        assert "error" not in got, (name, got)
        assert got["tokens_per_s"] > 0 and got["seconds"] > 0, (name, got)
        # each sequence got exactly its requested length (no early EOS, no overrun counted)
        assert got["tokens_ok"] is True and got["output_tokens"] == model["requested_output_tokens"], (name, got)
    assert model["systems"]["engine"]["decode"] == "auto" and model["systems"]["engine"]["attention"]
    continuous = model["systems"]["engine_continuous"]  # one slot per sequence, of the longest sequence's length
    assert continuous["decode_path"] == "continuous" and "is_causal" in continuous["attention"]
    assert "(8 slots x " in continuous["kv_cache"], continuous["kv_cache"]
    assert "eager" in model["systems"]["hf_generate"]["hf_generate_path"]
    assert model["systems"]["roofline"]["weights_bytes_per_step"] > 0
    assert all(v is not None and v > 0 for v in model["ratios"].values()), model["ratios"]
    # the roofline bounds every real system: a decode step cannot read its bytes faster than a plain copy
    assert model["ratios"]["engine_over_roofline"] < 1
    targets = result["targets"]
    assert targets["engine_over_hf_generate"] == 3.0 and targets["engine_over_roofline"] == 0.4
    assert targets["met"] is None  # CPU: not the targets' shapes
