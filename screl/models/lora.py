"""LoRA adapters on a Hugging Face policy, through peft: the settings, the adapted model, its merged weights.

The trainer adapts its own copy of the policy (``model.init_args.lora``, :class:`LoRASettings`): peft injects
low-rank adapters into the model in place (``peft.inject_adapter_in_model``: no ``PeftModel`` wrapper, so the model
stays the Hugging Face model every compute path reads, ``get_output_embeddings()`` and ``base_model`` included). The
base weights stay frozen in the spec's dtype (no fp32 master copy: they take no update), the adapters train in fp32.

Whoever reads the weights in Hugging Face names (a refit, ``screl export``) gets the *merged* weights,
``W + scale * B @ A`` per adapted layer under the base model's own names (:func:`hf_state_items`), computed on the
fly layer by layer: the model is never merged in place, so the frozen base never drifts by a merge's round-off.

Also here: the base weights' fingerprint (:func:`base_fingerprint`, what a resume checks), the adapters' state
(:func:`adapter_state`) and the PEFT adapter folder an export can write (:func:`save_peft_adapter`). Pure: no Lightning;
peft is imported on first use (the ``lora`` extra).
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ADAPTER", "KEY", "LoRASettings", "adapter_state", "adapters_disabled", "apply_lora", "base_fingerprint",
    "base_state_items", "has_lora", "hf_state_items", "is_adapter_key", "lora_settings", "peft_adapter_tensors",
    "save_peft_adapter",
]

KEY = "model.init_args.lora"

MEGATRON_REFUSAL = (
    f"{KEY}: LoRA trains a Hugging Face policy under Lightning's own strategies (one process, "
    "screl.strategies.DDPStrategy); screl.strategies.MegatronStrategy does not support it. Remove "
    f"{KEY} or train under trainer.strategy: auto or screl.strategies.DDPStrategy"
)
"""The error a LoRA module raises when Lightning configures it under ``MegatronStrategy`` (``screl check``'s rule
gives the same)."""

COLOCATED_REFUSAL = (
    f"{KEY} with data.init_args.generation.colocated.enabled: true is not supported: the colocated engine decodes "
    "with the trainer's own module, whose adapters are not merged into its layers; generate on separate workers "
    "(colocated.enabled: false): they receive the merged weights at each refit"
)
BROADCAST_REFUSAL = (
    f"{KEY} with vLLM's NCCL weight transfer is not supported: it sends the trainer's module as it is (its base and "
    "adapters apart, in peft's names); use the object-store refit, which sends the merged weights"
)
ADAPTER = "default"
"""peft's adapter name: the one adapter screl trains."""
INIT_SEED = 0
"""The seed of the adapters' initial values."""
ADAPTER_LAYERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
"""peft's names of the submodules holding adapter weights (``LoraLayer.adapter_layer_names``)."""
_SHORT_KEYS = ("r", "alpha", "dropout", "target_modules", "use_rslora")
_QLORA_KEYS = ("load_in_4bit", "load_in_8bit", "quantization", "quantization_config", "qlora", "bnb_4bit_quant_type")
_REFUSED_PEFT = {  # LoraConfig fields whose adapters the merged refit cannot express as base + scale * B @ A
    "use_dora": (False, "DoRA rescales the merged weight's columns"),
    "bias": ("none", "it trains the base layers' biases (not adapters)"),
    "modules_to_save": (None, "it trains full copies of base modules"),
    "trainable_token_indices": (None, "it trains embedding rows (not adapters)"),
    "target_parameters": (None, "it adapts raw parameters, not layers"),
}


@dataclass(frozen=True)
class LoRASettings:
    """``model.init_args.lora``: ``r``, ``alpha`` (the scale is ``alpha / r``, or ``alpha / sqrt(r)`` with
    ``use_rslora``), ``dropout`` (0 keeps the trainer's logprobs deterministic, as the engines' are) and
    ``target_modules`` (module names, or ``all-linear``: every linear layer but the output layer); or ``peft``, a
    ``{class_path: peft.LoraConfig, init_args: {...}}`` for peft's other LoRA options."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"
    use_rslora: bool = False
    peft: dict[str, Any] | None = None

    def peft_config(self) -> Any:
        """The ``peft.LoraConfig`` (or the ``peft`` block's class) these settings describe."""
        if self.peft is not None:
            return _peft_block(self.peft)
        LoraConfig = require_peft().LoraConfig
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          use_rslora=self.use_rslora, bias="none")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if not isinstance(self.target_modules, str):
            out["target_modules"] = list(self.target_modules)
        return out


