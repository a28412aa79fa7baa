"""GPU check for PPO's ``offload_optimizer_for_logprob`` (one CUDA GPU, under a minute; needs CUDA).

Builds ``screl.PPO`` on the ``small`` tiny-model scale on ``cuda:0``, runs one policy update so AdamW has
state on the device, then runs the value stage with the offload on and off, and prints the CUDA memory
allocated before, during (the peak inside the value stage) and after. With the offload the optimizer's state
(two moments per parameter) leaves the device for the value stage and comes back: the during-figure drops by
about ``2 x 4 bytes x policy parameters``. Exit status 0 when the drop is at least 90% of that and the state is
back on the device afterwards.

    python examples/gpu/ppo_offload_check.py
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _measure(offload: bool) -> tuple[int, int, int, int, bool]:
    from screl.algos import ClippedPGLoss
    from screl.models import TinyCausalLM
    from screl.modules.ppo import PPO

    spec = TinyCausalLM(scale="small")
    model = PPO(policy=spec, value=spec, loss_fn=ClippedPGLoss(), offload_optimizer_for_logprob=offload,
                algo={"num_prompts_per_step": 4, "num_generations_per_prompt": 2}).to("cuda")
    opt = torch.optim.AdamW(model.model.parameters(), lr=1e-4)
    ids = torch.randint(4, 40, (8, 48), device="cuda")
    model.model(input_ids=ids).logits.float().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)

    class _Opt:
        optimizer = opt

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model._offload(_Opt(), "cpu")  # type: ignore[arg-type]
    with torch.no_grad():
        model.critic.token_values(ids, torch.ones_like(ids))
    during = torch.cuda.max_memory_allocated()
    model._offload(_Opt(), torch.device("cuda"))  # type: ignore[arg-type]
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    back = all(v.is_cuda for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return before, during, after, state_bytes, back


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows: dict[str, Any] = {}
    for offload in (False, True):
        rows["offload" if offload else "keep"] = _measure(offload)
        torch.cuda.empty_cache()
    for name, (before, during, after, state, back) in rows.items():
        print(f"{name:8s} before {before / 2**20:8.1f} MiB  value-stage peak {during / 2**20:8.1f} MiB  "
              f"after {after / 2**20:8.1f} MiB  (optimizer state {state / 2**20:.1f} MiB, on device after: {back})")
    drop = rows["keep"][1] - rows["offload"][1]
    state = rows["offload"][3]
    print(f"value-stage peak drop {drop / 2**20:.1f} MiB of {state / 2**20:.1f} MiB optimizer state")
    ok = drop >= 0.9 * state and rows["offload"][4]
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
