#!/usr/bin/env python
"""What the laptop demo's model learns: its greedy answers to the 128 held-out sums before and after training.

    python examples/smollm2_demo.py --task math --max-new-tokens 64 --out runs/demo64   # the run (12 min)
    python bench/demo_answers.py --export runs/demo64/export/final --max-new-tokens 64 \\
        --out bench/results/smollm2_math_64_answers.json

For the untrained SmolLM2-135M-Instruct and the run's exported final model (``screl.callbacks.HFExport``), each
held-out prompt (the ids the policy spec builds, system prompt "You are a calculator.") is answered greedily through
``transformers`` up to ``--max-new-tokens``. Per model: MathVerify accuracy (the demo's reward: the last number of
the completion), the share whose first number is the sum ("leads with the sum"), the share that ends before the cap
(EOS), the share that states the sum as a number anywhere, the share that restates the question's expression
``a + b`` (which math-verify evaluates, so it scores as the sum), the mean completion length in tokens, and three
answers. Prints and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from lora_demo import SYSTEM_PROMPT, greedy, held_out  # noqa: E402


def describe(answers: list[str], lengths: list[int], cap: int, records: list[Any]) -> dict[str, Any]:
    from screl.envs import MathVerify

    sums = [r.metadata["answer"].split("####")[-1].strip() for r in records]
    first = [re.search(r"-?\d+", a) for a in answers]
    terms = [re.findall(r"\d+", r.text)[:2] for r in records]
    n = len(answers)
    return {
        "accuracy": sum(MathVerify(timeout_s=10.0).rewards(records, answers)) / n,
        "leads_with_the_sum": sum(m is not None and m.group() == s for m, s in zip(first, sums, strict=True)) / n,
        "states_the_sum": sum(s in re.findall(r"-?\d+", a) for a, s in zip(answers, sums, strict=True)) / n,
        "restates_the_question": sum(bool(re.search(rf"\b{x}\s*\+\s*{y}\b", a))
                                     for a, (x, y) in zip(answers, terms, strict=True)) / n,
        "ends_before_cap": sum(t < cap for t in lengths) / n,
        "mean_completion_tokens": sum(lengths) / n,
        "examples": answers[:3],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", required=True, help="the run's exported final model folder")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from screl.models import SmolLM2

    spec = SmolLM2(system_prompt=SYSTEM_PROMPT)
    records, texts = held_out()
    tokenizer = AutoTokenizer.from_pretrained(args.export)
    out: dict[str, Any] = {"prompts": len(texts), "max_new_tokens": args.max_new_tokens, "export": args.export}
    for name, model in (("untrained", spec.build_model()), ("trained", AutoModelForCausalLM.from_pretrained(args.export))):
        answers = greedy(model, tokenizer, spec, texts, args.max_new_tokens)
        lengths = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers]
        out[name] = describe(answers, lengths, args.max_new_tokens, records)
        print(name, json.dumps({k: v for k, v in out[name].items() if k != "examples"}), flush=True)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
