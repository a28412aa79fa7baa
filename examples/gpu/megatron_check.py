"""GPU check for ``screl.strategies`` (one CUDA GPU, under 5 minutes; not runnable on a CPU-only machine).

What it does, on a small Qwen2-layout model (hidden 256, 4 layers) initialized from a Hugging Face model:

1. Megatron ``GPTModel`` on CUDA (Transformer Engine's layer spec when installed, else the local one)
   gives the Hugging Face model's logits; ``export_weights()`` gives its state dict back.
2. TP=1 training steps (one fixed batch, so the loss must fall) with Megatron's own optimizer (``get_megatron_optimizer``) and schedule
   (``get_forward_backward_func``, through ``screl.strategies.schedule.forward_backward``), printing
   loss and gradient norm per step.
3. The same steps through the strategy's torch-optimizer path (``main_grad`` as ``.grad``, torch AdamW):
   the same losses within a stated tolerance.
4. A ``dist_checkpointing`` save/load round trip on GPU gives back the same loss.

Run from the repository root::

    python -m pip install --no-deps --no-build-isolation -e .   # screl.strategies (needs megatron-core)
    python examples/gpu/megatron_check.py

Exit status 0 when every check passes. The process group is nccl over a ``file://`` rendezvous
(world size 1): nothing listens on a network port.

``--cpu`` runs checks 1, 3 and 4 on CPU (gloo, screl's CPU shim for megatron-core; Megatron's own optimizer
hard-codes CUDA, so check 2 and the optimizer comparison are skipped): a dry run of the script on a machine
without GPUs. :func:`run_checks` is the same as a function returning its figures
(``examples/gpu/acceptance.py`` calls it).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import torch
from torch import Tensor

STEPS = 8
SEQ = 128
GLOBAL_BATCH = 8
MICROBATCHES = 2
LR = 1e-3
DEVICE = "cuda"
LOSS_TOL = 2e-3
"""Megatron's Adam and torch's AdamW, no weight decay (Megatron skips it on biases and norms), float32:
only rounding differs, which Adam can amplify on near-zero gradients, hence the loose bound."""


def hf_model() -> Any:
    """A random-init Qwen2 at the ``small`` benchmark scale, on ``DEVICE`` in float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model: Any = Qwen2ForCausalLM(cfg)
    return model.to(torch.device(DEVICE)).eval()


def batch(step: int, vocab: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)
    mask = (torch.rand(GLOBAL_BATCH, SEQ - 1, generator=g) > 0.3).float()
    return {"ids": ids.to(DEVICE), "mask": mask.to(DEVICE)}


