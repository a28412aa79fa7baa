"""The exported folder: what ``AutoModelForCausalLM.from_pretrained`` (``AutoModelForImageTextToText`` for a
vision-language policy) and vLLM load as it is.

``DIR/`` holds ``model.safetensors`` (sharded above ``max_shard_size``, with ``model.safetensors.index.json``),
``config.json``, ``generation_config.json`` (the run's stop tokens and sampling settings), the tokenizer with its
chat template (a vision-language policy's processor too) and ``screl_export.json`` (where it came from). A PPO
critic goes to ``DIR/critic/``: its trunk as a Hugging Face model (its own tokenizer beside it) and the value head
as ``value_head.safetensors`` (``weight [1, hidden]``, ``bias [1]``: value = head(trunk's last hidden state)).

The folder is written under ``DIR.tmp-<id>`` and renamed into place, so a failed export leaves no half folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from screl.export.record import ExportError, spec_from_dict
from screl.models.lora import LoRASettings, save_peft_adapter
from screl.models.spec import PolicySpec

log = logging.getLogger(__name__)

__all__ = ["DTYPES", "EXPORT_INFO", "write_adapter_folder", "write_hf_folder"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}
EXPORT_INFO = "screl_export.json"
CRITIC_DIR = "critic"
VALUE_HEAD = "value_head.safetensors"


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ExportError(f"dtype {name!r}: expected bf16 or fp32")
    return DTYPES[name]


def _tokenizer(spec: PolicySpec, what: str) -> Any:
    """The spec's tokenizer; a missing one is an error naming where it was looked for."""
    where = getattr(spec, "tokenizer_path", None) or getattr(spec, "path", None) or repr(spec)
    fix = "Make that folder (or hub id, in the Hugging Face cache) available here: the export writes the run's " \
          "tokenizer beside the weights"
    try:
        tokenizer = spec.build_tokenizer()
    except (OSError, ValueError) as err:
        raise ExportError(f"{what}: the tokenizer of {type(spec).__name__} could not be loaded from {where!r} "
                          f"({type(err).__name__}: {err}). {fix}") from err
    if len(tokenizer) < 2:  # transformers makes an empty one from a folder without tokenizer files
        raise ExportError(f"{what}: the tokenizer of {type(spec).__name__} could not be loaded from {where!r} (no "
                          f"tokenizer files there: an empty vocabulary). {fix}")
    return tokenizer


def load_weights(model: torch.nn.Module, weights: Mapping[str, Tensor], what: str) -> None:
    """Copy ``weights`` (Hugging Face names) into ``model``: every key must be the model's, with its shape, and every
    parameter of the model must be given (a tied one through the tensor it is tied to)."""
    own = model.state_dict()
    unexpected = sorted(set(weights) - set(own))
    wrong = sorted(k for k in weights if k in own and tuple(own[k].shape) != tuple(weights[k].shape))
    loaded = {own[k].data_ptr() for k in weights if k in own}
    missing = sorted(k for k in own if k not in weights and own[k].data_ptr() not in loaded)
    if unexpected or wrong or missing:
        raise ExportError(f"{what}: the saved weights do not fit the spec's model (unexpected {unexpected[:4]}, "
                          f"other shapes {wrong[:4]}, missing {missing[:4]}): was the bundle written by a run of "
                          "this policy spec?")
    model.load_state_dict(dict(weights), strict=False)


def generation_config(model: Any, tokenizer: Any, generation: Mapping[str, Any]) -> Any:
    """The model's generation config with the run's stop tokens (the one rule every screl engine stops by:
    ``screl.rollout.engines.stop_tokens``) and its sampling settings (``generation``)."""
    from transformers import GenerationConfig

    from screl.rollout.engines.stop_tokens import stop_tokens

    base = getattr(model, "generation_config", None)
    gc = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig()
    stops = sorted(stop_tokens(tokenizer, base, getattr(model, "config", None)).ids)
    if stops:
        gc.eos_token_id = stops if len(stops) > 1 else stops[0]
    if tokenizer.pad_token_id is not None:
        gc.pad_token_id = int(tokenizer.pad_token_id)
    if generation:
        gc.do_sample = True
        gc.temperature = float(generation.get("temperature", 1.0))
        gc.top_p = float(generation.get("top_p", 1.0))
        gc.top_k = int(generation.get("top_k") or 0)  # 0: off, as the run had it (Hugging Face and vLLM alike)
    return gc


def _save_policy(spec: PolicySpec, weights: Mapping[str, Tensor], out: str, dtype: torch.dtype,
                 generation: Mapping[str, Any], max_shard_size: str | int) -> str | None:
    """The policy's folder; returns the tokenizer round trip's note (None: ``AutoTokenizer`` loads it as it was)."""
    tokenizer = _tokenizer(spec, "policy")
    model: Any = spec.build_model()
    load_weights(model, weights, "policy")
    model.to(dtype)
    model.generation_config = generation_config(model, tokenizer, generation)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    if spec.is_vlm:
        _save_processor(spec, tokenizer, out)
    return tokenizer_round_trip(tokenizer, out)


TOKENIZER_PROBE = "Count the a's in banana: 3, then <eos>."


def tokenizer_round_trip(tokenizer: Any, out: str) -> str | None:
    """Check that ``AutoTokenizer.from_pretrained(out)`` tokenizes as the run did; None when it does, else a note
    naming the class that does (transformers picks a tokenizer class by the model type for some families, e.g. a
    Qwen2 config with screl's in-memory character tokenizer)."""
    from transformers import AutoTokenizer

    want = list(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])
    loaded = AutoTokenizer.from_pretrained(out)
    if list(loaded(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]) == want:
        return None
    note = (f"AutoTokenizer loads {type(loaded).__name__} from this folder, which tokenizes differently from the run's "
            f"{type(tokenizer).__name__}: load the tokenizer with transformers.PreTrainedTokenizerFast.from_pretrained")
    log.warning("screl export: %s (%s)", note, out)
    return note


