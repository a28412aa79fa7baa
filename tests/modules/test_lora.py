"""LoRA through peft (``model.init_args.lora``): only the adapters train, the refit sends the merged weights in the
base model's names, checkpoints hold the adapters and the base's fingerprint, a resume onto another base is refused.

Exactness: the merged export of a layer is ``W + (B @ A) * scale`` computed the way peft computes its delta, in fp32:
compared with ``torch.equal``. The merged model against the adapted one differ only by the order of float sums
(``W x + s B A x`` against ``(W + s B A) x``): 1e-5 on the logits.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from screl.algos import ClippedPGLoss
from screl.datamodule import collate_chunk
from screl.models import TinyCausalLM
from screl.models.lora import (
    RECORD,
    BaseMismatchError,
    LoRASettings,
    adapter_state,
    base_fingerprint,
    is_adapter_key,
    lora_settings,
    merged_policy_weights,
    save_peft_adapter,
)
from screl.modules import policy_gradient
from screl.modules.grpo import GRPO, token_logprobs
from screl.modules.megatron_compute import MegatronCompute
from screl.modules.ppo import PPO
from screl.rollout import GenerationRequest, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import ROW_SCHEMA

torch.set_num_threads(1)
SPEC = TinyCausalLM(seed=0)
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
GROUPS, G = 2, 2
ALGO = {"num_prompts_per_step": GROUPS, "num_generations_per_prompt": G}


def _module(spec: Any = SPEC, lora: dict[str, Any] | None = None, **kwargs: Any) -> GRPO:
    return GRPO(policy=spec, lora=dict(LORA) if lora is None else lora, learning_rate=1e-2, algo=ALGO, **kwargs)


def _chunk() -> dict[str, Any]:
    """One step of real generations (2 groups x 2 rows), laid out as the data module collates them."""
    engine = TorchGenerationEngine(SPEC, seed=0)
    tok = SPEC.build_tokenizer()
    reqs = [GenerationRequest(f"p{i}_g{s}", tok(f"{i}+{i + 1}=", add_special_tokens=False)["input_ids"],
                              SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=1.0, seed=7 * i + s))
            for i in range(GROUPS) for s in range(G)]
    rows = [ROW_SCHEMA.build(res, float(i % 3)) for i, res in enumerate(engine.generate(reqs))]
    meta = {"keys": [r.request_id for r in reqs], "trainer_version": 0, "step_groups": GROUPS, "last_chunk": True,
            "start_weight": [0] * len(reqs)}
    return collate_chunk(meta, ROW_SCHEMA.merge(rows), pad_id=0)


class _Batches:
    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


def _trainer(tmp_path: Path, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))


def _randomize_adapters(module: GRPO, seed: int = 3) -> None:
    """Non-zero adapters (B starts at zero: the merged weights would equal the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if is_adapter_key(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_only_the_adapters_require_grad_and_the_optimizer_holds_only_them() -> None:
    module = _module()
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in module.named_parameters() if is_adapter_key(n)}
    assert len(trained) == 2 * 3 * 2  # lora_A and lora_B on 3 modules of each of the 2 layers
    assert all(p.dtype == torch.float32 for n, p in module.named_parameters() if n in trained)
    opt = module.configure_optimizers()["optimizer"]
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in module.named_parameters() if n in trained}
    assert module.reference is None and not module.has_reference  # the loss asks for none


def test_a_training_step_changes_only_the_adapters(tmp_path: Path) -> None:
    module = _module()
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    chunk = _chunk()
    _trainer(tmp_path, 2).fit(module, train_dataloaders=_Batches([chunk, chunk]))
    after = module.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the step moved nothing"
    assert all(is_adapter_key(k) for k in changed), sorted(changed - {k for k in changed if is_adapter_key(k)})
    assert any(".lora_A." in k for k in changed) and any(".lora_B." in k for k in changed)


