"""GPU check for PPO's ``offload_optimizer_for_logprob`` (one CUDA GPU, under a minute; needs CUDA).

Builds ``screl.PPO`` on the ``small`` tiny-model scale on ``cuda:0``, runs one policy update so AdamW has
state on the device, then runs the value stage with the offload on and off, and prints the CUDA memory
allocated before, during (the peak inside the value stage) and after. With the offload the optimizer's state
(two moments per parameter) leaves the device for the value stage and comes back: the during-figure drops by
about ``2 x 4 bytes x policy parameters``. Exit status 0 when the drop is at least 90% of that and the state is
back on the device afterwards.

    python examples/gpu/ppo_offload_check.py          # or --cpu: the same calls on CPU, where there is nothing to move

:func:`run_checks` returns the figures (``examples/gpu/acceptance.py`` calls it).
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _measure(offload: bool, device: str = "cuda") -> tuple[int, int, int, int, bool]:
    """(allocated before, value-stage peak, allocated after, optimizer state bytes, state back on ``device``);
    the three memory figures are 0 on CPU."""
    from screl.algos import ClippedPGLoss
    from screl.models import TinyCausalLM
    from screl.modules.ppo import PPO

    spec = TinyCausalLM(scale="small")
    model = PPO(policy=spec, value=spec, loss_fn=ClippedPGLoss(), offload_optimizer_for_logprob=offload,
                algo={"num_prompts_per_step": 4, "num_generations_per_prompt": 2}).to(device)
    opt = torch.optim.AdamW(model.model.parameters(), lr=1e-4)
    ids = torch.randint(4, 40, (8, 48), device=device)
    cuda = device == "cuda"
    model.model(input_ids=ids).logits.float().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)

    class _Opt:
        optimizer = opt

    if cuda:
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if cuda else 0
    model._offload(_Opt(), "cpu")  # type: ignore[arg-type]
    if cuda:  # the peak from here: the value stage's, after the offload (a peak from before it would include the state)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model.critic.token_values(ids, torch.ones_like(ids))
    during = torch.cuda.max_memory_allocated() if cuda else 0
    model._offload(_Opt(), torch.device(device))  # type: ignore[arg-type]
    if cuda:
        torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() if cuda else 0
    back = all(v.device.type == device for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return before, during, after, state_bytes, back


def run_checks(cpu: bool = False) -> dict[str, Any]:
    """Both runs (offload off, on) and the verdict as figures (MiB). On CPU nothing moves (screl's ``_offload``
    is a no-op there): the calls run, the state stays on the CPU, and ``note`` says so."""
    device = "cpu" if cpu else "cuda"
    rows: dict[str, Any] = {}
    for offload in (False, True):
        rows["offload" if offload else "keep"] = _measure(offload, device)
        if not cpu:
            torch.cuda.empty_cache()
    mib = 2**20
    out: dict[str, Any] = {"device": device, "optimizer_state_mib": rows["offload"][3] / mib}
    for name, (before, during, after, _state, back) in rows.items():
        out[name] = {"before_mib": before / mib, "value_stage_peak_mib": during / mib, "after_mib": after / mib,
                     "state_on_device_after": back}
    if cpu:
        out["note"] = "nothing to move: training on CPU, the optimizer state stays where it is"
        out["ok"] = rows["offload"][3] > 0 and rows["offload"][4] and rows["keep"][4]
    else:
        drop = rows["keep"][1] - rows["offload"][1]
        out["value_stage_peak_drop_mib"] = drop / mib
        out["ok"] = drop >= 0.9 * rows["offload"][3] and rows["offload"][4]
    return out


def main() -> int:
    cpu = "--cpu" in sys.argv[1:]
    if not cpu and not torch.cuda.is_available():
        print("needs a CUDA GPU (--cpu runs the same calls on CPU)", file=sys.stderr)
        return 2
    out = run_checks(cpu)
    for name in ("keep", "offload"):
        r = out[name]
        print(f"{name:8s} before {r['before_mib']:8.1f} MiB  value-stage peak {r['value_stage_peak_mib']:8.1f} MiB  "
              f"after {r['after_mib']:8.1f} MiB  (optimizer state {out['optimizer_state_mib']:.1f} MiB, "
              f"on device after: {r['state_on_device_after']})")
    if cpu:
        print(out["note"])
    else:
        print(f"value-stage peak drop {out['value_stage_peak_drop_mib']:.1f} MiB of "
              f"{out['optimizer_state_mib']:.1f} MiB optimizer state")
    print("OK" if out["ok"] else "FAILED")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
