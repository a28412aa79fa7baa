"""GPU check for pipeline-parallel training under ``MegatronStrategy`` (two CUDA GPUs, about a minute).

On CPU, ``MegatronStrategy.forward_backward`` runs screl's own fill-drain schedule over gloo sends, and CI
checks it (``tests/strategies/test_megatron_strategy.py::test_pp2_matches_pp1_losses_and_reduced_gradients``,
``tests/strategies/test_grpo_megatron.py[pp2]``). On CUDA it runs megatron-core's own 1F1B schedule
(``get_forward_backward_func``) with the activation shape the caller passes, which was written against the
API on a machine without GPUs. This script checks that path the same way the CPU test does:

1. PP=1 on GPU 0 (one process): ``STEPS`` AdamW steps over ``MICROBATCHES`` micro-batches of a tiny
   Qwen2-layout model with tied embeddings, recording each step's loss, gradient norm and reduced gradients.
2. PP=2 over GPUs 0 and 1 (nccl, ``file://`` rendezvous: nothing listens on a port), the same steps through
   Megatron's schedule. Every step's loss, gradient norm and gradients, and the weights exported after
   training, must equal step 1's (float32, TF32 off: ``TOL``).
3. The schedule without an activation shape is refused with an error naming ``seq_length``.

``--cpu`` runs the same comparison on 2 CPU processes (gloo, screl's CPU schedule, which needs no activation
shape, so check 3 is skipped): a dry run of the script itself on a machine without GPUs.

Run from the repository root on a machine with two GPUs::

    python -m pip install --no-deps --no-build-isolation -e .   # screl.strategies (needs megatron-core)
    python examples/gpu/pipeline_check.py          # or --cpu

Exit status 0 when every check passes.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

STEPS = 4
SEQ = 64
GLOBAL_BATCH = 8
MICROBATCHES = 4
VOCAB = 512
LR = 1e-3
TOL = 1e-4
"""float32 with TF32 off: the stages compute the same products as one process, in another order of
reductions at most, so losses and gradients agree to rounding."""


def hf_model() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg).eval()


DEVICE = "cuda"


def batch(step: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    mask = (torch.rand(GLOBAL_BATCH, SEQ - 1, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    return {"ids": ids.to(DEVICE), "mask": mask.to(DEVICE)}


def micro(b: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    size = GLOBAL_BATCH // MICROBATCHES
    return [{k: v[i * size:(i + 1) * size] for k, v in b.items()} for i in range(MICROBATCHES)]


class MeanLoss:
    """Masked token mean of the logprobs of the last stage's logits (earlier stages output hidden states)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def forward(self, b: dict[str, Tensor], logits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        logprobs = self.strategy.token_logprobs(logits[:, :-1], b["ids"][:, 1:])
        loss = -(logprobs * b["mask"]).sum() / b["mask"].sum()
        return loss, {"loss": loss.detach().clone()}

    def reduce(self, values: list[dict[str, Tensor]]) -> Tensor:
        return torch.stack([v["loss"] for v in values]).mean()


def forward_step(model: torch.nn.Module, mb: dict[str, Tensor]) -> Tensor:
    ids = mb["ids"]
    return model(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None)