def test_the_merged_export_is_base_plus_scale_b_a_exactly_in_the_base_models_names() -> None:
    module = _module()
    _randomize_adapters(module)
    exported = module.export_weights()
    base = SPEC.build_model().state_dict()
    assert list(exported) == list(base)  # the base model's own names, in its order: no peft prefix or suffix
    layer = module.model.model.layers[1].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = base["model.layers.1.self_attn.q_proj.weight"] + (b @ a).detach() * (8 / 4)
    assert torch.equal(exported["model.layers.1.self_attn.q_proj.weight"], expected)
    assert torch.equal(exported["model.layers.1.self_attn.q_proj.bias"], base["model.layers.1.self_attn.q_proj.bias"])
    untouched = [k for k in base if "k_proj" in k or "embed" in k or "norm" in k]
    assert untouched and all(torch.equal(exported[k], base[k]) for k in untouched)
    assert not torch.equal(expected, base["model.layers.1.self_attn.q_proj.weight"])


def test_the_merged_models_logits_equal_the_adapted_models() -> None:
    module = _module()
    _randomize_adapters(module)
    merged = SPEC.build_model()
    merged.load_state_dict(module.export_weights())
    ids = torch.randint(3, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = module.model.eval()(input_ids=ids).logits
        plain = SPEC.build_model()(input_ids=ids).logits
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, adapted, rtol=0, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-2  # the adapters do change the policy


def test_the_reference_of_a_lora_run_is_the_base_with_its_adapters_off() -> None:
    module = _module(loss_fn=ClippedPGLoss(reference_policy_kl_penalty=0.1))
    assert module.has_reference and module.reference is None  # no copy of the policy
    _randomize_adapters(module)
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    ref = module.reference_logprobs(ids, attention)
    with torch.no_grad():
        base = token_logprobs(SPEC.build_model(), ids, attention, 1.0)
        policy = token_logprobs(module.model, ids, attention, 1.0)
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-6)
    assert (policy - base).abs().max() > 1e-3
    assert all(p.requires_grad for n, p in module.model.named_parameters() if is_adapter_key(n))  # back on


def _fit_and_save(tmp_path: Path) -> tuple[GRPO, dict[str, Any]]:
    module = _module()
    chunk = _chunk()
    trainer = _trainer(tmp_path, 1)
    trainer.fit(module, train_dataloaders=_Batches([chunk, chunk]))
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    return module, torch.load(tmp_path / "lora.ckpt", weights_only=False)


def test_the_checkpoint_holds_the_adapters_their_optimizer_state_and_the_base_fingerprint(tmp_path: Path) -> None:
    module, ckpt = _fit_and_save(tmp_path)
    state = ckpt["state_dict"]
    adapters = adapter_state(module.model)
    assert set(state) == {"model." + k for k in adapters}
    assert all(torch.equal(state["model." + k], v) for k, v in adapters.items())
    opt_state = ckpt["optimizer_states"][0]["state"]
    assert len(opt_state) == len(adapters) == 12
    assert {tuple(s["exp_avg"].shape) for s in opt_state.values()} == {tuple(v.shape) for v in adapters.values()}
    record = ckpt[RECORD]
    assert record["base_sha256"] == base_fingerprint(iter(SPEC.build_model().state_dict().items()))
    assert record["base_spec"] == repr(SPEC)
    assert LoRASettings(**{**record["settings"], "target_modules": tuple(record["settings"]["target_modules"])}) == \
        module.lora


def test_a_resume_continues_the_run_as_if_it_had_never_stopped(tmp_path: Path) -> None:
    """One step, saved; resumed for a second: the adapters equal two steps in one go (the adapters and their Adam
    moments came back; the base was put back beside them)."""
    _fit_and_save(tmp_path)
    chunk = _chunk()
    resumed, straight = _module(), _module()
    trainer = _trainer(tmp_path, 2)
    trainer.fit(resumed, train_dataloaders=_Batches([chunk, chunk]), ckpt_path=tmp_path / "lora.ckpt")
    _trainer(tmp_path, 2).fit(straight, train_dataloaders=_Batches([chunk, chunk]))
    assert trainer.global_step == 2
    got, want = resumed.model.state_dict(), straight.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    one_step = torch.load(tmp_path / "lora.ckpt", weights_only=False)["state_dict"]
    assert any(not torch.equal(got[k.removeprefix("model.")], v) for k, v in one_step.items())  # it did train


