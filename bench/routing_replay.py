#!/usr/bin/env python
"""Rollout routing replay (R3) on a mixture-of-experts policy: the engine/trainer logprob mismatch with and without
it, and a short training run each way.

**Mismatch.** screl's torch engine decodes a tiny Qwen3-MoE in bf16 and records the experts it routed each token to;
the trainer recomputes the completions' logprobs in fp32 (the train-inference mismatch R3 exists for), once with its
own routing and once replaying the engine's. Figures: mean and max |engine logprob - trainer logprob| each way, the
share of (token, layer) pairs whose experts differ without replay, and ``mean_mismatch_reduction`` (without / with).
Two models:

- ``default``: ``TinyMoECausalLM()`` as ``configs/grpo_moe_tiny.yaml`` builds it (8 experts, top-2, 2 layers,
  random init): routing flips are rare and its experts are near-copies of each other, so bf16 rounding dominates;
- ``specialized``: 32 experts, top-2, 4 layers, the experts' weights scaled x20 and the router drawn at std 0.02, so
  that, as in a trained MoE, experts differ and many tokens sit near a routing tie;
- ``qwen3_like``: the routing of the MoE families R3 is used on (Qwen3-MoE: 128 experts, top-8; Qwen2-MoE-57B: 64,
  top-8): 64 experts, top-8, 4 layers, experts x8, router std 0.02. With eight experts chosen per token, a tie at
  the eighth place is common, so bf16 rounding flips a routing decision far more often than at top-2. The target is
  read here; the reduction depends on the routing, and the top-2 rows are there to show it.

**Training.** ``configs/grpo_moe_tiny.yaml`` for ``--steps`` steps with and without ``routing_replay`` (each a
``screl fit`` in its own process): reward, ``train/logprob_mismatch``, and the IS weights' statistics per step.

    python bench/routing_replay.py                  # ~4 min here; writes bench/results/routing_replay.json
    python bench/routing_replay.py --skip-training  # the mismatch only
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import machine_info, print_table, write_result  # noqa: E402

TARGET = 5.0
MODELS: dict[str, dict[str, Any]] = {
    "default": {"spec": {"num_experts": 8, "top_k": 2}, "expert_scale": 1.0, "router_std": None},
    "specialized": {"spec": {"num_experts": 32, "top_k": 2, "num_layers": 4}, "expert_scale": 20.0,
                    "router_std": 0.02},
    "qwen3_like": {"spec": {"num_experts": 64, "top_k": 8, "num_layers": 4}, "expert_scale": 8.0, "router_std": 0.02},
}
TARGET_MODEL = "qwen3_like"


def trainer_model(name: str) -> tuple[Any, torch.nn.Module]:
    """The fp32 model of ``MODELS[name]`` (its spec and weights)."""
    from screl.models.moe import TinyMoECausalLM, moe_routers

    setting = MODELS[name]
    spec = TinyMoECausalLM(**setting["spec"])
    model = spec.build_model().eval()
    with torch.no_grad():
        if setting["router_std"] is not None:
            g = torch.Generator().manual_seed(5)
            for router in moe_routers(model):
                router.weight.normal_(0.0, setting["router_std"], generator=g)
        for pname, p in model.named_parameters():
            if "experts" in pname:
                p.mul_(setting["expert_scale"])
    return spec, model


def mismatch(name: str, prompts: int, tokens: int) -> dict[str, Any]:
    from screl.models.moe import TinyMoECausalLM, record_routing, replay_rows
    from screl.rollout import GenerationRequest, SamplingParams
    from screl.rollout.engines.torch_engine import TorchGenerationEngine

    spec, trainer = trainer_model(name)
    engine = TorchGenerationEngine(TinyMoECausalLM(**MODELS[name]["spec"], dtype="bfloat16"), decode="hf",
                                   record_routing=True, seed=0)
    engine.update_weights({k: v.to(torch.bfloat16) for k, v in trainer.state_dict().items()}, 0)
    g = torch.Generator().manual_seed(0)
    requests = [GenerationRequest(f"r{i}", torch.randint(3, 40, (int(torch.randint(3, 12, (1,), generator=g)),),
                                                         generator=g).tolist(),
                                  SamplingParams(max_new_tokens=tokens, seed=i)) for i in range(prompts)]
    t0 = time.perf_counter()
    results = engine.generate(requests)
    gen_s = time.perf_counter() - t0
    diffs: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    flips: list[torch.Tensor] = []
    for r in results:
        seq = torch.tensor([r.prompt_token_ids + r.token_ids])
        start = len(r.prompt_token_ids) - 1
        engine_lp = torch.tensor(r.logprobs)
        with torch.no_grad():
            with record_routing(trainer) as calls:
                own_logits = trainer(seq).logits[0].float()
            with replay_rows(trainer, r.routing[None].long()):
                replay_logits = trainer(seq).logits[0].float()
        for replay, logits in ((False, own_logits), (True, replay_logits)):
            lp = torch.log_softmax(logits[:-1], -1).gather(1, seq[0, 1:, None])[:, 0][start:]
            diffs[replay].append((lp - engine_lp).abs())
        own = torch.stack([c[0] for c in calls], 1)[:-1].sort(-1).values
        flips.append((own != r.routing[:-1].long().sort(-1).values).any(-1).flatten().float())
    without, with_ = torch.cat(diffs[False]), torch.cat(diffs[True])
    return {
        "model": MODELS[name], "prompts": prompts, "completion_tokens": int(without.numel()),
        "generation_s": gen_s,
        "mean_mismatch_without": float(without.mean()), "max_mismatch_without": float(without.max()),
        "mean_mismatch_with": float(with_.mean()), "max_mismatch_with": float(with_.max()),
        "routing_differs_share": float(torch.cat(flips).mean()),
        "mean_mismatch_reduction": float(without.mean() / with_.mean()),
    }


def training(replay: bool, steps: int, work: Path) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_moe_tiny.yaml").read_text())
    cfg["model"]["init_args"]["routing_replay"] = replay
    cfg["trainer"].update(max_steps=steps, default_root_dir=str(work), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["grpo"]["max_num_steps"] = steps
    path = work / "config.yaml"
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "screl.cli", "fit", "--config", str(path)], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"screl fit (routing_replay={replay}) failed:\n{proc.stderr[-3000:]}")
    [metrics_path] = sorted(work.rglob("metrics.csv"))[-1:]
    with metrics_path.open() as fh:
        rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(fh)]

    def col(key: str) -> list[float]:
        return [r[key] for r in rows if key in r]

    return {"routing_replay": replay, "steps": steps, "wall_s": time.perf_counter() - t0, "reward": col("reward"),
            "logprob_mismatch": col("train/logprob_mismatch"), "is_weight_max": col("train/is_weight_max"),
            "is_weight_min": col("train/is_weight_min"), "is_oob_fraction": col("train/is_oob_fraction")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(), "target": TARGET}
    rows = []
    for name in MODELS:
        out[name] = figures = mismatch(name, args.prompts, args.tokens)
        rows.append([name, f"{figures['mean_mismatch_without']:.5f}", f"{figures['mean_mismatch_with']:.5f}",
                     f"{figures['max_mismatch_without']:.4f}", f"{figures['max_mismatch_with']:.4f}",
                     f"{figures['routing_differs_share']:.3f}", f"{figures['mean_mismatch_reduction']:.1f}x"])
    print_table(["model", "mean w/o", "mean with", "max w/o", "max with", "routing differs", "reduction"], rows,
                "engine (bf16) vs trainer (fp32) logprobs, with and without routing replay")
    out["target_model"] = TARGET_MODEL
    out["mean_mismatch_reduction"] = out[TARGET_MODEL]["mean_mismatch_reduction"]
    if not args.skip_training:
        with tempfile.TemporaryDirectory(prefix="screl-r3-") as tmp:
            out["training"] = {str(replay): training(replay, args.steps, Path(tmp) / str(replay))
                               for replay in (True, False)}
        for replay, run in out["training"].items():
            print(f"training routing_replay={replay}: reward {run['reward'][0]:.3f} -> {run['reward'][-1]:.3f}, "
                  f"IS weight max (mean over steps) {sum(run['is_weight_max']) / len(run['is_weight_max']):.3f}, "
                  f"out-of-bounds {sum(run['is_oob_fraction']) / len(run['is_oob_fraction']):.4f}")
    path = write_result("routing_replay", out)
    print(f"mean_mismatch_reduction ({TARGET_MODEL}) {out['mean_mismatch_reduction']:.1f}x (target >= {TARGET}) -> "
          f"{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