def make_strategy(world: int, pp: int) -> Any:
    """A ``MegatronStrategy`` on CUDA (or CPU), set up by hand (no Trainer) on the initialized process group."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from screl.strategies import GPTModelProvider, MegatronStrategy, ParallelismConfig, load_hf_weights

    hf = hf_model()
    strategy = MegatronStrategy(
        parallelism=ParallelismConfig(pipeline_model_parallel_size=pp),
        model_provider=GPTModelProvider.from_hf_config(hf.config),
        accelerator=CUDAAccelerator() if DEVICE == "cuda" else CPUAccelerator(),
        parallel_devices=[torch.device("cuda", i) if DEVICE == "cuda" else torch.device("cpu") for i in range(world)],
        cluster_environment=LightningEnvironment(),
    )
    module = LightningModule()
    strategy.connect(module)
    strategy.setup_environment()
    module.model = strategy.build_model()
    load_hf_weights(module.model, hf.state_dict(), strict=pp == 1)  # a stage holds its own layers only
    strategy.wrap_megatron_modules()
    strategy.optimizers = [torch.optim.AdamW(module.parameters(), lr=LR, eps=1e-3)]
    return strategy


def reduced_grads(strategy: Any) -> dict[str, Tensor]:
    """The reduced gradients as full tensors in Hugging Face naming (swaps them into the weights to export)."""
    inner = strategy.lightning_module.model.module
    saved = {}
    with torch.no_grad():
        for name, p in inner.named_parameters():
            saved[name] = p.data.clone()
            p.data.copy_(p.main_grad)
    grads = strategy.export_weights()
    with torch.no_grad():
        for name, p in inner.named_parameters():
            p.data.copy_(saved[name])
    return grads


def train(strategy: Any, pp: int) -> dict[str, Any]:
    record: dict[str, Any] = {"loss": [], "grad_norm": [], "grads": [], "ms": []}
    mbs = GLOBAL_BATCH // MICROBATCHES
    for step in range(STEPS):
        t0 = time.perf_counter()
        loss = strategy.forward_backward(micro(batch(step)), forward_step, MeanLoss(strategy),
                                         seq_length=SEQ if pp > 1 else None, micro_batch_size=mbs if pp > 1 else None)
        norm = strategy.clip_gradients(1.0)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        record["ms"].append(1e3 * (time.perf_counter() - t0))
        record["loss"].append(float(loss))
        record["grad_norm"].append(float(norm))
        record["grads"].append({k: v.cpu() for k, v in reduced_grads(strategy).items()})
        strategy.optimizers[0].step()
        strategy.zero_grad_buffers()
    record["export"] = {k: v.cpu() for k, v in strategy.export_weights().items()}
    return record


def _job(rank: int, world: int, pp: int, init_file: str, out: str, device: str) -> None:
    from screl.strategies.parallel import destroy_model_parallel

    global DEVICE
    DEVICE = device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        strategy = make_strategy(world, pp)
        result = train(strategy, pp)
        if pp > 1 and device == "cuda":
            try:
                strategy.forward_backward(micro(batch(0)), forward_step, MeanLoss(strategy))
                result["no_shape"] = "accepted"
            except ValueError as e:
                result["no_shape"] = str(e)
            strategy.zero_grad_buffers()
        torch.save(result, f"{out}.{rank}")
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def run(world: int, pp: int, workdir: str, device: str) -> list[dict[str, Any]]:
    out = os.path.join(workdir, f"pp{pp}")
    init_file = os.path.join(workdir, f"pg_pp{pp}")
    mp.spawn(_job, args=(world, pp, init_file, out, device), nprocs=world, join=True)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def _worst(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def run_checks(device: str) -> dict[str, Any]:
    """PP=1 then PP=2 on ``device`` and their comparison: the worst differences and the failures (empty: passed)."""
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="pipeline_check_")
    (ref,) = run(1, 1, workdir, device)
    stages = run(2, 2, workdir, device)
    failures = []
    worst = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "export": 0.0}
    for rank, got in enumerate(stages):
        for step in range(STEPS):
            dl = abs(got["loss"][step] - ref["loss"][step])
            dn = abs(got["grad_norm"][step] - ref["grad_norm"][step])
            dg = _worst(got["grads"][step], ref["grads"][step])
            print(f"[stage {rank}] step {step}: loss {got['loss'][step]:.6f} (PP=1 {ref['loss'][step]:.6f}) "
                  f"grad_norm {got['grad_norm'][step]:.5f} (PP=1 {ref['grad_norm'][step]:.5f}) "
                  f"max |grad diff| {dg:.2e}; {got['ms'][step]:.1f} ms (PP=1 {ref['ms'][step]:.1f} ms)", flush=True)
            worst.update(loss=max(worst["loss"], dl), grad_norm=max(worst["grad_norm"], dn),
                         grads=max(worst["grads"], dg))
            if max(dl, dn, dg) > TOL:
                failures.append(f"stage {rank} step {step}: loss {dl:.2e}, grad norm {dn:.2e}, grads {dg:.2e}")
        de = _worst(got["export"], ref["export"])
        worst["export"] = max(worst["export"], de)
        print(f"[stage {rank}] exported weights after {STEPS} steps: max diff {de:.2e}", flush=True)
        if de > TOL:
            failures.append(f"stage {rank}: exported weights differ by {de:.2e}")
        if device == "cuda" and "seq_length" not in got["no_shape"]:
            failures.append(f"stage {rank}: the schedule without an activation shape gave {got['no_shape']!r}")
    return {"device": device, "steps": STEPS, "tolerance": TOL, "max_abs_diff": worst, "failures": failures,
            "wall_s": round(time.perf_counter() - start, 2)}


def main() -> int:
    device = "cpu" if "--cpu" in sys.argv[1:] else "cuda"
    if device == "cuda" and torch.cuda.device_count() < 2:
        print(f"pipeline_check.py needs two CUDA GPUs (found {torch.cuda.device_count()}); --cpu runs it on CPU.",
              file=sys.stderr)
        return 2
    out = run_checks(device)
    failures = out["failures"]
    if failures:
        print("pipeline_check: FAILED\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    schedule = "Megatron's GPU schedule" if device == "cuda" else "screl's CPU schedule"
    print(f"pipeline_check: PP=2 on {schedule} equals PP=1 (tolerance {TOL}); "
          f"all checks passed in {out['wall_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