def test_a_resume_onto_another_base_is_refused_naming_both(tmp_path: Path) -> None:
    _, ckpt = _fit_and_save(tmp_path)
    other = _module(spec=TinyCausalLM(seed=1))
    with pytest.raises(BaseMismatchError, match=r"model\.init_args\.lora: .*trained on another base model: "
                                                r"TinyCausalLM\(.*seed=0.*\) \(weights sha256 [0-9a-f]{16}\), and "
                                                r"this run's base is TinyCausalLM\(.*seed=1.*\) \(weights sha256"):
        other.on_load_checkpoint(ckpt)
    with pytest.raises(ValueError, match=r"checkpoint's adapters were trained with .*'r': 4.*this run sets .*'r': 8"):
        _module(lora={**LORA, "r": 8}).on_load_checkpoint(ckpt)
    with pytest.raises(ValueError, match=r"holds LoRA adapters .* this run trains the full policy"):
        GRPO(policy=SPEC, algo=ALGO).on_load_checkpoint(ckpt)
    full = {"state_dict": GRPO(policy=SPEC, algo=ALGO).state_dict()}
    with pytest.raises(ValueError, match=r"model\.init_args\.lora is set but the checkpoint holds a full fine-tune"):
        _module().on_load_checkpoint(full)


def test_an_export_merges_a_bundles_adapters_and_writes_a_peft_adapter(tmp_path: Path) -> None:
    from peft import PeftModel

    module, ckpt = _fit_and_save(tmp_path)
    _randomize_adapters(module)  # stronger adapters than one step's, saved through the module's own hook
    ckpt["state_dict"] = module.state_dict()
    module.on_save_checkpoint(ckpt)
    merged = merged_policy_weights(ckpt, SPEC)
    exported = module.export_weights()
    assert list(merged) == list(exported) and all(torch.equal(merged[k], exported[k]) for k in exported)
    with pytest.raises(BaseMismatchError, match=r"seed=0.*seed=1"):
        merged_policy_weights(ckpt, TinyCausalLM(seed=1))
    save_peft_adapter(str(tmp_path / "adapter"), module.lora, adapter_state(module.model))
    peft_model = PeftModel.from_pretrained(SPEC.build_model(), str(tmp_path / "adapter")).eval()
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, module.model.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls", [GRPO, PPO])
def test_lora_under_megatron_is_refused(cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_gradient, "compute_for", lambda trainer: MegatronCompute(strategy=None))
    extra = {"value": SPEC} if cls is PPO else {}
    module = cls(policy=SPEC, lora=LORA, algo=ALGO, **extra)
    with pytest.raises(ValueError, match=r"^model\.init_args\.lora: LoRA trains a Hugging Face policy under Lightning's "
                                         r"own strategies .*MegatronStrategy does not support it"):
        module.configure_model()


