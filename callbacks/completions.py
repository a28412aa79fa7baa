"""``Completions``: what the model writes. Each step, the completions' figures; every N steps, a sample of rows (prompt,
completion, rewards, advantage, version, staleness) in ``completions.jsonl`` and the loggers (TRL's
``log_completions``). ``screl samples RUN_DIR`` prints the newest."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from typing_extensions import override

from screl.rewards.stats import REWARD_PART
from screl.samples import COMPLETIONS_FILE

FINISH_LENGTH = 1  # FINISH_CODES: 0 stop, 1 length, 2 abort


def completion_metrics(batch: dict[str, Any], group_size: int) -> dict[str, Tensor]:
    """The chunk's completion figures: reward spread (over rows, and the share of groups whose rewards are all
    equal, which teach GRPO nothing), completion length (mean, min, max, in completion tokens) and the share cut
    at ``max_new_tokens``."""
    rewards = batch["rewards"].float()
    lengths = batch["token_mask"].float().sum(-1)
    out = {
        "train/reward_std": rewards.std(unbiased=False),
        "train/completion_length_mean": lengths.mean(),
        "train/completion_length_min": lengths.min(),
        "train/completion_length_max": lengths.max(),
        "train/clipped_ratio": (batch["finish_reason"] == FINISH_LENGTH).float().mean(),
    }
    if group_size > 1 and rewards.numel() % group_size == 0:
        groups = rewards.view(-1, group_size)
        out["train/zero_std_groups_ratio"] = (groups.max(-1).values == groups.min(-1).values).float().mean()
    return out


def run_dir_of(trainer: Trainer) -> str:
    """Where the run's files go: the data module's ``run_dir``, else the first logger's folder (where ``events.jsonl``
    goes). Not ``trainer.log_dir``: that is a broadcast every rank must join, and only rank 0 writes samples."""
    dm = getattr(trainer, "datamodule", None)
    logged = getattr(trainer.loggers[0], "log_dir", None) if trainer.loggers else None
    return str(getattr(dm, "run_dir", None) or logged or trainer.default_root_dir)


class Completions(Callback):
    """Log what the model writes.

    Args:
        every_n_steps: Every this many RL steps, sample rows of the step's first chunk into ``completions.jsonl`` in
            the run folder and into each logger that takes tables or text (wandb: a table; TensorBoard: text). 0:
            figures only.
        num_rows: Rows sampled per logged step (the chunk's first rows: whole groups first).
        max_chars: Prompts and completions are cut to this many characters in the loggers (never in the file).
    """

    def __init__(self, every_n_steps: int = 10, num_rows: int = 4, max_chars: int = 2000) -> None:
        if every_n_steps < 0 or num_rows < 1 or max_chars < 1:
            raise ValueError(f"Completions: every_n_steps={every_n_steps} must be >= 0, num_rows={num_rows} and "
                             f"max_chars={max_chars} >= 1")
        self.every_n_steps, self.num_rows, self.max_chars = every_n_steps, num_rows, max_chars
        self._tokenizer: Any = None
        self._logged_version: int | None = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not isinstance(batch, dict) or batch.get("done") or "rewards" not in batch or not batch["rewards"].numel():
            return
        algo = getattr(pl_module, "algo", None)
        group = int(getattr(algo, "num_generations_per_prompt", 1) or 1)
        stage = getattr(pl_module, "stage_metrics", None)
        figures = completion_metrics(batch, group)
        if stage is not None:
            stage(figures)
        else:
            pl_module.log_dict(figures, batch_size=1)
        version = int(batch["trainer_version"])
        if self.every_n_steps and version % self.every_n_steps == 0 and version != self._logged_version:
            self._logged_version = version
            self._write_samples(trainer, pl_module, batch, version)

    @rank_zero_only
    def _write_samples(self, trainer: Trainer, pl_module: LightningModule, batch: dict[str, Any], version: int) -> None:
        if self._tokenizer is None:
            self._tokenizer = getattr(pl_module, "policy_spec").build_tokenizer()  # noqa: B009 - any screl module
        rows = sample_rows(batch, self._tokenizer, self.num_rows, getattr(pl_module, "last_advantages", None))
        path = os.path.join(run_dir_of(trainer), COMPLETIONS_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps({"step": version, **row}, ensure_ascii=False) + "\n")
        for logger in trainer.loggers:
            _to_logger(logger, rows, version, self.max_chars)


def sample_rows(batch: dict[str, Any], tokenizer: Any, num_rows: int, advantages: Tensor | None) -> list[dict[str, Any]]:
    """The first ``num_rows`` rows of a collated chunk, decoded: the prompt and completion text (special tokens kept
    in the prompt, which shows its chat template; skipped in the completion, as a reward sees it)."""
    out = []
    version = int(batch["trainer_version"])
    for i in range(min(num_rows, int(batch["input_ids"].shape[0]))):
        ids, plen = batch["input_ids"][i], _prompt_len(batch, i)
        completion_ids = ids[plen: int(batch["attention_mask"][i].sum())].tolist()  # right-padded rows
        row: dict[str, Any] = {
            "prompt": tokenizer.decode(ids[:plen].tolist(), skip_special_tokens=False),
            "completion": tokenizer.decode(completion_ids, skip_special_tokens=True),
            "reward": float(batch["rewards"][i]),
            "raw_reward": float(batch["raw_rewards"][i]) if "raw_rewards" in batch else None,
            "version": int(batch["start_weight"][i]),
            "staleness": version - int(batch["start_weight"][i]),
            "finish_reason": ("stop", "length", "abort")[int(batch["finish_reason"][i])],
            "completion_tokens": int(batch["token_mask"][i].sum()),
        }
        for key in sorted(k for k in batch if k.startswith(REWARD_PART)):  # each reward function's value
            value = float(batch[key][i])
            row[key] = None if math.isnan(value) else value
        if advantages is not None and i < advantages.shape[0]:
            adv = advantages[i]
            mask = batch["token_mask"][i].to(adv.device).float()
            row["advantage"] = float(adv) if adv.dim() == 0 else float((adv * mask).sum() / mask.sum().clamp(min=1))
        out.append(row)
    return out


def _prompt_len(batch: dict[str, Any], i: int) -> int:
    """Row ``i``'s prompt length: the position before its first trained token (``token_mask[j]`` marks position ``j``
    predicting token ``j + 1``)."""
    trained = batch["token_mask"][i].nonzero()
    return int(trained[0]) + 1 if trained.numel() else int(batch["attention_mask"][i].sum())


def _to_logger(logger: Any, rows: list[dict[str, Any]], version: int, max_chars: int) -> None:
    kind = type(logger).__name__
    columns = ["step", *rows[0].keys()] if rows else ["step"]
    cut = [[version, *(v[:max_chars] if isinstance(v, str) else v for v in row.values())] for row in rows]
    if kind == "WandbLogger":
        logger.log_table(key="completions", columns=columns, data=cut, step=version)
    elif kind == "TensorBoardLogger":
        text = "\n\n".join(f"**reward {r['reward']:.3f}**\n\n{r['prompt'][:max_chars]}\n\n---\n\n"
                           f"{r['completion'][:max_chars]}" for r in rows)
        logger.experiment.add_text("completions", text, global_step=version)
