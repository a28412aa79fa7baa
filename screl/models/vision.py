"""Vision-language policies (Qwen2-VL / Qwen2.5-VL family) and the image inputs that travel with their prompts.

:class:`HFVisionLM` loads any Hugging Face image-text-to-text model saved with ``save_pretrained`` (with its
processor); :class:`TinyVisionLM` builds a tiny ``Qwen2VLForConditionalGeneration`` in memory (a 2-layer vision tower,
a 2-layer language model) over the character tokenizer plus the family's vision tokens. No download.

A prompt's images become :class:`VisionInputs` on the rollout worker (:meth:`VisionPolicy.prompt_inputs`): the
processor's ``pixel_values`` (``[patches, channels x temporal x patch x patch]``) and ``image_grid_thw``
(``[images, 3]``), and the prompt's token ids with one ``<|image_pad|>`` per merged patch. Both the engine and the
trainer run the model's own forward on them with the same multimodal rotary positions (:func:`mrope_positions`), so
the engine's logprobs equal the trainer's recompute.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from screl.models.hub import HubFiles
from screl.models.spec import PolicySpec, chat_prompt_token_ids, resolve_dtype
from screl.models.vision_inputs import VisionInputs

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""The Qwen2-VL family's vision tokens: an image is ``<|vision_start|>`` + ``<|image_pad|>`` x n + ``<|vision_end|>``."""


def is_vision_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an image-text-to-text model of the Qwen2-VL layout (a vision tower and ``get_rope_index``)."""
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "visual") and hasattr(inner, "get_rope_index")


def vision_token_ids(config: Any) -> tuple[int, ...]:
    """The ids of the vision tokens a model's config names (never sampled by the engine, never trained)."""
    return tuple(int(getattr(config, k)) for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                                    "video_token_id") if getattr(config, k, None) is not None)


def mrope_positions(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                    image_grid_thw: Tensor) -> tuple[Tensor, Tensor]:
    """The multimodal rotary positions ``[3, rows, length]`` of a (left- or right-) padded batch, and each row's delta
    (``[rows, 1]``: a decoded token at sequence index ``n`` sits at position ``n + delta``)."""
    hf: Any = model
    inner = hf.model
    image_token = int(hf.config.image_token_id)
    types = (input_ids == image_token).int()
    positions, delta = inner.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw,
                                            attention_mask=attention_mask)
    return positions, delta


class VisionPolicy(PolicySpec):
    """A vision-language policy: its prompts carry images (``Task.images``), processed here on the rollout worker."""

    is_vlm = True

    def build_processor(self) -> Any:
        """The image processor (``pixel_values`` and ``image_grid_thw`` from PIL images)."""
        raise NotImplementedError

    def prompt_text(self, text: str, images: int, tokens_per_image: Sequence[int]) -> str:
        """The prompt text with each image's placeholder tokens before the question."""
        pads = "".join(f"{VISION_TOKENS[0]}{VISION_TOKENS[2] * n}{VISION_TOKENS[1]}" for n in tokens_per_image)
        return pads + text

    def prompt_inputs(self, tokenizer: Any, text: str, images: Sequence[Any]) -> tuple[list[int], VisionInputs | None]:
        """The prompt's token ids (with the image placeholders) and its processed images (None without images)."""
        if not images:
            return self.prompt_token_ids(tokenizer, text), None
        processor = self.__dict__.get("_processor")
        if processor is None:
            processor = self.__dict__["_processor"] = self.build_processor()
        out = processor(images=list(images), return_tensors="pt")
        vision = VisionInputs(out["pixel_values"].float(), out["image_grid_thw"].long())
        merge = int(getattr(processor, "merge_size", 2))
        per_image = [int(g.prod()) // merge**2 for g in vision.image_grid_thw]
        return self.prompt_token_ids(tokenizer, self.prompt_text(text, len(images), per_image)), vision

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "_processor"}  # the processor is rebuilt where it is used