def require_peft() -> Any:
    """The ``peft`` module, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module("peft")
    except ImportError as err:
        raise ImportError(f"{KEY} needs peft: pip install 'screl[lora]' (peft>=0.21.2)") from err


def _peft_block(block: Mapping[str, Any]) -> Any:
    """``lora.peft``: a LoRA config by class path (a ``peft.LoraConfig`` or a subclass), checked for what the merged
    refit can express."""
    LoraConfig = require_peft().LoraConfig

    path = block.get("class_path", "peft.LoraConfig")
    module, _, name = str(path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, LoraConfig)):
        raise ValueError(f"{KEY}.peft.class_path={path!r}: not an importable peft.LoraConfig (or subclass); screl "
                         "trains LoRA adapters only (the refit merges them: base + scale * B @ A)")
    try:
        config = cls(**dict(block.get("init_args") or {}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{KEY}.peft.init_args: {err}") from err
    for field, (allowed, why) in _REFUSED_PEFT.items():
        value = getattr(config, field, allowed)
        if not (value == allowed or value is None or value is False or (isinstance(value, (list, set, dict))
                                                                         and not value)):
            raise ValueError(f"{KEY}.peft.init_args.{field}={getattr(config, field)!r}: not supported, {why}; the "
                             f"engines receive merged weights (base + scale * B @ A). Leave {field} at {allowed!r}")
    return config


def lora_settings(value: Mapping[str, Any] | LoRASettings | None) -> LoRASettings | None:
    """``model.init_args.lora`` checked (each error names its key); None: no LoRA (full fine-tuning)."""
    if value is None or isinstance(value, LoRASettings):
        return value
    require_peft()
    if not isinstance(value, Mapping):
        raise ValueError(f"{KEY}: expected a mapping (r, alpha, dropout, target_modules, use_rslora; or peft), got "
                         f"{type(value).__name__}")
    quantized = sorted(k for k in value if k in _QLORA_KEYS)
    if quantized:
        raise ValueError(f"{KEY}.{quantized[0]}: QLoRA (a 4/8-bit base through bitsandbytes) is not offered: "
                         "bitsandbytes needs CUDA, and every refit would dequantize the base to merge the adapters. "
                         "Train LoRA over a bf16 base (the policy spec's dtype: bfloat16) instead")
    unknown = sorted(set(value) - set(_SHORT_KEYS) - {"peft"})
    if unknown:
        raise ValueError(f"{KEY}.{unknown[0]}: unknown key; expected {', '.join(_SHORT_KEYS)} (or peft: a "
                         "peft.LoraConfig by class_path/init_args)")
    if "peft" in value:
        return _peft_settings(value)
    return _short_settings(value)


def _peft_settings(value: Mapping[str, Any]) -> LoRASettings:
    both = sorted(k for k in value if k in _SHORT_KEYS)
    if both:
        raise ValueError(f"{KEY}.peft and {KEY}.{both[0]}: set either the short keys or a peft config, not both")
    block = value["peft"]
    if not isinstance(block, Mapping):
        raise ValueError(f"{KEY}.peft: expected {{class_path: peft.LoraConfig, init_args: {{...}}}}")
    config = _peft_block(block)
    targets = config.target_modules
    return LoRASettings(r=int(config.r), alpha=float(config.lora_alpha), dropout=float(config.lora_dropout),
                        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets or ())),
                        use_rslora=bool(config.use_rslora), peft=dict(block))


def _short_settings(value: Mapping[str, Any]) -> LoRASettings:
    r, alpha, dropout = value.get("r", 16), value.get("alpha", 32.0), value.get("dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{KEY}.r={r!r}: the adapters' rank, an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{KEY}.alpha={alpha!r}: must be > 0 (the scale is alpha / r)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{KEY}.dropout={dropout!r}: must be in [0, 1)")
    targets = value.get("target_modules", "all-linear")
    if isinstance(targets, str):
        target: str | tuple[str, ...] = targets
    elif isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t for t in targets):
        target = tuple(targets)
    else:
        raise ValueError(f"{KEY}.target_modules={targets!r}: a list of module names (q_proj, v_proj, ...) or "
                         "'all-linear'")
    return LoRASettings(r=r, alpha=float(alpha), dropout=float(dropout), target_modules=target,
                        use_rslora=bool(value.get("use_rslora", False)))


# -- the adapted model --------------------------------------------------------------------------------------------
def apply_lora(model: torch.nn.Module, settings: LoRASettings) -> torch.nn.Module:
    """Inject ``settings``' adapters into ``model`` in place (peft's ``inject_adapter_in_model``): the base is frozen
    as loaded, the adapters are fp32 and the only parameters that require grad. Returns ``model``.

    The adapters' initial values (peft's: ``A`` random, ``B`` zero) are drawn from a fixed seed, the global RNG left
    untouched: every process (each DDP rank) and every run starts from the same adapters."""
    inject_adapter_in_model = require_peft().inject_adapter_in_model
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER)
    except ValueError as err:  # peft's "Target modules ... not found in the base model"
        raise ValueError(f"{KEY}.target_modules: {err}") from err
    for name, param in model.named_parameters():
        adapter = is_adapter_key(name)
        param.requires_grad_(adapter)
        if adapter and param.dtype != torch.float32:  # peft gives adapters the base layer's dtype
            param.data = param.data.float()
    return model


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The model's adapted layers (peft ``LoraLayer``) by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds adapters (without importing peft when it cannot)."""
    return any(name.rpartition(".")[2] in ("lora_A", "lora_embedding_A") for name, _ in model.named_modules())


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key (or parameter name) is an adapter weight."""
    return any(part in ADAPTER_LAYERS for part in key.split("."))


def _hf_name(key: str) -> str:
    """A base weight's key in the Hugging Face model's own naming (peft's ``.base_layer`` segment dropped)."""
    return key.replace(".base_layer.", ".")


def base_state_items(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The base model's weights as loaded (unmerged) in its own names: the adapters left out."""
    for key, value in model.state_dict().items():
        if not is_adapter_key(key):
            yield _hf_name(key), value


def hf_state_items(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The model's weights in the base model's own names, each adapted layer's weight merged (``W + scale * B @ A``,
    peft's ``get_delta_weight``, in the adapters' fp32; a half base is widened for the sum), one tensor at a time;
    a model without adapters: its ``state_dict`` as is."""
    layers = lora_layers(model) if has_lora(model) else {}
    if not layers:
        yield from model.state_dict().items()
        return
    merged = {f"{name}.base_layer.weight": layer for name, layer in layers.items()}
    for key, value in model.state_dict().items():
        if is_adapter_key(key):
            continue
        layer = merged.get(key)
        if layer is not None:
            with torch.no_grad():
                delta = layer.get_delta_weight(ADAPTER)
                value = value.to(torch.promote_types(value.dtype, delta.dtype)) + delta
        yield _hf_name(key), value


def base_fingerprint(items: Iterator[tuple[str, Tensor]]) -> str:
    """SHA-256 (hex) of a model's weights: each tensor's name, dtype, shape and bytes, in the given order (the
    state dict's: deterministic for one architecture)."""
    digest = hashlib.sha256()
    for name, tensor in items:
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its base (the reference policy of a LoRA run): every adapter off, then on again (peft's
    ``enable_adapters``, which also restores the adapters' ``requires_grad``)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapters' weights (state-dict keys of ``model``, peft's adapter name included), on CPU."""
    return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items() if is_adapter_key(k)}


def peft_adapter_tensors(adapters: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapters in a PEFT adapter file's names (``base_model.model.<name>.lora_A.weight``: what
    ``PeftModel.save_pretrained`` writes); ``adapters``: :func:`adapter_state`'s keys."""
    return {"base_model.model." + k.replace(f".{ADAPTER}.", ".").removesuffix(f".{ADAPTER}"): v.contiguous()
            for k, v in adapters.items()}


def save_peft_adapter(out_dir: str, settings: LoRASettings, adapters: Mapping[str, Tensor],
                      base_model_name_or_path: str | None = None) -> None:
    """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``): what
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads onto the base model."""
    from safetensors.torch import save_file

    config = settings.peft_config()
    config.base_model_name_or_path = base_model_name_or_path
    config.save_pretrained(out_dir)
    save_file(peft_adapter_tensors(adapters), f"{out_dir}/adapter_model.safetensors", metadata={"format": "pt"})


# -- the checkpoint's record and what an export takes out of a bundle -----------------------------------------
RECORD = "screl_lora"
"""The Lightning checkpoint's key of a LoRA run's record: the settings, the base spec and its weights' SHA-256
(its ``state_dict`` then holds the adapters only, under ``model.``)."""


class BaseMismatchError(ValueError):
    """The adapters were trained on another base model than the one they are loaded onto."""


def lora_record(settings: LoRASettings, base_spec: str, base_sha256: str) -> dict[str, Any]:
    return {"format": 1, "settings": settings.to_json(), "base_spec": base_spec, "base_sha256": base_sha256}


def settings_of(record: Mapping[str, Any]) -> LoRASettings:
    """The settings a checkpoint's record holds."""
    fields = dict(record["settings"])
    if isinstance(fields.get("target_modules"), list):
        fields["target_modules"] = tuple(fields["target_modules"])
    return LoRASettings(**fields)


def check_base(record: Mapping[str, Any], base_spec: str, base_sha256: str) -> None:
    """Refuse adapters trained on another base, naming both (spec and weights' SHA-256)."""
    if record.get("base_sha256") == base_sha256:
        return
    raise BaseMismatchError(
        f"{KEY}: the checkpoint's adapters were trained on another base model: {record.get('base_spec')} (weights "
        f"sha256 {str(record.get('base_sha256'))[:16]}), and this run's base is {base_spec} (weights sha256 "
        f"{base_sha256[:16]}). Resume with the policy spec the adapters were trained on, or start a fresh run in "
        "a new checkpointing.checkpoint_dir")


def bundle_adapters(checkpoint: Mapping[str, Any]) -> tuple[LoRASettings, dict[str, Tensor]] | None:
    """A Lightning checkpoint's LoRA settings and adapters (keys relative to the Hugging Face model, as
    :func:`adapter_state` gives them); None for a full fine-tune's checkpoint."""
    record = checkpoint.get(RECORD)
    if record is None:
        return None
    state = checkpoint.get("state_dict") or {}
    adapters = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.") and is_adapter_key(k)}
    return settings_of(record), adapters


def merged_policy_weights(checkpoint: Mapping[str, Any], spec: Any) -> dict[str, Tensor]:
    """The merged policy of a LoRA run's checkpoint, in the base model's own Hugging Face names (what
    ``screl export`` writes): the base built from ``spec`` (the run's policy spec), checked against the record's
    fingerprint (:class:`BaseMismatchError` naming both), the adapters loaded onto it, then merged."""
    found = bundle_adapters(checkpoint)
    if found is None:
        raise ValueError(f"the checkpoint holds no LoRA adapters (no {RECORD!r} record): its state_dict is the "
                         "full policy")
    settings, adapters = found
    model = spec.build_model()
    check_base(checkpoint[RECORD], repr(spec), base_fingerprint(iter(model.state_dict().items())))
    apply_lora(model, settings)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    absent = [k for k in missing if is_adapter_key(k)]
    if absent or unexpected:
        raise ValueError(f"the checkpoint's adapters do not fit {KEY}={settings.to_json()}: missing {absent[:3]}, "
                         f"unexpected {list(unexpected)[:3]}")
    return {k: v.detach().to("cpu") for k, v in hf_state_items(model)}
