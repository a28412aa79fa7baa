"""Write a small math dataset in GSM8K's layout (``question``, ``answer`` ending in ``#### <number>``) as parquet.

The questions keep to the character tokenizer's alphabet (lowercase, digits, ``+``, ``=``, ``?``, space), so
``configs/grpo_dataset_tiny.yaml`` runs it with the tiny in-memory model; the answers are GSM8K-style solutions,
which ``screl.envs.MathVerify`` reads through their ``####`` line. A ``test`` file holds other sums (no
question in both) for ``val_split``-style runs. Nothing is downloaded.

    python examples/make_math_parquet.py                 # -> runs/data/arith_gsm8k/{train,test}.parquet
    python examples/make_math_parquet.py --out DIR --rows 500 --test-rows 128 --max-operand 20
"""

from __future__ import annotations

import argparse
import os
import random


def rows(count: int, seed: int, offset: int = 0, max_operand: int = 49,
         exclude: frozenset[str] = frozenset()) -> list[dict[str, object]]:
    """``count`` distinct two-operand sums of 0..``max_operand``, seeded, none of whose questions is in
    ``exclude``; ``id`` numbers them from ``offset``."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    seen = set(exclude)
    if (max_operand + 1) ** 2 - len(seen) < count:
        raise SystemExit(f"only {(max_operand + 1) ** 2 - len(seen)} distinct sums of 0..{max_operand} are left"
                         f" for {count} rows: raise --max-operand or lower --rows/--test-rows")
    while len(out) < count:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        question = f"what is {a} + {b}?"
        if question in seen:
            continue
        seen.add(question)
        out.append({"id": offset + len(out), "question": question,
                    "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}",
                    "source": "arith"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/data/arith_gsm8k", help="output folder")
    parser.add_argument("--rows", type=int, default=200, help="training rows")
    parser.add_argument("--test-rows", type=int, default=50, help="test rows")
    parser.add_argument("--max-operand", type=int, default=49, help="operands are 0..N")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import datasets

    os.makedirs(args.out, exist_ok=True)
    test = rows(args.test_rows, args.seed + 1, args.rows, args.max_operand)  # held out: no training row repeats one
    train = rows(args.rows, args.seed, 0, args.max_operand, frozenset(str(r["question"]) for r in test))
    for split, data in (("train", train), ("test", test)):
        path = os.path.join(args.out, f"{split}.parquet")
        datasets.Dataset.from_list(data).to_parquet(path)
        print(f"wrote {len(data)} rows to {path}")


if __name__ == "__main__":
    main()
