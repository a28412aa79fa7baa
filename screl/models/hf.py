"""Load a local Hugging Face checkpoint directory (model + tokenizer) as a policy spec."""

from __future__ import annotations

import os

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from screl.models.spec import PolicySpec, resolve_dtype


class HFCausalLM(PolicySpec):
    """Any causal LM saved with ``save_pretrained`` in a local directory.

    Args:
        path: Local checkpoint directory (``config.json`` + weights).
        tokenizer_path: Directory of the tokenizer, when it is not saved next to the model.
        dtype: Parameter dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        attn_implementation: Attention kernel passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, ...);
            ``None`` keeps the transformers default.
    """

    def __init__(
        self,
        path: str,
        tokenizer_path: str | None = None,
        dtype: str = "float32",
        attn_implementation: str | None = None,
    ) -> None:
        resolve_dtype(dtype)
        self.path = path
        self.tokenizer_path = tokenizer_path
        self.dtype = dtype
        self.attn_implementation = attn_implementation

    def _require_dir(self, path: str, what: str) -> str:
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"HFCausalLM: {what}={path!r} is not a local directory (no hub downloads)."
            )
        return path

    def build_model(self) -> PreTrainedModel:
        """Load the model weights from ``path`` on CPU."""
        kwargs: dict[str, object] = {"dtype": resolve_dtype(self.dtype), "local_files_only": True}
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            self._require_dir(self.path, "path"), **kwargs
        )
        return model

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        """Load the tokenizer from ``tokenizer_path`` or else ``path``."""
        where = self.tokenizer_path or self.path
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            self._require_dir(where, "tokenizer_path" if self.tokenizer_path else "path"),
            local_files_only=True,
        )
        return tok
