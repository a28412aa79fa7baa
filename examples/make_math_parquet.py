"""Write a small math dataset in GSM8K's layout (``question``, ``answer`` ending in ``#### <number>``) as parquet.

The questions keep to the character tokenizer's alphabet (lowercase, digits, ``+``, ``=``, ``?``, space), so
``configs/grpo_dataset_tiny.yaml`` runs it with the tiny in-memory model; the answers are GSM8K-style solutions,
which ``screl.envs.MathVerify`` reads through their ``####`` line. A ``test`` file holds other sums for
``val_split``-style runs. Nothing is downloaded.

    python examples/make_math_parquet.py                 # -> runs/data/arith_gsm8k/{train,test}.parquet
    python examples/make_math_parquet.py --out DIR --rows 500
"""

from __future__ import annotations

import argparse
import os
import random


def rows(count: int, seed: int, offset: int = 0) -> list[dict[str, object]]:
    """``count`` two-operand sums, seeded; ``id`` numbers them from ``offset``."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        out.append({"id": offset + i, "question": f"what is {a} + {b}?",
                    "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}",
                    "source": "arith"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/data/arith_gsm8k", help="output folder")
    parser.add_argument("--rows", type=int, default=200, help="training rows")
    parser.add_argument("--test-rows", type=int, default=50, help="test rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import datasets

    os.makedirs(args.out, exist_ok=True)
    for split, count, seed, offset in (("train", args.rows, args.seed, 0),
                                       ("test", args.test_rows, args.seed + 1, args.rows)):
        path = os.path.join(args.out, f"{split}.parquet")
        datasets.Dataset.from_list(rows(count, seed, offset)).to_parquet(path)
        print(f"wrote {count} rows to {path}")


if __name__ == "__main__":
    main()