class TinyVisionLM(VisionPolicy):
    """A random-init ``Qwen2VLForConditionalGeneration`` over the character tokenizer with the vision tokens.

    Args:
        hidden_size: Language-model width.
        num_layers: Language-model decoder layers.
        vision_depth: Vision-tower blocks.
        vision_embed_dim: Vision-tower width.
        image_size: Images are resized to ``image_size x image_size`` pixels (a multiple of 28): ``(image_size / 14)^2``
            patches, a quarter as many image tokens.
        seed: Weight-init seed (the global RNG is left untouched).
        dtype: Parameter dtype.
    """

    def __init__(self, hidden_size: int = 64, num_layers: int = 2, vision_depth: int = 2, vision_embed_dim: int = 32,
                 image_size: int = 56, seed: int | None = 0, dtype: str = "float32") -> None:
        resolve_dtype(dtype)
        if image_size <= 0 or image_size % 28:
            raise ValueError(f"TinyVisionLM: image_size={image_size} must be a positive multiple of 28 (patch 14 x "
                             "merge 2)")
        self.hidden_size, self.num_layers, self.vision_depth = hidden_size, num_layers, vision_depth
        self.vision_embed_dim, self.image_size, self.seed, self.dtype = vision_embed_dim, image_size, seed, dtype

    def build_tokenizer(self) -> Any:
        from screl.models.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
        return tok

    def build_config(self) -> Any:
        from transformers import Qwen2VLConfig

        tok = self.build_tokenizer()
        start, end, image, video = (int(tok.convert_tokens_to_ids(t)) for t in VISION_TOKENS)
        from screl.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

        ids: dict[str, Any] = dict(pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, bos_token_id=BOS_TOKEN_ID)
        heads = max(1, self.hidden_size // 16)
        head_dim = self.hidden_size // heads
        section = [head_dim // 8, (head_dim // 2 - head_dim // 8) // 2]
        section.append(head_dim // 2 - sum(section))
        text = dict(vocab_size=len(tok), hidden_size=self.hidden_size, intermediate_size=2 * self.hidden_size,
                    num_hidden_layers=self.num_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                    max_position_embeddings=256, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}, **ids)
        vision = dict(depth=self.vision_depth, embed_dim=self.vision_embed_dim, hidden_size=self.hidden_size,
                      num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                             vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True, **ids)

    def build_model(self) -> Any:
        from transformers import Qwen2VLForConditionalGeneration

        cfg = self.build_config()
        with torch.random.fork_rng(devices=[]):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            model = Qwen2VLForConditionalGeneration(cfg)
        return model.to(dtype=resolve_dtype(self.dtype))  # type: ignore[call-arg]  # transformers' wrapped .to

    def build_processor(self) -> Any:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        pixels = self.image_size * self.image_size
        return Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2,
                                        temporal_patch_size=2)


class HFVisionLM(HubFiles, VisionPolicy):
    """Any Hugging Face image-text-to-text model of the Qwen2-VL layout (Qwen2-VL, Qwen2.5-VL) with its processor: a
    hub id (resolved into the Hugging Face cache once, on the driver) or a local directory (``save_pretrained`` of
    the model and of its processor).

    Args:
        path: A hub model id or a local checkpoint directory (``config.json``, weights, tokenizer and preprocessor
            config).
        dtype: Parameter dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        chat_template: Wrap each prompt (image placeholders, then the question) in the tokenizer's chat template.
        min_pixels: The processor's smallest image area (None: the checkpoint's setting).
        max_pixels: The processor's largest image area: fewer patches per image, a smaller row (None: the checkpoint's).
        revision: The hub revision (branch, tag or commit) of a hub id.
        trust_remote_code: Run the model repository's own Python code; off by default.
        system_prompt: With ``chat_template``: a system turn first; the images stay in the user turn, before its
            question.
    """

    def __init__(self, path: str, dtype: str = "float32", chat_template: bool = True, min_pixels: int | None = None,
                 max_pixels: int | None = None, revision: str | None = None, trust_remote_code: bool = False,
                 system_prompt: str | None = None) -> None:
        resolve_dtype(dtype)
        self.path, self.dtype, self.chat_template, self.system_prompt = path, dtype, chat_template, system_prompt
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.revision, self.trust_remote_code = revision, trust_remote_code
        self._resolve_sources("path")

    def _dir(self) -> str:
        return self.local_dir("path")

    def model_dir(self) -> str | None:
        folder = str(self.__dict__.get("_local_path", self.path))
        return folder if os.path.isdir(folder) else None

    def build_config(self) -> Any:
        folder = self.model_dir()
        if folder is None or not os.path.isfile(os.path.join(folder, "config.json")):
            return None
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=self.trust_remote_code)

    def build_model(self) -> Any:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(self._dir(), dtype=resolve_dtype(self.dtype),
                                                            local_files_only=True,
                                                            trust_remote_code=self.trust_remote_code)
        if not is_vision_model(model):
            raise ValueError(f"HFVisionLM: {type(model).__name__} at {self.path!r} is not of the Qwen2-VL layout (a "
                             "vision tower and get_rope_index); only the Qwen2-VL / Qwen2.5-VL family is supported")
        return model

    def build_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._dir(), local_files_only=True,
                                             trust_remote_code=self.trust_remote_code)

    def build_processor(self) -> Any:
        from transformers import AutoImageProcessor

        kwargs: dict[str, Any] = {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels))
                                  if v is not None}
        return AutoImageProcessor.from_pretrained(self._dir(), local_files_only=True, **kwargs)

    def prompt_token_ids(self, tokenizer: Any, text: str) -> list[int]:
        if not self.chat_template:
            return super().prompt_token_ids(tokenizer, text)
        return chat_prompt_token_ids(tokenizer, text, self.system_prompt)
