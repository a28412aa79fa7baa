"""Load a local Hugging Face checkpoint directory (model + tokenizer) as a policy spec."""

from __future__ import annotations

import os
from typing import Any

import transformers  # PreTrainedModel (its modeling code) loads on first use: `screl check` resolves this spec without it
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from screl.models.hub import HubFiles
from screl.models.spec import PolicySpec, chat_prompt_token_ids, resolve_dtype


class HFCausalLM(HubFiles, PolicySpec):
    """Any causal LM: a hub id (resolved into the Hugging Face cache once, on the driver) or a local directory saved
    with ``save_pretrained`` (or a GGUF file in it).

    Args:
        path: A hub model id (``Qwen/Qwen2.5-0.5B-Instruct``) or a local checkpoint directory (``config.json`` +
            weights).
        tokenizer_path: Hub id or directory of the tokenizer, when it is not saved next to the model.
        dtype: Parameter dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        attn_implementation: Attention kernel passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, ...);
            ``None`` keeps the transformers default.
        gguf_file: A GGUF file in ``path`` to load (and dequantize) instead of a ``save_pretrained`` checkpoint;
            needs the ``gguf`` package. Dequantizing takes a while in every process: for training, convert once
            with :func:`screl.models.convert_gguf`.
        chat_template: Generate from each prompt wrapped in the tokenizer's chat template (a user turn, then the
            assistant's turn opened), as an instruct model expects; False: from the raw text.
        system_prompt: With ``chat_template``: a system turn first (None: the template's default, if any).
        revision: The hub revision (branch, tag or commit) of a hub id; pin a commit for a reproducible run.
        trust_remote_code: Run the model repository's own Python code (``transformers``' flag); off by default.
        chat_template_kwargs: Extra arguments of the tokenizer's chat template wherever a prompt is rendered with
            it (this spec's ``chat_template``, a ``DatasetTask``'s chats), e.g. ``{enable_thinking: false}`` for
            Qwen3.
    """

    def __init__(
        self,
        path: str,
        tokenizer_path: str | None = None,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        gguf_file: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        resolve_dtype(dtype)
        self.revision, self.trust_remote_code = revision, trust_remote_code
        self.path = path
        self.tokenizer_path = tokenizer_path
        self.dtype = dtype
        self.attn_implementation = attn_implementation
        self.gguf_file = gguf_file
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs else None
        self._resolve_sources("path", "tokenizer_path", gguf_file=gguf_file)

    def prompt_token_ids(self, tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
        if not self.chat_template:
            return super().prompt_token_ids(tokenizer, text)
        return chat_prompt_token_ids(tokenizer, text, self.system_prompt, self.chat_template_kwargs)

    def model_dir(self) -> str | None:
        folder = str(self.__dict__.get("_local_path", self.path))
        return folder if os.path.isdir(folder) else None

    def _kwargs(self) -> dict[str, object]:
        return {"local_files_only": True, "trust_remote_code": self.trust_remote_code}

    def build_config(self) -> Any:
        """The checkpoint's config (``config.json``), or None when ``path`` holds none yet."""
        folder = self.__dict__.get("_local_path", self.path)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            return None
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder, **self._kwargs())

    def build_model(self) -> transformers.PreTrainedModel:
        """Load the model weights from ``path`` on CPU."""
        kwargs: dict[str, object] = {"dtype": resolve_dtype(self.dtype), **self._kwargs()}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        model: transformers.PreTrainedModel = AutoModelForCausalLM.from_pretrained(self.local_dir("path"), **kwargs)
        return model

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        """Load the tokenizer from ``tokenizer_path`` or else ``path``."""
        kwargs = self._kwargs()
        if self.gguf_file is not None and self.tokenizer_path is None:
            kwargs["gguf_file"] = self.gguf_file
        where = self.local_dir("tokenizer_path" if self.tokenizer_path else "path")
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(where, **kwargs)
        return tok
