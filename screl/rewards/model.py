"""``RewardModel``: a sequence classifier (``AutoModelForSequenceClassification``, one label) as a reward function,
scoring in a Ray actor of its own, batched, on a GPU when given one.

Each sample is rendered as TRL renders it for a reward model: ``prompt + completion`` (text), or for a
conversational prompt the reward model's chat template applied to ``prompt_messages + [assistant completion]``;
tokenized without special tokens, right-padded (a tokenizer without a pad token pads with its EOS token), and scored
by the logit of the one label at the last real token.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from screl.rewards.funcs import RewardFuncError


def check_num_labels(num_labels: int, path: str) -> None:
    """A reward model scores with one label; a classifier of several is refused."""
    if num_labels != 1:
        raise RewardFuncError(f"reward model {path!r} has num_labels={num_labels}: a reward model gives one score "
                              "per sample (AutoModelForSequenceClassification with num_labels=1)")


class RewardModelScorer:
    """The actor's body: the model and its tokenizer, loaded once on ``device``."""

    def __init__(self, path: str, device: str = "cpu", dtype: str = "float32", max_length: int | None = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        check_num_labels(int(model.config.num_labels), path)
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(device).eval()
        self.device, self.max_length = device, max_length

    def render(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """The texts the model scores (see the module docstring)."""
        texts = []
        for p, c in zip(prompts, completions, strict=True):
            if isinstance(p, list):
                texts.append(str(self.tokenizer.apply_chat_template(p + list(c), tokenize=False)))
            else:
                texts.append(str(p) + str(c))
        return texts

    def score(self, prompts: list[Any], completions: list[Any], batch_size: int) -> list[float]:
        """One score per sample, ``batch_size`` samples per forward pass."""
        import torch

        texts, out = self.render(prompts, completions), list[float]()
        for start in range(0, len(texts), batch_size):
            enc = self.tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                                 add_special_tokens=False, truncation=self.max_length is not None,
                                 max_length=self.max_length)
            with torch.inference_mode():
                logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
            out.extend(float(v) for v in logits[:, 0].float().cpu())
        return out


class RewardModel:
    """A local reward model as one of ``reward_funcs`` (TRL's signature; ``None`` never returned).

    The actor starts on first use, named after the model and its placement, so every process that scores with the
    same model shares it; the object pickles without it (a rollout worker finds or starts it).

    Args:
        path: A hub id (resolved into the Hugging Face cache where this object is built, the driver) or a local
            directory with the model (``num_labels=1``) and its tokenizer.
        revision: The hub revision of a hub id.
        batch_size: Samples per forward pass.
        device: ``"cpu"`` or ``"cuda"`` (the GPU Ray gives the actor).
        num_gpus: GPUs the actor asks Ray for (default: 1 with a CUDA device, else 0; a fraction shares one).
        num_cpus: CPUs the actor asks Ray for.
        name: The metrics name (default: the directory's name, as TRL names a reward model).
        dtype: The model's dtype (a ``torch`` attribute name).
        max_length: Truncate each text to this many tokens (default: no truncation, as TRL).
    """

    def __init__(self, path: str, batch_size: int = 8, device: str = "cpu", num_gpus: float | None = None,
                 num_cpus: float = 1.0, name: str | None = None, dtype: str = "float32",
                 max_length: int | None = None, revision: str | None = None) -> None:
        from transformers import AutoConfig

        from screl.models.hub import resolve_model_dir

        if batch_size < 1:
            raise ValueError(f"RewardModel.batch_size must be >= 1, got {batch_size}")
        self.num_gpus = (1.0 if device.startswith("cuda") else 0.0) if num_gpus is None else float(num_gpus)
        if device.startswith("cuda") and self.num_gpus <= 0:
            raise ValueError(f"RewardModel(device={device!r}) needs num_gpus > 0 (Ray places the actor on a GPU)")
        given = path
        path = resolve_model_dir(path, owner="RewardModel", revision=revision)
        check_num_labels(int(AutoConfig.from_pretrained(path).num_labels), given)
        self.path, self.batch_size, self.device, self.num_cpus = path, batch_size, device, float(num_cpus)
        self.dtype, self.max_length = dtype, max_length
        self.__name__ = name or os.path.basename(os.path.normpath(given))
        self._actor: Any = None

    @property
    def actor_name(self) -> str:
        key = repr((os.path.abspath(self.path), self.device, self.num_gpus, self.dtype, self.max_length))
        return f"screl-reward-model-{self.__name__}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    def actor(self) -> Any:
        """The scoring actor (found by name, or started)."""
        import ray

        if self._actor is None:
            remote = ray.remote(RewardModelScorer).options(  # type: ignore[attr-defined]
                name=self.actor_name, get_if_exists=True, num_cpus=self.num_cpus, num_gpus=self.num_gpus)
            self._actor = remote.remote(self.path, self.device, self.dtype, self.max_length)
        return self._actor

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                 **kwargs: Any) -> list[float]:
        import ray

        try:
            return list(ray.get(self.actor().score.remote(prompts, completions, self.batch_size)))
        except ray.exceptions.RayActorError:  # its owner (another worker) went away: start it again, once
            self._actor = None
            return list(ray.get(self.actor().score.remote(prompts, completions, self.batch_size)))

    def close(self) -> None:
        """Stop the actor this object holds (it also ends with the process that started it)."""
        import ray

        if self._actor is not None:
            ray.kill(self._actor)
            self._actor = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_actor": None}
