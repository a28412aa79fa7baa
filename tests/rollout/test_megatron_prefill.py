"""The Megatron engine's prefill runs the output layer at each row's last position only: its logits are
``[rows, vocab]``, never ``[rows, width, vocab]``, and equal the last position of Megatron's full forward.

Runs in a subprocess: the engine builds its own one-process gloo group and megatron-core's parallel state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, torch
from screl.models import TinyCausalLM
from screl.rollout.engines.megatron_decode import MegatronDecoder
from screl.rollout.engines.megatron_engine import MegatronGenerationEngine

engine = MegatronGenerationEngine(TinyCausalLM(scale="tiny", seed=3), seed=1)
model = engine.model
seen = []
model.output_layer.register_forward_hook(lambda m, i, o: seen.append(list(i[0].shape)))
ids = torch.tensor([[0, 0, 5, 9, 17, 3], [7, 8, 1, 12, 4, 20]])
attn = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
with torch.no_grad():
    dec = MegatronDecoder(model, engine.vocab_size)
    logits = dec.start(ids, attn, 10)
    prefill_in = seen[-1]
    step = dec.step(torch.tensor([2, 3]))
    step_in = seen[-1]
    # Megatron's own full forward (no inference context): every position's logits, the last one compared
    full = []
    for row, mask in zip(ids, attn):
        real = row[mask.bool()][None]
        full.append(model(real, torch.arange(real.shape[1])[None], None)[0, -1, : engine.vocab_size])
print(json.dumps({"logits": list(logits.shape), "step": list(step.shape), "prefill_in": prefill_in,
                  "step_in": step_in, "rows": 2, "width": 6,
                  "diff": float((logits - torch.stack(full).float()).abs().max())}))
"""


def test_megatron_prefill_computes_logits_at_the_last_position_only() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    rows, vocab = got["rows"], got["logits"][-1]
    assert got["logits"] == [rows, vocab] and got["step"] == [rows, vocab]
    # the output layer's input is [sequence, batch, hidden]: one position per row in the prefill, not the width
    assert got["prefill_in"][:2] == [1, rows], got
    assert got["step_in"][:2] == [1, rows], got
    assert got["diff"] <= 1e-5  # the same logits as the full forward's last position (fp32)
