"""``RolloutDataModule``: the rollout side of a screl run, as a LightningDataModule.

``setup("fit")`` starts (or joins) Ray on loopback, the TransferQueue data plane, the generation
workers and the ``RolloutController`` on global rank 0. Its train dataloader is a stream of RL-step
*chunks*: each item holds whole prompt groups fetched from the data plane by the keys the controller
handed out (metadata only crosses the controller boundary). A step ends with the chunk marked
``last_chunk``; the ``WeightSync`` callback then retires it, bumps the trainer version and refits the
workers. ``teardown`` (also on exceptions) stops everything it started.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningDataModule

from screl.config import GenerationConfig, RunConfig
from screl.envs import Task

log = logging.getLogger(__name__)

TICKET = "screl_ticket"


def collate_chunk(meta: dict[str, Any], data: dict[str, list[torch.Tensor]], pad_id: int) -> dict[str, Any]:
    """Dense, next-token-aligned training tensors for one chunk of rollout rows.

    ``token_mask[i, j]`` is 1 where position ``j`` predicts a response token (``input_ids[i, j + 1]``);
    ``generation_logprobs`` and ``token_versions`` are aligned the same way.
    """
    rows = len(meta["keys"])
    version = int(meta["trainer_version"])
    base: dict[str, Any] = {k: meta[k] for k in ("trainer_version", "step_groups", "last_chunk", "buffer_fill", "inflight",
                                 "generation_s") if k in meta}
    if rows == 0:
        empty = torch.zeros((0, 1))
        return {**base, "input_ids": empty.long(), "attention_mask": empty.long(), "token_mask": empty,
                "generation_logprobs": empty, "token_versions": empty.long(), "rewards": torch.zeros(0),
                "sample_mask": torch.zeros(0), "start_weight": torch.zeros(0, dtype=torch.long)}
    ids = data["input_ids"]
    length = max(int(t.numel()) for t in ids)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, length), dtype=torch.long)
    token_mask = torch.zeros((rows, length - 1))
    gen_lp = torch.zeros((rows, length - 1))
    versions = torch.full((rows, length - 1), version, dtype=torch.long)
    for i in range(rows):
        n = int(ids[i].numel())
        p = int(data["prompt_len"][i].reshape(-1)[0])
        resp = n - p
        input_ids[i, :n] = ids[i].long()
        attention[i, :n] = 1
        token_mask[i, p - 1:p - 1 + resp] = 1.0
        gen_lp[i, p - 1:p - 1 + resp] = data["generation_logprobs"][i].float().reshape(-1)[:resp]
        versions[i, p - 1:p - 1 + resp] = data["token_versions"][i].long().reshape(-1)[:resp]
    rewards = torch.stack([r.float().reshape(-1)[0] for r in data["reward"]])
    return {
        **base,
        "input_ids": input_ids,
        "attention_mask": attention,
        "token_mask": token_mask,
        "generation_logprobs": gen_lp,
        "token_versions": versions,
        "rewards": rewards,
        "sample_mask": torch.ones(rows),
        "start_weight": torch.tensor(meta["start_weight"], dtype=torch.long),
    }


class _StepStream:
    """The train dataloader: an endless stream of *tickets*, each redeemed for the next chunk.

    Lightning prefetches one item ahead, before the previous step's ``on_train_batch_end`` (where
    ``WeightSync`` closes the step). A ticket costs nothing to prefetch; the chunk itself is fetched
    in ``on_before_batch_transfer``, which runs in step order. When the controller reports the run
    done, the redeemed batch says so and the trainer stops.
    """

    def __iter__(self) -> Iterator[dict[str, Any]]:
        ticket = 0
        while True:
            yield {TICKET: ticket}
            ticket += 1


class RolloutDataModule(LightningDataModule):
    """Owns the single controller and feeds the fit loop one RL-step chunk per batch.

    Args:
        task: The prompt dataset and reward function (``screl.envs.CountLetter``, ``screl.envs.Addition``...).
        generation: Generation settings (``policy.generation`` in the spec).
        run: The top-level blocks (grpo/ppo, async_rl, data_plane, checkpointing, ...), linked by the CLI.
        step_timeout_s: Longest wait for a trainable chunk before failing with a clear error.
        run_dir: Where ``events.jsonl`` goes (default: the trainer's log dir).
        seed: Seeds prompt order and every request's sampling (with the prompt, epoch and sibling).
    """

    def __init__(
        self,
        task: Task,
        generation: GenerationConfig | None = None,
        run: dict[str, Any] | None = None,
        step_timeout_s: float = 600.0,
        run_dir: str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.task = task
        self.generation = generation if generation is not None else GenerationConfig()
        self.run = RunConfig.from_dict(run) if not isinstance(run, RunConfig) else run
        if self.run.grpo is None and self.run.ppo is None:
            from screl.config import GRPOConfig

            self.run.grpo = GRPOConfig()
        self.step_timeout_s = step_timeout_s
        self.run_dir = run_dir
        self.seed = seed
        self.runtime: Any = None
        self.resume: Any = None  # a screl.checkpoint.resume.Resume set by the CLI when a bundle exists
        self.config_dict: dict[str, Any] = {}  # the whole config (set by the CLI): the bootstrap fingerprint
        self._pad_id = 0
        self.events_path: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage != "fit":
            raise NotImplementedError(
                f"RolloutDataModule supports only `fit` (got {stage!r}): validation is not supported on the "
                "single controller"
            )
        if self.runtime is not None:
            return
        from screl.callbacks import WeightSync

        trainer: Any = self.trainer
        if trainer is None or not any(isinstance(cb, WeightSync) for cb in trainer.callbacks):
            raise RuntimeError(
                "RolloutDataModule needs the WeightSync callback (it refits the generation workers after each "
                "step): run through `screl fit`, which adds it, or pass callbacks=[screl.callbacks.WeightSync()]"
            )
        if trainer.global_rank != 0:
            raise NotImplementedError(
                "multi-rank training with the RolloutDataModule is not supported yet: run one training process"
            )
        torch.set_num_threads(max(1, self.generation.num_threads))

    def _ensure_started(self) -> None:
        """Start the rollout side at the first batch: after Lightning restored the model from a checkpoint,
        so the workers get the restored weights and the controller its restored state before its pump runs."""
        if self.runtime is not None:
            return
        trainer: Any = self.trainer
        module: Any = trainer.lightning_module
        run_dir = self.run_dir or trainer.log_dir or trainer.default_root_dir
        self._start(module.policy_spec, run_dir, module.export_weights())

    def _start(self, policy: Any, run_dir: str, initial_weights: dict[str, torch.Tensor]) -> None:
        from screl.controller import RolloutRuntime

        self._pad_id = int(policy.build_tokenizer().pad_token_id or 0)
        runtime = RolloutRuntime(self.run, self.generation, self.step_timeout_s)
        restore = None
        if self.resume is not None:
            restore = (self.resume.controller_state, self.resume.data_plane_dir)
        self.runtime = runtime
        runtime.start(self.task, policy, run_dir, initial_weights, self.seed, restore=restore,
                      config_dict=self.config_dict)
        self.events_path = runtime.events_path

    def teardown(self, stage: str) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the controller, workers and data plane (and Ray, if this module started it). Idempotent."""
        if self.runtime is not None:
            runtime, self.runtime = self.runtime, None
            runtime.shutdown()

    def state_dict(self) -> dict[str, Any]:
        # the rollout side's state lives in the checkpoint bundle (captured under the data-plane barrier)
        return {"screl_bundle_format": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("screl_bundle_format") != 1:
            raise ValueError(f"unknown RolloutDataModule state {state_dict!r}: resume from a screl bundle")

    # -- the train pump's side ---------------------------------------------------------------------------
    def train_dataloader(self) -> _StepStream:
        return _StepStream()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not (isinstance(batch, dict) and TICKET in batch):
            return batch
        chunk = self.next_batch()
        if chunk is None:
            if self.trainer is not None:
                self.trainer.should_stop = True
            return {"done": True}
        return chunk

    def next_batch(self) -> dict[str, Any] | None:
        """Block for the next chunk (metadata from the controller, tensors from the data plane)."""
        t0 = time.perf_counter()
        self._ensure_started()
        meta = self.runtime.next_chunk()
        if meta is None:
            return None
        batch = collate_chunk(meta, self.runtime.fetch(meta["keys"]), self._pad_id)
        batch["wait_s"] = time.perf_counter() - t0
        return batch

    def complete_step(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Retire the finished step and refit the workers with ``weights`` (called by WeightSync)."""
        return self.runtime.complete_step(weights)  # type: ignore[no-any-return]
