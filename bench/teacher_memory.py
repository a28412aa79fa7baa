#!/usr/bin/env python
"""A distillation teacher's scoring memory at a real vocabulary (issue 50 item 5): one teacher call on 8 x 2048
tokens at vocabulary 151,936, before (one forward through full logits and a full-vocabulary fp32 log-softmax, as
teachers scored until this change) and after (``screl.rollout.teachers.score_sequences``: the trainer's chunked
logprob path, forwards of at most ``teacher_batch_tokens`` padded tokens), each in its own process.

    python bench/teacher_memory.py            # about 2 minutes on 2 cores; merges "teacher_memory" into distill.json

The model: ``bench/memory.py``'s Qwen2 trunk (hidden 256, 2 layers) at vocabulary 151,936, fp32, 2 threads. The call:
``rows`` sequences of 2048 random tokens, the last 1984 a completion. Memory: the peak resident set over the call
(``VmHWM`` after resetting it) less the resident set just before it. ``before`` holds the model's
``[rows, 2048, 151936]`` fp32 logits and the log-softmax of their shifted slice (1.24 GB a row each, and more in
the forward), about 3.5-4 GB a row, so 8 rows need more than this 23 GB machine has: it is measured at 1, 2 and 4
rows and the 8-row figure is the measured per-row slope (1 to 4 rows) carried to 8 rows (``before_8_rows_gb``). ``after`` is measured at 1, 2, 4 and 8 rows, with the sampled estimator's
logprobs and with ``estimator: top_k`` (k = 16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))
from memory import PROMPT, THREADS, VOCAB, _model, _rss_kb, child_json  # noqa: E402

LENGTH = 2048
OUT = REPO / "bench" / "results" / "distill.json"


def _before(model: Any, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
    """How teachers scored before: one right-padded forward, full logits, a full-vocabulary log-softmax."""
    import torch

    ids = torch.tensor([s for s, _ in sequences])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [tok[i, p - 1:].tolist() for i, (_, p) in enumerate(sequences)]


def run_side(side: str, rows: int) -> dict[str, float]:
    import torch

    from screl.rollout.teachers import score_sequences

    torch.set_num_threads(THREADS)
    model = _model().eval()
    gen = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(0, VOCAB, (LENGTH,), generator=gen).tolist(), PROMPT) for _ in range(rows)]
    top_k = 16 if side == "after_top_k" else 0
    call = (lambda s: _before(model, s)) if side == "before" else \
        (lambda s: score_sequences(model, s, top_k=top_k, batch_tokens=16384))
    call(sequences[:1][:1])  # warm-up
    idle = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    out = call(sequences)
    seconds = time.perf_counter() - t0
    peak = _rss_kb("VmHWM")
    assert len(out) == rows
    return {"rows": rows, "tokens": rows * LENGTH, "peak_above_idle_mb": (peak - idle) / 1024, "seconds": seconds}


def measure(side: str, rows: int) -> dict[str, float]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=str(THREADS), PYTHONWARNINGS="ignore")
    result = child_json([sys.executable, __file__, "--side", side, "--rows", str(rows)], env, f"{side} x {rows} rows")
    print(f"  {side:12s} {rows} x {LENGTH}: peak above idle {result['peak_above_idle_mb']:8.0f} MB, "
          f"{result['seconds']:.1f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("before", "after", "after_top_k"), help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args.rows)))
        return
    sides = {"before": [measure("before", r) for r in (1, 2, 4)],
             "after": [measure("after", r) for r in (1, 2, 4, 8)],
             "after_top_k": [measure("after_top_k", r) for r in (1, 2, 4, 8)]}
    b = sides["before"]
    slope = (b[-1]["peak_above_idle_mb"] - b[0]["peak_above_idle_mb"]) / (b[-1]["rows"] - b[0]["rows"])
    before_8 = b[0]["peak_above_idle_mb"] + slope * (8 - b[0]["rows"])
    after_8 = sides["after"][-1]["peak_above_idle_mb"]
    figure = {
        "vocab": VOCAB, "length": LENGTH, "rows": 8, "model": "bench/memory.py's Qwen2 trunk, hidden 256, 2 layers, fp32",
        "sides": sides, "before_per_row_mb": slope, "before_8_rows_gb": before_8 / 1024,
        "before_8_rows_note": "the measured per-row slope (1 to 4 rows) carried to 8 rows: more memory than this "
                              "23 GB machine has",
        "after_8_rows_gb": after_8 / 1024, "after_top_k_8_rows_gb": sides["after_top_k"][-1]["peak_above_idle_mb"] / 1024,
        "after_over_before": after_8 / before_8, "date": time.strftime("%Y-%m-%d"),
    }
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    data["teacher_memory"] = figure
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: v for k, v in figure.items() if k != "sides"}, indent=1))


if __name__ == "__main__":
    main()
