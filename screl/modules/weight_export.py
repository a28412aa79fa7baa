"""The policy's weights as the generation engines load them (what a refit sends), for every :class:`~screl.modules.policy_gradient.PolicyGradientModule`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from screl.modules.compute import PolicyCompute
from screl.rollout.engines.buckets import merge_buckets


class WeightExport:
    """Export of ``self.model`` (a Hugging Face policy, or under ``MegatronStrategy`` this rank's shard) through the
    module's compute adapter ``self.compute``, cast to ``self.engine_dtype``."""

    model: Any
    engine_dtype: torch.dtype
    compute: PolicyCompute

    def export_weights(self, naming: str = "hf") -> dict[str, Tensor]:
        """Full policy weights in the generation engine's naming, on CPU, in one dict: Hugging Face's (``hf``), or
        Megatron's own in the tensor-parallel-size-1 layout (``megatron``: the Megatron engine's; only under
        ``MegatronStrategy``).

        Under ``MegatronStrategy`` a collective that gathers the shards: call it on every rank.
        """
        return merge_buckets(self.iter_export_weights(naming=naming))

    def iter_export_weights(self, bucket_bytes: int = 64 * 2**20, naming: str = "hf") -> Iterator[dict[str, Tensor]]:
        """The same weights bucket by bucket (what a refit sends): one CPU bucket of about ``bucket_bytes`` at a
        time, so exporting never holds a second full copy. Under ``MegatronStrategy`` its own bucketed export
        (``export_bucket_bytes``), a collective every rank must consume to the end."""
        yield from self._export_module(None, bucket_bytes, naming)

    def _export_module(self, path: str | None, bucket_bytes: int, naming: str) -> Iterator[dict[str, Tensor]]:
        if naming not in ("hf", "megatron"):
            raise ValueError(f"export naming {naming!r}: expected 'hf' or 'megatron'")
        yield from self.compute.export_buckets(self.model, path, bucket_bytes, naming, self._engine_cast)

    def _engine_cast(self, tensor: Tensor) -> Tensor:
        """A master weight as the engine holds it: floating tensors in the engine's dtype (bf16 for a bf16 spec),
        others as they are."""
        if tensor.is_floating_point() and tensor.dtype != self.engine_dtype:
            return tensor.to(self.engine_dtype)
        return tensor
