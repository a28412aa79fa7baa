"""Training at real scale, on CPU: fp32 master weights under bf16 compute, the refit in the engine's dtype,
activation checkpointing, the accelerator's micro-batch budget, and ``screl check``'s refusals and estimate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _check_helpers import load_config
from _check_helpers import run_check as _check

from screl.algos import ClippedPGLoss
from screl.datamodule import collate_chunk
from screl.models import TinyCausalLM
from screl.modules.grpo import ACCELERATOR_MICRO_BATCH_TOKENS, GRPO
from screl.modules.memory_plan import ModelShape, estimate_trainer_memory
from screl.rollout import GenerationRequest, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import ROW_SCHEMA

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
BF16 = TinyCausalLM(seed=0, dtype="bfloat16")
G = 2


def _batch(spec: TinyCausalLM, groups: int = 3) -> dict[str, Any]:
    engine = TorchGenerationEngine(spec, seed=0, version=0)
    tok = spec.build_tokenizer()
    reqs = [GenerationRequest(f"p{i}_g{s}", tok(f"{i}+{i}=", add_special_tokens=False)["input_ids"],
                              SamplingParams(max_new_tokens=5, min_new_tokens=5, temperature=1.0, seed=3 * i + s))
            for i in range(groups) for s in range(G)]
    rows = [ROW_SCHEMA.build(r, float(i % 2)) for i, r in enumerate(engine.generate(reqs))]
    meta = {"keys": [r.request_id for r in reqs], "trainer_version": 0, "step_groups": groups, "last_chunk": True,
            "start_weight": [0] * len(reqs)}
    return collate_chunk(meta, ROW_SCHEMA.merge(rows), pad_id=0)


class _Batches:
    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


def _module(spec: TinyCausalLM, lr: float = 1e-2, **kwargs: Any) -> GRPO:
    return GRPO(policy=spec, loss_fn=ClippedPGLoss(use_importance_sampling_correction=True), learning_rate=lr,
                max_grad_norm=None, algo={"num_prompts_per_step": 3, "num_generations_per_prompt": G}, **kwargs)


def _fit(module: GRPO, batches: list[dict[str, Any]], precision: str = "32-true") -> None:
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, precision=precision,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=_Batches(batches))


def test_a_bf16_policy_trains_fp32_masters_under_bf16_mixed() -> None:
    module = _module(BF16)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    assert module.engine_dtype == torch.bfloat16
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}
    _fit(module, [_batch(BF16)], precision="bf16-mixed")
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}
    opt = module.trainer.optimizers[0]
    moments = [s["exp_avg"] for s in opt.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}  # fp32 optimizer state
    changed = [k for k, v in module.model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > len(before) // 2


def test_the_refit_sends_the_engine_dtype_cast_from_the_masters() -> None:
    module = _module(BF16)
    _fit(module, [_batch(BF16)], precision="bf16-mixed")
    exported = module.export_weights()
    masters = module.model.state_dict()
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    for name, value in exported.items():  # exact: the export is the masters' bf16 cast, one rounding either way
        assert torch.equal(value, masters[name].to(torch.bfloat16)), name
    engine = TorchGenerationEngine(BF16, seed=0, version=0)
    engine.update_weights(exported, version=1)
    for name, p in engine.model.state_dict().items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, masters[name].to(torch.bfloat16)), name


def test_an_update_below_bf16_precision_accumulates_in_the_master() -> None:
    """An AdamW step of lr 1e-6 moves every weight by ~1e-6, under half a bf16 step for any weight above ~3e-4: a
    bf16 parameter would not move, the fp32 master does, and many such steps add up to a visible bf16 change."""
    module = _module(BF16, lr=1e-6)
    initial = {k: v.clone() for k, v in module.model.state_dict().items()}
    batch = _batch(BF16)
    _fit(module, [batch], precision="bf16-mixed")
    name = "model.layers.0.mlp.down_proj.weight"
    master, start = module.model.state_dict()[name], initial[name]
    moved = master != start
    big = start.abs() > 1e-2  # weights whose bf16 step (>= 2**-14) dwarfs the update
    assert moved[big].float().mean() > 0.9  # the masters took the update ...
    assert torch.equal(master[big].to(torch.bfloat16), start[big].to(torch.bfloat16))  # ... below bf16's step
    # pure bf16 (what screl refuses): the same optimizer on the bf16 weights leaves them where they were
    pure = start.to(torch.bfloat16).clone().requires_grad_(True)
    opt = torch.optim.AdamW([pure], lr=1e-6, weight_decay=0.0)
    pure.grad = torch.randn_like(pure)
    opt.step()
    assert torch.equal(pure.detach()[big], start[big].to(torch.bfloat16))


@pytest.mark.parity
def test_activation_checkpointing_gives_the_same_gradients_and_recomputes() -> None:
    spec = TinyCausalLM(seed=0)
    batch = _batch(spec)
    grads = []
    forwards = []
    for ckpt in (False, "full"):
        module = _module(spec, activation_checkpointing=ckpt)
        mlp = module.model.model.layers[0].mlp  # (module hooks do not run in a recompute: count calls instead)
        calls: list[int] = []
        forward = mlp.forward
        mlp.forward = lambda *a, _f=forward, _c=calls, **k: _c.append(1) or _f(*a, **k)  # type: ignore[method-assign]
        chunk = module._chunk_tensors(batch)
        loss, _ = module._micro_batch_loss(batch, chunk, slice(0, chunk.rows))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None})
        forwards.append(len(calls))
    assert forwards == [1, 2]  # with checkpointing the layer runs again in the backward pass
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        # exact: the recompute runs the layer's same forward kernels on the same inputs in the same process (a
        # non-reentrant checkpoint, no dropout), then the same backward kernels in the same order
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)


def test_selective_checkpointing_needs_megatron() -> None:
    module = _module(TinyCausalLM(seed=0), activation_checkpointing="selective")
    with pytest.raises(ValueError, match=r"selective .* needs trainer.strategy: screl.strategies.MegatronStrategy"):
        _fit(module, [_batch(TinyCausalLM(seed=0))])


def test_bad_knobs_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"logprob_chunk_tokens=-1: must be >= 0"):
        _module(TinyCausalLM(seed=0), logprob_chunk_tokens=-1)
    with pytest.raises(ValueError, match=r"activation_checkpointing='some': expected"):
        _module(TinyCausalLM(seed=0), activation_checkpointing="some")


def test_an_accelerator_splits_a_chunk_by_the_token_budget() -> None:
    module = _module(TinyCausalLM(seed=0))
    module._device = torch.device("cuda", 0)  # what _micro_rows reads on an accelerator (no GPU needed to plan)
    rows, width = 64, 1200
    per = module._micro_rows(rows, width)
    assert per < rows and per * width <= ACCELERATOR_MICRO_BATCH_TOKENS
    assert module._micro_rows(4, 100) == 4  # a chunk under the budget stays whole


# -- screl check ------------------------------------------------------------------------------------------------


def _tiny() -> dict[str, Any]:
    return load_config("grpo_tiny.yaml")


def test_check_refuses_every_real_scale_combination_that_cannot_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _tiny()
    cfg["trainer"]["precision"] = "bf16-true"
    cfg["model"]["init_args"]["logprob_chunk_tokens"] = -5
    cfg["model"]["init_args"]["activation_checkpointing"] = "selective"
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc == 2
    assert "trainer.precision = 'bf16-true'" in out and "no fp32 master copy" in out
    assert "Fix: set trainer.precision: bf16-mixed" in out
    assert "model.init_args.logprob_chunk_tokens = -5" in out
    assert "model.init_args.activation_checkpointing = 'selective'" in out and "Megatron's" in out
    cfg = _tiny()
    cfg["trainer"]["precision"] = "16-mixed"
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc == 2 and "trainer.precision = '16-mixed'" in out and "loss scaler" in out


def test_bf16_mixed_passes_check_and_the_plan_prints_the_memory_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _tiny()
    cfg["trainer"]["precision"] = "bf16-mixed"
    rc, out = _check(cfg, tmp_path, capsys)
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("trainer memory"))
    assert "GiB peak per training process" in line and "4096-token micro-batch" in line


def test_the_estimate_follows_the_memory_model() -> None:
    """Qwen2.5-1.5B's shape: the parameter count matches the published 1.54B, and each knob moves its part."""
    shape = ModelShape(hidden=1536, query=1536, kv=256, ffn=8960, layers=28, vocab=151_936, tied=True)
    assert 1.50e9 < shape.parameters < 1.56e9
    base = estimate_trainer_memory(shape, 8192, bf16_mixed=True)
    assert base.state == 18 * shape.parameters
    ckpt = estimate_trainer_memory(shape, 8192, bf16_mixed=True, activation_checkpointing=True)
    assert ckpt.activations < base.activations / 5 and ckpt.state == base.state
    full = estimate_trainer_memory(shape, 8192, bf16_mixed=True, logprob_chunk_tokens=0)
    assert full.logits == 3 * 4 * 8192 * 151_936 + 8192 * 1536 * 6
    assert base.chunk_tokens == 220 and base.logits < full.logits / 10
    assert estimate_trainer_memory(shape, 16384, bf16_mixed=True).activations == 2 * base.activations


def test_the_estimate_splits_over_megatron_ranks() -> None:
    shape = ModelShape(hidden=1536, query=1536, kv=256, ffn=8960, layers=28, vocab=151_936, tied=True)
    one = estimate_trainer_memory(shape, 8192, bf16_mixed=True, megatron=True)
    tp2 = estimate_trainer_memory(shape, 8192, bf16_mixed=True, megatron=True, tensor_parallel=2)
    sharded = estimate_trainer_memory(shape, 8192, bf16_mixed=True, megatron=True, tensor_parallel=2,
                                      optimizer_shards=4)
    p2 = shape.parameters // 2
    assert tp2.state == 18 * p2 and sharded.state == 8 * p2 + 8 * p2 // 4 + 2 * p2
    assert tp2.logits < one.logits and one.logits >= 3 * 4 * 8192 * 151_936  # vocabulary-parallel, not chunked
    assert tp2.activations < one.activations
