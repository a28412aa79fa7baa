"""Write a tiny conversational dataset in TRL's format (a ``prompt`` column of messages) as parquet, for
``configs/grpo_trl_style_tiny.yaml``. String ids, a ``letter`` column the reward functions read; the prompts keep to
the character tokenizer's alphabet. Nothing is downloaded.

    python examples/make_trl_style_data.py          # -> runs/data/trl_style/{train,test}.parquet
"""

from __future__ import annotations

import argparse
import os

WORDS = ["write", "say", "give", "repeat", "type", "spell"]


def rows(count: int, offset: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(offset, offset + count):
        turns = [{"role": "user", "content": f"{WORDS[i % len(WORDS)]} the letter a {i} times"}]
        if i % 3 == 0:
            turns.insert(0, {"role": "system", "content": "answer with letters only"})
        out.append({"id": f"q-{i:04d}", "prompt": turns, "letter": "a"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/data/trl_style", help="output folder")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--test-rows", type=int, default=16)
    args = parser.parse_args()
    import datasets

    os.makedirs(args.out, exist_ok=True)
    for split, data in (("train", rows(args.rows, 0)), ("test", rows(args.test_rows, args.rows))):
        path = os.path.join(args.out, f"{split}.parquet")
        datasets.Dataset.from_list(data).to_parquet(path)
        print(f"wrote {len(data)} rows to {path}")


if __name__ == "__main__":
    main()
