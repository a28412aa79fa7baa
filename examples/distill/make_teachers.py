"""Write the tiny teachers of the distillation examples, tests and benchmark (``examples/distill/teachers/``).

    python examples/distill/make_teachers.py [--out examples/distill/teachers] [--count-steps 30]

* ``count``: the tiny policy (``TinyCausalLM(scale=tiny, seed=0)``) after a short GRPO run on the count-'a' task
  (``configs/grpo_tiny.yaml``, ``--count-steps`` steps, ~30 s on a 2-core CPU): its reward is printed.
* ``addition``: the same architecture fitted by cross-entropy on the correct answers of the 100 single-digit
  additions, untagged (``3+4=``) and tagged as ``TaskMixture`` writes them (``add 3+4=``), ``--add-steps`` Adam steps
  (a few seconds, no Ray): GRPO from scratch on the sparse addition reward takes far longer on this model.

Each is saved with ``save_pretrained`` (the model, and the character tokenizer in ``tokenizer/``), ~0.3 MB, and
loads as ``screl.models.HFCausalLM(path=DIR, tokenizer_path=DIR/tokenizer)``. The repository ships the output of this script, so tests do not train.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def save(model: torch.nn.Module, out: Path) -> None:
    from screl.models import build_char_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # type: ignore[operator]
    # a directory of its own: next to a qwen2 config.json, transformers 5 loads it as Qwen2Tokenizer, which adds a
    # 44th token (<|endoftext|>) the student's tokenizer lacks (screl check refuses such a teacher)
    build_char_tokenizer().save_pretrained(out / "tokenizer")


def grpo_count_teacher(out: Path, steps: int) -> float:
    """GRPO on count-'a' from the tiny policy; saves the trained policy; returns the mean reward of its last 5 steps."""
    import csv

    from screl.cli import ScrelCLI

    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cfg["trainer"].update(max_steps=steps, default_root_dir=tmp, enable_progress_bar=False,
                              enable_model_summary=False)
        cfg["grpo"]["max_num_steps"] = steps
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(copy.deepcopy(cfg)))
        cli = ScrelCLI(args=["--config", str(path)], run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        with (Path(cli.trainer.log_dir) / "metrics.csv").open() as fh:
            rewards = [float(r["reward"]) for r in csv.DictReader(fh) if r.get("reward")]
        save(cli.model.model, out)
    return statistics.fmean(rewards[-5:])


def sft_addition_teacher(out: Path, steps: int, seed: int = 0) -> float:
    """Cross-entropy on ``<prompt><sum><eos>`` for both prompt forms; returns the greedy accuracy on them."""
    from screl.envs import arithmetic_prompts
    from screl.models import EOS_TOKEN_ID, TinyCausalLM, build_char_tokenizer

    tok = build_char_tokenizer()
    model = TinyCausalLM(scale="tiny", seed=seed).build_model().train()
    seqs = []
    for p in arithmetic_prompts():
        answer = str(p.metadata["a"] + p.metadata["b"])
        for text in (p.text, f"add {p.text}"):
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            seqs.append((prompt, tok(answer, add_special_tokens=False)["input_ids"] + [EOS_TOKEN_ID]))
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
        attention[i, :len(p) + len(a)] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    correct = 0
    for i, (p, a) in enumerate(seqs):
        pred = logits[i, len(p) - 1:len(p) + len(a) - 1].argmax(-1).tolist()
        correct += pred == a
    save(model, out)
    return correct / len(seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "examples" / "distill" / "teachers")
    parser.add_argument("--count-steps", type=int, default=30)
    parser.add_argument("--add-steps", type=int, default=400)
    parser.add_argument("--only", choices=["count", "addition"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only in (None, "addition"):
        acc = sft_addition_teacher(args.out / "addition", args.add_steps)
        print(f"addition teacher: teacher-forced accuracy {acc:.3f} -> {args.out / 'addition'}")
    if args.only in (None, "count"):
        reward = grpo_count_teacher(args.out / "count", args.count_steps)
        print(f"count teacher: GRPO reward (last 5 steps) {reward:.3f} -> {args.out / 'count'}")


if __name__ == "__main__":
    main()
