"""``examples/gpu/acceptance.py --cpu`` runs in CI so the GPU acceptance command cannot rot between GPU runs: every
CPU part passes with plausible figures, every GPU-only part is skipped with its reason (never passed).

The ``colocated`` and ``megatron_generation`` parts are left out here: on a CPU they are ``screl fit`` of
``configs/grpo_colocated_tiny.yaml`` through the same ``_fit_and_read`` as ``grpo``, which
``tests/e2e/test_colocated.py`` and ``tests/e2e/test_megatron_generation.py`` already run (~75 s saved); the GPU run
of 2026-12-04 (``bench/results/gpu_acceptance.json``) ran both."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "gpu" / "acceptance.py"


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "acceptance.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out), *extra], capture_output=True,
                          text=True, cwd=REPO, check=False, timeout=1800)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result  # the same object on stdout and in --out
    return proc, result


@pytest.mark.slow
def test_acceptance_cpu_mode_passes_every_cpu_part_and_skips_gpu_parts(tmp_path: Path) -> None:
    proc, result = _run(tmp_path, "--parts", "grpo,vllm_standalone,nccl_refit,pipeline;megatron,ppo_offload,memory,engine_bench")
    parts = result["parts"]
    assert proc.returncode == 0, json.dumps(parts, indent=1)[-4000:]
    assert result["ok"] is True and result["mode"] == "cpu"
    assert result["lanes"] == [["grpo", "vllm_standalone", "nccl_refit", "pipeline"],
                               ["megatron", "ppo_offload", "memory", "engine_bench"]]
    assert list(parts) == ["grpo", "vllm_standalone", "nccl_refit", "megatron", "pipeline", "ppo_offload", "memory",
                           "engine_bench"]
    for name in ("grpo", "megatron", "ppo_offload", "memory", "engine_bench"):
        assert parts[name]["status"] == "passed", (name, parts[name])
    for name in ("nccl_refit", "pipeline"):
        assert parts[name]["status"] == "skipped" and "GPU" in parts[name]["reason"], parts[name]
    if importlib.util.find_spec("vllm") is None:
        assert parts["vllm_standalone"]["status"] == "skipped"
        assert "vllm" in parts["vllm_standalone"]["reason"]

    grpo = parts["grpo"]
    assert grpo["steps"] == 3 and len(grpo["reward_per_step"]) == 3
    assert all(0.0 <= r <= 1.0 for r in grpo["reward_per_step"])
    assert grpo["completion_tokens"] > 0 and grpo["generation_tokens_per_s"] > 0
    assert grpo["refits"] >= 2 and grpo["refit_s_median"] > 0
    assert 0.0 <= grpo["logprob_mismatch_max"] < 1e-3  # fp32 on CPU: the same numerics on both sides

    meg = parts["megatron"]
    # export_max_abs_diff: exact, the model is loaded from the HF tensors and exported with no step between (copies)
    assert meg["logits_max_abs_diff"] < 1e-3 and meg["export_max_abs_diff"] == 0.0
    assert meg["torch_optimizer_losses"][-1] < meg["torch_optimizer_losses"][0]
    assert meg["checkpoint_loss_before"] == pytest.approx(meg["checkpoint_loss_after"], abs=1e-6)
    assert "CUDA" in meg["optimizer_comparison"]

    ppo = parts["ppo_offload"]
    assert ppo["optimizer_state_mib"] > 0 and "nothing to move" in ppo["note"]
    assert ppo["offload"]["state_on_device_after"] is True

    mem = parts["memory"]
    assert mem["vocab"] == 151_936
    assert 0 < mem["after"]["peak_above_idle_mb"] < mem["before"]["peak_above_idle_mb"]
    assert 0 < mem["after_over_before"] < 1 and math.isfinite(mem["after_over_before"])

    bench = parts["engine_bench"]  # bench/engine_gpu.py --cpu: every system ran, its ratios measured
    assert bench["model"] == "tiny" and all(v > 0 for v in bench["tokens_per_s"].values())
    assert 0 < bench["engine_over_roofline"] < 1 and bench["engine_over_hf_generate"] > 0

    # every figure with its threshold: the CPU ones held, the GPU-only ones (no CPU threshold) are null
    checks = result["thresholds"]
    assert checks["grpo.logprob_mismatch_max"]["met"] is True and checks["memory.after_over_before"]["met"] is True
    assert checks["engine_bench.engine_over_hf_generate"] == {
        "value": bench["engine_over_hf_generate"], "op": ">=", "threshold": None, "met": None}
    assert checks["memory.flat_256_over_64"]["met"] is None and checks["wall_s"]["met"] is None
    assert result["sequential"] is False


def test_acceptance_unknown_part_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--parts", "grpo,nope"], capture_output=True,
                          text=True, cwd=REPO, check=False, timeout=120)
    assert proc.returncode == 2 and "unknown parts ['nope']" in proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--parts", "memory;grpo,memory"], capture_output=True,
                          text=True, cwd=REPO, check=False, timeout=120)
    assert proc.returncode == 2 and "a part is named twice" in proc.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_acceptance_cpu_mode_on_vllm_compares_with_a_standalone_engine(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    proc, result = _run(tmp_path, "--parts", "grpo,vllm_standalone")
    parts = result["parts"]
    assert proc.returncode == 0 and result["ok"] is True, json.dumps(parts, indent=1)[-4000:]
    assert parts["grpo"]["status"] == "passed" and parts["grpo"]["backend"] == "vllm"
    alone = parts["vllm_standalone"]
    assert alone["status"] == "passed", alone
    assert alone["prompts"] >= parts["grpo"]["steps"] * 4 and alone["requests"] == alone["prompts"] * 4
    assert alone["completion_tokens"] > 0 and alone["grpo_over_standalone_tokens_per_s"] > 0


@pytest.mark.parametrize("part", ["grpo", "colocated", "megatron_generation"])
def test_the_gpu_runs_configs_pass_screl_check_at_qwen2_5_shapes(part: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """What the GPU parts run (no GPU needed to check it): Qwen2.5-0.5B's shapes at full size on the torch engine's
    continuous path (grpo, colocated) or Megatron's, and ``screl check`` passes each config."""
    from tests._check_helpers import run_check

    sys.path.insert(0, str(REPO / "examples" / "gpu"))
    import acceptance_configs as ac

    if part == "grpo" and ac.vllm_importable():
        pytest.skip("vLLM installed: the grpo part runs SmolLM2 on vLLM")
    cfg = {"grpo": ac.grpo_config, "colocated": ac.colocated_config,
           "megatron_generation": ac.megatron_generation_config}[part](False, tmp_path / "run", 12)
    assert cfg["model"]["init_args"]["policy"] == ac.GPU_POLICY and "callbacks" not in cfg["trainer"]
    gen = cfg["data"]["init_args"]["generation"]
    assert gen["device"] == "cuda" and cfg["trainer"]["precision"] == "bf16-mixed"
    assert gen["backend"] == ("megatron" if part == "megatron_generation" else "torch")
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert "trainer memory       ~" in out and "8.3 GiB weights, gradients and optimizer" in out  # 0.5B at fp32