def test_a_bf16_base_stays_bf16_with_fp32_adapters_and_the_export_is_the_engines_dtype() -> None:
    spec = TinyCausalLM(seed=0, dtype="bfloat16")
    module = _module(spec=spec)
    dtypes = {(is_adapter_key(n), p.dtype) for n, p in module.model.named_parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    _randomize_adapters(module)
    exported = module.export_weights()
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    layer = module.model.model.layers[0].self_attn.v_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach() * 2.0
    base = spec.build_model().state_dict()["model.layers.0.self_attn.v_proj.weight"]
    assert torch.equal(exported["model.layers.0.self_attn.v_proj.weight"], (base.float() + delta).bfloat16())


def test_the_settings_are_checked_and_qlora_is_refused() -> None:
    assert lora_settings(None) is None
    assert lora_settings({"r": 8}) == LoRASettings(r=8)
    with pytest.raises(ValueError, match=r"model\.init_args\.lora\.load_in_4bit: QLoRA .* not offered: bitsandbytes "
                                         r"needs CUDA"):
        lora_settings({"r": 8, "load_in_4bit": True})
    with pytest.raises(ValueError, match=r"model\.init_args\.lora\.rank: unknown key; expected r, alpha"):
        lora_settings({"rank": 8})
    with pytest.raises(ValueError, match=r"model\.init_args\.lora\.r=0: the adapters' rank"):
        lora_settings({"r": 0})
    with pytest.raises(ValueError, match=r"model\.init_args\.lora\.dropout=1\.5: must be in \[0, 1\)"):
        lora_settings({"dropout": 1.5})
    with pytest.raises(ValueError, match=r"model\.init_args\.lora\.target_modules: .*nonexistent_proj"):
        _module(lora={"target_modules": ["nonexistent_proj"]})


def test_a_peft_config_by_class_path_gives_the_same_adapters_and_refuses_what_cannot_merge() -> None:
    block = {"class_path": "peft.LoraConfig",
             "init_args": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": True}}
    settings = lora_settings({"peft": block})
    assert settings is not None and (settings.r, settings.alpha, settings.use_rslora) == (4, 8.0, True)
    module = _module(lora={"peft": block})
    layer = module.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(8 / math.sqrt(4), rel=0, abs=0)
    with pytest.raises(ValueError, match=r"model\.init_args\.lora\.peft\.init_args\.use_dora=True: not supported, "
                                         r"DoRA"):
        lora_settings({"peft": {"class_path": "peft.LoraConfig", "init_args": {"r": 4, "use_dora": True}}})
    with pytest.raises(ValueError, match=r"model\.init_args\.lora\.peft\.class_path='peft\.IA3Config': not an "
                                         r"importable peft\.LoraConfig"):
        lora_settings({"peft": {"class_path": "peft.IA3Config"}})
    with pytest.raises(ValueError, match=r"set either the short keys or a peft config, not both"):
        lora_settings({"r": 4, "peft": block})


def test_the_topologies_that_would_bypass_the_merged_refit_are_refused() -> None:
    from types import SimpleNamespace

    from screl.datamodule import RolloutDataModule

    module = _module()
    for enabled, transfer in ((True, None), (False, "nccl")):
        generation = SimpleNamespace(colocated=SimpleNamespace(enabled=enabled),
                                     backend_args={"weight_transfer": transfer} if transfer else {})
        dm = RolloutDataModule.__new__(RolloutDataModule)  # its colocated property reads the generation block
        dm.generation = generation  # type: ignore[assignment]
        module.trainer = SimpleNamespace(datamodule=dm)  # type: ignore[assignment]
        with pytest.raises(ValueError, match=r"model\.init_args\.lora with (data\.init_args\.generation\.colocated"
                                             r"\.enabled: true|vLLM's NCCL weight transfer) is not supported"):
            module.on_fit_start()
    dm.generation = SimpleNamespace(colocated=SimpleNamespace(enabled=False), backend_args={})  # type: ignore[assignment]
    module.on_fit_start()  # separate workers, the object-store refit: the merged weights


def test_activation_checkpointing_gives_the_same_lora_step(tmp_path: Path) -> None:
    """Hugging Face's (non-reentrant) checkpointing over a frozen base: the adapters still get their gradients."""
    chunk = _chunk()
    plain, checkpointed = _module(), _module(activation_checkpointing=True)
    for module in (plain, checkpointed):
        _trainer(tmp_path, 1).fit(module, train_dataloaders=_Batches([chunk]))
    got, want = adapter_state(checkpointed.model), adapter_state(plain.model)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-6
    assert any(not torch.equal(want[k], v) for k, v in adapter_state(_module().model).items())
