"""The completion figures of a chunk, hand-derived, and ``screl samples`` on a run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from screl.callbacks.completions import completion_metrics, sample_rows

from screl.models import build_char_tokenizer
from screl.samples import main as samples_main
from screl.samples import read_samples


def _batch() -> dict[str, torch.Tensor | int]:
    tok = build_char_tokenizer()
    rows = [("1+1=", "2"), ("1+1=", "3"), ("2+2=", "44"), ("2+2=", "4aa")]
    width = 8
    ids, attn, mask = [], [], []
    for prompt, completion in rows:
        p, c = tok(prompt, add_special_tokens=False)["input_ids"], tok(completion, add_special_tokens=False)["input_ids"]
        seq = p + c
        ids.append(seq + [0] * (width - len(seq)))
        attn.append([1] * len(seq) + [0] * (width - len(seq)))
        mask.append([0] * (len(p) - 1) + [1] * len(c) + [0] * (width - len(seq) + 1))
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(attn), "token_mask": torch.tensor(mask),
            "rewards": torch.tensor([1.0, 1.0, 0.0, 1.0]), "raw_rewards": torch.tensor([1.0, 1.0, 0.0, 1.0]),
            "finish_reason": torch.tensor([0, 0, 1, 1]), "start_weight": torch.tensor([3, 3, 2, 2]),
            "trainer_version": 3}


def test_completion_figures_are_the_hand_derived_ones() -> None:
    got = {k: float(v) for k, v in completion_metrics(_batch(), group_size=2).items()}
    # rewards [1, 1, 0, 1]: mean 3/4, population variance 3/16; group (1, 1) is tied, group (0, 1) is not
    assert got == {"train/reward_std": pytest.approx(3**0.5 / 4, abs=1e-7), "train/completion_length_mean": 1.75,
                   "train/completion_length_min": 1.0, "train/completion_length_max": 3.0,
                   "train/clipped_ratio": 0.5, "train/zero_std_groups_ratio": 0.5}


def test_sampled_rows_decode_the_prompt_and_the_completion() -> None:
    rows = sample_rows(_batch(), build_char_tokenizer(), 3, torch.tensor([0.5, 0.5, -1.0, 1.0]))
    assert [(r["prompt"], r["completion"], r["advantage"], r["staleness"]) for r in rows] == [
        ("1+1=", "2", 0.5, 0), ("1+1=", "3", 0.5, 0), ("2+2=", "44", -1.0, 1)]
    assert rows[2]["finish_reason"] == "length" and rows[0]["finish_reason"] == "stop"


def test_screl_samples_prints_the_newest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    lines = [{"step": s, "prompt": f"p{s}", "completion": f"c{s}", "reward": s / 10} for s in range(5)]
    (run / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["step"] for r in read_samples(str(tmp_path), last=2)] == [3, 4]  # found below the folder given
    assert samples_main([str(run), "--last", "1"]) == 0
    out = capsys.readouterr().out
    assert "step=4" in out and "c4" in out and "c3" not in out
    assert samples_main([str(tmp_path / "nothing")]) == 1
    assert "logged no completions" in capsys.readouterr().out
