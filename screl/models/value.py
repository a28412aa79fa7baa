"""``ValueModel``: PPO's critic, a causal LM trunk with a scalar value head.

Built from a :class:`~screl.models.PolicySpec` (the critic may be a different size than the policy, or the
same spec). ``values(input_ids, attention_mask)[b, j]`` estimates the return of the state after position
``j``, aligned like the trainer's token logprobs: position ``j`` is the state before token ``j + 1`` is
emitted, so ``values[:, :-1]`` lines up with a collated chunk's ``token_mask``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from screl.models.spec import PolicySpec


class ValueModel(nn.Module):
    """Trunk (``spec.build_model()``'s hidden states) and a zero-initialised linear value head, so a fresh
    critic predicts 0 everywhere and its first updates do not fight random initial values."""

    def __init__(self, spec: PolicySpec) -> None:
        super().__init__()
        self.spec = spec
        self.trunk = spec.build_model()
        hidden = int(self.trunk.config.hidden_size)
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``[rows, len]`` values, float32."""
        # the trunk's final (normed) hidden states, without its output layer: no [tokens, vocabulary] logits
        hidden = self.trunk.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def token_values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``[rows, len - 1]``: the value of the state before each next token, aligned with ``token_mask``."""
        return self(input_ids, attention_mask)[:, :-1]


def critic_state(module_state: dict[str, torch.Tensor], prefix: str = "critic.") -> dict[str, torch.Tensor]:
    """The critic's weights out of a PPO module's (or a Lightning checkpoint's) ``state_dict``."""
    return {k[len(prefix):]: v for k, v in module_state.items() if k.startswith(prefix)}