class MeanLoss:
    """Masked token mean per microbatch."""

    def forward(self, b: dict[str, Tensor], output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        loss = -(output * b["mask"]).sum() / b["mask"].sum()
        return loss, {"loss": loss.detach().clone()}

    def reduce(self, values: list[dict[str, Tensor]]) -> Tensor:
        return torch.stack([v["loss"] for v in values]).mean()


def build(hf: Any) -> Any:
    """A Megatron-DDP-wrapped GPTModel holding the Hugging Face weights."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from screl.strategies import GPTModelProvider, load_hf_weights

    model = GPTModelProvider.from_hf_config(hf.config)().to(DEVICE)
    load_hf_weights(model, hf.state_dict())
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.config.no_sync_func = ddp.no_sync
    return ddp


def step_fn(vocab: int) -> Any:
    from screl.strategies import token_logprobs

    def forward_step(model: torch.nn.Module, mb: dict[str, Tensor]) -> Tensor:
        ids = mb["ids"]
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        logits = model(ids, pos, None)
        return token_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=vocab)

    return forward_step


def micro(b: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    size = GLOBAL_BATCH // MICROBATCHES
    return [{k: v[i * size : (i + 1) * size] for k, v in b.items()} for i in range(MICROBATCHES)]


def train_megatron_optimizer(hf: Any) -> list[float]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from screl.strategies.schedule import forward_backward

    vocab = hf.config.vocab_size
    ddp = build(hf)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, adam_eps=1e-8, clip_grad=0.0), [ddp]
    )
    losses = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = forward_backward(ddp, micro(batch(0, vocab)), step_fn(vocab), MeanLoss())
        ok, grad_norm, _ = opt.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        print(
            f"[megatron optimizer] step {step} loss {float(loss):.6f} grad_norm {float(grad_norm or 0):.4f} "
            f"ok {ok} {1e3 * (time.perf_counter() - t0):.1f} ms",
            flush=True,
        )
        losses.append(float(loss))
    return losses


def train_torch_optimizer(hf: Any) -> tuple[list[float], Any]:
    """The strategy's torch-optimizer path: finalize, ``main_grad`` as ``.grad``, AdamW, zero buffers."""
    from screl.strategies.schedule import forward_backward

    vocab = hf.config.vocab_size
    ddp = build(hf)
    params = list(ddp.module.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, eps=1e-8)
    losses = []
    for step in range(STEPS):
        loss = forward_backward(ddp, micro(batch(0, vocab)), step_fn(vocab), MeanLoss())
        for p in params:
            p.grad = p.main_grad.to(p.dtype)
        opt.step()
        ddp.zero_grad_buffer()
        for p in params:
            p.grad = None
        print(f"[torch AdamW] step {step} loss {float(loss):.6f}", flush=True)
        losses.append(float(loss))
    return losses, ddp


def check_parity_and_export(hf: Any) -> tuple[float, float]:
    from screl.strategies import export_weights

    ddp = build(hf)
    ids = batch(0, hf.config.vocab_size)["ids"]
    with torch.no_grad():
        pos = torch.arange(SEQ, device=ids.device).expand_as(ids)
        ours = ddp(ids, pos, None)[..., : hf.config.vocab_size]
        ref = hf(ids).logits
    diff = float((ours - ref).abs().max())
    print(f"[parity] max |logits - HF logits| = {diff:.3g}", flush=True)
    assert diff < 1e-3, diff
    exported = export_weights(ddp.module)
    expected = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(exported) == set(expected), sorted(set(exported) ^ set(expected))
    worst = max(float((exported[k] - expected[k].cpu()).abs().max()) for k in expected)
    print(f"[export] {len(exported)} tensors, max diff {worst:.3g}", flush=True)
    assert worst == 0.0
    return diff, worst


def check_checkpoint(hf: Any, ddp: Any, workdir: str) -> tuple[float, float]:
    from screl.strategies import checkpoint as ckpt
    from screl.strategies.schedule import forward_backward

    vocab = hf.config.vocab_size
    probe = [batch(99, vocab)]
    before = float(forward_backward(ddp, probe, step_fn(vocab), MeanLoss(), forward_only=True))
    path = os.path.join(workdir, "ckpt")
    ckpt.save_checkpoint({"state_dict": ddp.module.sharded_state_dict(prefix="model.")}, path)
    fresh = build(hf)  # the initial weights again
    loaded = ckpt.load_checkpoint(
        lambda common: {"state_dict": fresh.module.sharded_state_dict(prefix="model.")}, path
    )
    fresh.module.load_state_dict({k[len("model.") :]: v for k, v in loaded["state_dict"].items()})
    after = float(forward_backward(fresh, probe, step_fn(vocab), MeanLoss(), forward_only=True))
    print(f"[checkpoint] probe loss before save {before:.6f}, after load {after:.6f}", flush=True)
    assert abs(before - after) < 1e-6
    return before, after


def run_checks(cpu: bool = False, steps: int | None = None) -> dict[str, Any]:
    """Every check of this script in this process (world size 1, a ``file://`` rendezvous); raises
    ``AssertionError`` on the first that fails, else returns the figures. ``cpu``: gloo and the CPU shim, no
    Megatron optimizer (it needs CUDA)."""
    import torch.distributed as dist
    from screl.strategies.parallel import ParallelismConfig, destroy_model_parallel, initialize_model_parallel

    global DEVICE, STEPS
    DEVICE = "cpu" if cpu else "cuda"
    STEPS = steps or STEPS
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="megatron_check_")
    if not cpu:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"file://{workdir}/pg", rank=0, world_size=1)
    out: dict[str, Any] = {"device": DEVICE, "steps": STEPS}
    try:
        initialize_model_parallel(ParallelismConfig(), seed=0, cpu=cpu)
        hf = hf_model()
        out["logits_max_abs_diff"], out["export_max_abs_diff"] = check_parity_and_export(hf)
        if not cpu:
            ref = train_megatron_optimizer(hf)
            out["megatron_optimizer_losses"] = ref
            assert ref[-1] < ref[0], "loss did not go down"
        ours, trained = train_torch_optimizer(hf)
        out["torch_optimizer_losses"] = ours
        assert ours[-1] < ours[0], "loss did not go down"
        if not cpu:
            worst = max(abs(a - b) for a, b in zip(ref, ours, strict=True))
            print(f"[optimizers] max |loss difference| over {STEPS} steps = {worst:.3g} (tolerance {LOSS_TOL})")
            out["optimizer_loss_max_abs_diff"] = worst
            assert worst < LOSS_TOL, worst
        else:
            out["optimizer_comparison"] = "skipped: Megatron's optimizer needs CUDA"
        out["checkpoint_loss_before"], out["checkpoint_loss_after"] = check_checkpoint(hf, trained, workdir)
        destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    out["wall_s"] = round(time.perf_counter() - start, 2)
    return out


def main() -> int:
    cpu = "--cpu" in sys.argv[1:]
    if not cpu and not torch.cuda.is_available():
        print("megatron_check.py needs a CUDA GPU (--cpu runs its CPU part).", file=sys.stderr)
        return 2
    out = run_checks(cpu)
    print(f"megatron_check: all checks passed in {out['wall_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