def _save_processor(spec: Any, tokenizer: Any, out: str) -> None:
    """A vision-language policy's processor: the image processor with the tokenizer, as ``AutoProcessor`` loads."""
    processor = spec.build_processor()
    if hasattr(processor, "tokenizer"):  # a whole processor already
        processor.save_pretrained(out)
        return
    try:
        from transformers import Qwen2VLProcessor

        Qwen2VLProcessor(image_processor=processor, tokenizer=tokenizer,
                         chat_template=getattr(tokenizer, "chat_template", None)).save_pretrained(out)
    except (ImportError, TypeError, ValueError, AttributeError):  # no video processor here, or another layout:
        # the image processor alone (``AutoImageProcessor``), beside the tokenizer
        processor.save_pretrained(out)


def _save_critic(spec: PolicySpec, weights: Mapping[str, Tensor], out: str, dtype: torch.dtype,
                 max_shard_size: str | int) -> None:
    from safetensors.torch import save_file

    trunk: Any = spec.build_model()
    load_weights(trunk, {k[len("trunk."):]: v for k, v in weights.items() if k.startswith("trunk.")}, "critic trunk")
    head = {k[len("head."):]: v for k, v in weights.items() if k.startswith("head.")}
    if sorted(head) != ["bias", "weight"]:
        raise ExportError(f"critic: expected the value head's weight and bias, got {sorted(head)}")
    trunk.to(dtype).save_pretrained(out, max_shard_size=max_shard_size)
    _tokenizer(spec, "critic").save_pretrained(out)
    save_file({k: v.detach().to(dtype).contiguous() for k, v in head.items()}, os.path.join(out, VALUE_HEAD))


def write_hf_folder(record: Mapping[str, Any], policy: Mapping[str, Tensor], out_dir: str, *, dtype: str = "bf16",
                    critic: Mapping[str, Tensor] | None = None, max_shard_size: str | int = "5GB",
                    provenance: Mapping[str, Any] | None = None) -> str:
    """Write the folder for ``record``'s policy with ``policy``'s weights (Hugging Face names) at ``out_dir``, and
    ``critic`` (``ValueModel``'s names) under ``critic/`` when given. Returns ``out_dir``."""
    torch_dtype = _dtype(dtype)
    spec = spec_from_dict(record.get("policy"), "the run's policy spec (model.init_args.policy)")

    def fill(tmp: str) -> dict[str, Any]:
        with torch.no_grad():
            note = _save_policy(spec, policy, tmp, torch_dtype, record.get("generation") or {}, max_shard_size)
            if critic:
                value = spec_from_dict(record.get("value"), "the run's critic spec (model.init_args.value)")
                _save_critic(value, critic, os.path.join(tmp, CRITIC_DIR), torch_dtype, max_shard_size)
        return {"policy": record.get("policy"), "value": record.get("value") if critic else None,
                "generation": record.get("generation"), "dtype": dtype, **dict(provenance or {}),
                **({"tokenizer_note": note} if note else {})}

    return _write_atomically(out_dir, fill)


def write_adapter_folder(record: Mapping[str, Any], settings: LoRASettings, adapters: Mapping[str, Tensor],
                         out_dir: str, *, dtype: str = "bf16", provenance: Mapping[str, Any] | None = None) -> str:
    """Write a LoRA run's adapters (:func:`screl.models.lora.adapter_state`'s keys) as a PEFT adapter folder at
    ``out_dir`` (``adapter_config.json``, ``adapter_model.safetensors``): what ``peft.PeftModel.from_pretrained(base,
    out_dir)`` loads onto the base the policy spec builds. Returns ``out_dir``."""
    torch_dtype = _dtype(dtype)
    spec = spec_from_dict(record.get("policy"), "the run's policy spec (model.init_args.policy)")
    base = getattr(spec, "path", None)

    def fill(tmp: str) -> dict[str, Any]:
        save_peft_adapter(tmp, settings, {k: v.detach().to(torch_dtype) for k, v in adapters.items()},
                          base if isinstance(base, str) else None)
        return {"policy": record.get("policy"), "form": "adapter", "lora": settings.to_json(), "dtype": dtype,
                **dict(provenance or {})}

    return _write_atomically(out_dir, fill)


def _write_atomically(out_dir: str, fill: Callable[[str], Mapping[str, Any]]) -> str:
    """``fill(tmp)`` writes the folder under ``DIR.tmp-<id>`` and returns ``screl_export.json``'s content; the folder
    then replaces ``out_dir`` (a failure leaves nothing half written)."""
    _check_target(out_dir)
    tmp = f"{out_dir.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        info = fill(tmp)
        with open(os.path.join(tmp, EXPORT_INFO), "w") as f:
            json.dump(info, f, indent=2, sort_keys=True, default=str)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _check_target(out_dir: str) -> None:
    """Write into an empty or missing folder, or over an earlier export (it holds ``screl_export.json``)."""
    if os.path.isfile(out_dir):
        raise ExportError(f"--out {out_dir}: a file is there; name a folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, EXPORT_INFO)):
        raise ExportError(f"--out {out_dir}: the folder holds other files (not an earlier screl export); name an "
                          "empty or new folder")
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
