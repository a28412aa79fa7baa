"""``MegatronValueModel``: a value model (PPO's critic) on a Megatron ``GPTModel`` trunk.

The trunk is a ``GPTModel`` shard built like a policy, on the last pipeline stage, so its decoder ends in
the final norm. Its forward runs with the output layer bypassed: megatron-core's ``GPTModel`` returns the
decoder's output when ``post_process`` is off (what a non-last pipeline stage hands on), so switching it off
for the call gives the final-normed hidden states ``[len, rows, hidden]``, the same on every
tensor-parallel rank (no sequence parallelism). These are the Hugging Face model's ``hidden_states[-1]``.

The value head is a plain ``nn.Linear(hidden, 1)``, replicated on every rank. Its input and the gradient
that reaches it are the same on every tensor-parallel rank, so its gradient is too. The trunk's gradient then
flows back as it does from Megatron's own output layer, whose backward all-reduces the partial gradients of
the hidden states over tensor parallelism. Here every rank already holds the full gradient. Trunk and head
are one ``MegatronModule``, so ``MegatronStrategy`` wraps both in Megatron's DDP, as it wraps the policy: the
head's gradient sits in the same buffers, is reduced over data parallel, and the tensor-parallel-aware norm
counts it once (a replicated parameter counts on tensor-parallel rank 0 only).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from screl.strategies.weights import export_weights, load_hf_weights
from torch import Tensor, nn

__all__ = ["MegatronValueModel"]


class MegatronValueModel(MegatronModule):
    """A ``GPTModel`` trunk whose final hidden states feed a replicated scalar head.

    Args:
        trunk: This rank's ``GPTModel`` shard, built with ``post_process=True`` (the last pipeline stage).
            Its output layer goes unused and is frozen (an untied one would otherwise train on zero gradients).
        head: The value head, ``nn.Linear(hidden_size, 1)``, the same on every rank.
    """

    def __init__(self, trunk: GPTModel, head: nn.Linear) -> None:
        super().__init__(config=trunk.config)
        if not trunk.post_process:
            raise ValueError("MegatronValueModel: the trunk must be the last pipeline stage (post_process=True).")
        if trunk.config.sequence_parallel:
            raise ValueError(
                "MegatronValueModel: sequence_parallel is not supported (the head would see only this rank's "
                "part of the sequence). Use sequence_parallel=False."
            )
        self.trunk = trunk
        self.head = head
        output_layer = getattr(trunk, "output_layer", None)
        if output_layer is not None:
            output_layer.requires_grad_(False)

    @classmethod
    def from_hf(cls, trunk: GPTModel, hf_state: Mapping[str, Tensor], head: nn.Linear) -> MegatronValueModel:
        """Load a Hugging Face Qwen2/Llama state dict (the critic's trunk) into ``trunk``, then wrap it."""
        load_hf_weights(trunk, hf_state)
        return cls(trunk, head)

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """``[len, rows, hidden]``: the trunk's forward up to and including the final norm."""
        self.trunk.post_process = False
        try:
            hidden: Tensor = self.trunk(input_ids, position_ids, attention_mask)
        finally:
            self.trunk.post_process = True
        return hidden

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """``[rows, len]`` values, float32 (the layout of ``screl.models.ValueModel``)."""
        hidden = self.hidden_states(input_ids, position_ids, attention_mask).transpose(0, 1)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def export_hf_state(self) -> dict[str, Tensor]:
        """Full weights, on CPU, named as ``screl.models.ValueModel``'s state dict (``trunk.model.layers...``,
        ``head.weight``). Gathers the trunk's shards: a collective, call it on every rank."""
        out = {f"trunk.{k}": v for k, v in export_weights(self.trunk).items()}
        out.update({f"head.{k}": v.detach().to("cpu").clone() for k, v in self.head.state_dict().items()})
        return out
