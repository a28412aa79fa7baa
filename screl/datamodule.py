"""``RolloutDataModule``: the rollout side of a screl run, as a LightningDataModule.

``setup("fit")`` starts (or joins) Ray on loopback, the TransferQueue data plane, the generation
workers and the ``RolloutController`` on global rank 0. Its train dataloader is a stream of RL-step
*chunks*: each item holds whole prompt groups fetched from the data plane by the keys the controller
handed out (metadata only crosses the controller boundary). A step ends with the chunk marked
``last_chunk``; the ``WeightSync`` callback then retires it, bumps the trainer version and refits the
workers. ``teardown`` (also on exceptions) stops everything it started.

With several training processes (``MegatronStrategy``, DDP) every hook runs on every rank, but only
global rank 0 talks to the controller: it redeems each ticket and broadcasts the chunk (CPU tensors and
scalars) to the other ranks. Tensor/pipeline peers train on the same chunk; with data parallelism each
replica takes its share of the chunk's whole groups (``shard_groups``). The weight export after a step is
a collective on every rank; only rank 0 hands the weights to the controller. A failure on rank 0 is
broadcast too, so the other ranks raise instead of waiting on a collective that never comes.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from lightning.pytorch import LightningDataModule
from typing_extensions import override

from screl.config import SHADOW_MODE_NOTE, GenerationConfig, RunConfig
from screl.envs import Task
from screl.rewards.stats import REWARD_PART
from screl.rollout.engines.protocol import EngineCapabilities, RankLink
from screl.rollout.engines.registry import engine_capabilities, resolve_backend
from screl.rollout.rows import ROW_SCHEMA, RowSchema
from screl.threads import ThreadPlan, thread_plan

log = logging.getLogger(__name__)

TICKET = "screl_ticket"
_T = TypeVar("_T")


#: Chunk metadata a collated chunk carries along (scalars, not per row).
CHUNK_META = ("trainer_version", "step_groups", "last_chunk", "buffer_fill", "inflight", "generation_s", "filtered",
              "replaced")


def collate_chunk(meta: dict[str, Any], data: dict[str, list[torch.Tensor]], pad_id: int,
                  schema: RowSchema = ROW_SCHEMA) -> dict[str, Any]:
    """Dense, next-token-aligned training tensors for one chunk of rollout rows (``schema.collate``),
    plus the chunk's metadata.

    ``token_mask[i, j]`` is 1 where position ``j`` predicts a response token (``input_ids[i, j + 1]``);
    ``generation_logprobs`` and ``token_versions`` (every ``per_completion_token`` field) are aligned the
    same way.
    """
    base: dict[str, Any] = {k: meta[k] for k in CHUNK_META if k in meta}
    parts = {f"{REWARD_PART}{name}": torch.tensor([math.nan if v is None else v for v in values])
             for name, values in (meta.get("reward_parts") or {}).items()}  # NaN: that row's function gave none
    return {**base, **schema.collate(meta, data, pad_id), **parts}


#: Per-row tensors of a collated chunk (what a data-parallel shard slices).
ROW_KEYS = ROW_SCHEMA.collated_keys


def shard_groups(batch: dict[str, Any], group_size: int, num_shards: int, shard: int,
                 schema: RowSchema = ROW_SCHEMA) -> dict[str, Any]:
    """Data-parallel replica ``shard``'s share of a collated chunk: a contiguous run of whole groups.

    Replicas get ``groups // num_shards`` or one more (possibly none). The shard keeps the whole
    chunk's size in ``chunk_rows`` and its valid-token count in ``chunk_valid_tokens`` (what the loss
    normalizes by), and ``dp_shards`` = ``num_shards``. The per-row tensors are ``schema.collated_keys``.
    """
    rows = int(batch["sample_mask"].shape[0])
    if rows % group_size:
        raise ValueError(f"a chunk of {rows} rows is not whole groups of {group_size}")
    groups = rows // group_size
    lo, hi = shard * groups // num_shards * group_size, (shard + 1) * groups // num_shards * group_size
    row_keys = schema.collated_keys
    out = {k: (v[lo:hi] if k in row_keys or k.startswith(REWARD_PART) else v) for k, v in batch.items()}
    valid = (batch["token_mask"].float() * batch["sample_mask"].float()[:, None]).sum()
    out.update(chunk_rows=rows, chunk_valid_tokens=float(valid), dp_shards=num_shards)
    return out


class _RankZeroError(RuntimeError):
    """Raised on the other ranks when rank 0 failed in a step they wait on."""


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
        train_num_threads: Torch intra-op threads of the training process on CPU. None: automatic
            (``screl.threads.thread_plan``): all cores in sync mode, the cores generation leaves otherwise.
        val_task: The held-out prompts and reward of validation during training (``grpo.val_period`` ...).
            None: the task's own ``val_prompts()`` (e.g. ``CountLetter(holdout=20)``).
    """

    def __init__(
        self,
        task: Task,
        generation: GenerationConfig | None = None,
        run: dict[str, Any] | None = None,
        step_timeout_s: float = 600.0,
        run_dir: str | None = None,
        seed: int = 0,
        train_num_threads: int | None = None,
        val_task: Task | None = None,
    ) -> None:
        super().__init__()
        self.task = task
        self.generation = generation if generation is not None else GenerationConfig()
        self.run = RunConfig.from_dict(run) if not isinstance(run, RunConfig) else run
        if getattr(self.run, self.run.algorithm.config_key) is None:  # no block: GRPO's defaults
            from screl.config import GRPOConfig

            self.run.grpo = GRPOConfig()
        self.val_task = _held_out(task, val_task, self.run.algo, self.run.algorithm.config_key)
        self.step_timeout_s = step_timeout_s
        self.run_dir = run_dir
        self.seed = seed
        self.train_num_threads = train_num_threads
        self.runtime: Any = None
        self.resume: Any = None  # a screl.checkpoint.resume.Resume set by the CLI when a bundle exists
        self.config_dict: dict[str, Any] = {}  # the whole config (set by the CLI): the bootstrap fingerprint
        self._pad_id = 0
        self.events_path: str | None = None
        self._started = False  # the weights went out and (on rank 0) the rollout side started
        self._ranks: RankLink | None = None  # a colocated engine across tensor-parallel ranks: rank 0's leads
        self._schema: RowSchema = ROW_SCHEMA  # the module's rows (screl.Distill's carry teacher_logprobs)

    # -- lifecycle -------------------------------------------------------------------------------------
    @override
    def setup(self, stage: str) -> None:
        if stage != "fit":
            raise NotImplementedError(
                f"RolloutDataModule supports only `fit` (got {stage!r}): validation runs inside fit, beside the "
                "rollouts (grpo.val_period, val_at_start, val_at_end)"
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
        plan = self.thread_plan()
        torch.set_num_threads(plan.train)

    def thread_plan(self) -> ThreadPlan:
        """Torch threads of the trainer and of each generation worker (explicit settings, else automatic)."""
        return thread_plan(self.generation, self.run, self.train_num_threads)

    def _ensure_started(self) -> None:
        """Start the rollout side at the first batch: after Lightning restored the model from a checkpoint,
        so the workers get the restored weights and the controller its restored state before its pump runs.

        Runs on every rank: the log directory and the weight export are collectives under a multi-process
        strategy; only rank 0 starts the runtime."""
        if self.runtime is not None or self._started:
            return
        trainer: Any = self.trainer
        module: Any = trainer.lightning_module
        run_dir = self.run_dir or trainer.log_dir or trainer.default_root_dir
        self._schema = getattr(module, "row_schema", ROW_SCHEMA)
        weights = {} if self.colocated else self.exported_weights(module)  # a colocated engine decodes with the module
        if self.colocated and self.engine.colocated_tensor_parallel and self._world_size() > 1:
            self._link_ranks(module)
        if trainer.global_rank == 0:
            self._on_rank_zero(lambda: self._start(module.policy_spec, run_dir, weights, module))
        else:
            self._on_rank_zero(lambda: None)
        self._started = True

    def _link_ranks(self, module: Any) -> None:
        """Every rank: the engine class links the tensor-parallel ranks of its colocated engine (rank 0's engine
        leads; the others follow its forward passes, :class:`~screl.rollout.engines.protocol.RankLink`)."""
        engine_cls: Any = resolve_backend(self.generation.backend)  # the rules let only such an engine here
        self._ranks = engine_cls.link_ranks(module.model, self._engine_autocast(module), self._world_size())

    @staticmethod
    def _engine_autocast(module: Any) -> torch.dtype | None:
        dtype = getattr(module, "engine_dtype", None)
        return dtype if dtype in (torch.bfloat16, torch.float16) else None

    def _with_engine(self, fn: Callable[[], _T]) -> _T:
        """:meth:`_on_rank_zero` while the colocated engine may generate: with a decode link the other ranks follow
        its forward passes until rank 0 is done (it releases them, error or not), then take its result."""
        if self._ranks is None:
            return self._on_rank_zero(fn)
        if self._global_rank() == 0:
            def lead() -> _T:
                try:
                    return fn()
                finally:
                    if self.runtime is not None:
                        self.runtime.release_followers()
            return self._on_rank_zero(lead)
        self._ranks.follow()
        return self._on_rank_zero(lambda: None)  # type: ignore[return-value]  # rank 0's result

    def _world_size(self) -> int:
        trainer: Any = self.trainer
        return int(trainer.world_size) if trainer is not None else 1

    def _global_rank(self) -> int:
        trainer: Any = self.trainer
        return int(trainer.global_rank) if trainer is not None else 0

    def _on_rank_zero(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on global rank 0 and broadcast its result (CPU tensors, scalars) to every rank.

        One process: just ``fn()``. If ``fn`` raises on rank 0, the other ranks raise too (no hang)."""
        if self._world_size() == 1:
            return fn()
        trainer: Any = self.trainer
        strategy = trainer.strategy
        if trainer.global_rank == 0:
            try:
                result = fn()
            except BaseException as err:
                strategy.broadcast(("error", f"{type(err).__name__}: {err}"), src=0)
                raise
            strategy.broadcast(("ok", result), src=0)
            return result
        status, payload = strategy.broadcast(None, src=0)
        if status != "ok":
            raise _RankZeroError(f"global rank 0 failed: {payload}")
        return payload  # type: ignore[no-any-return]

    def _start(self, policy: Any, run_dir: str, initial_weights: dict[str, torch.Tensor], module: Any = None) -> None:
        from screl.controller import RolloutRuntime

        self._pad_id = int(policy.build_tokenizer().pad_token_id or 0)
        for task in (self.task, self.val_task):  # before the tasks travel: they filter/format by the tokenizer
            if task is not None:
                task.prepare(policy, run_dir)
        runtime = RolloutRuntime(self.run, self.generation, self.step_timeout_s)
        runtime.record_routing = bool(getattr(module, "routing_replay", False))  # MoE routing replay
        if self.run.checkpointing.enabled and self.run.shadow_checkpoints:
            log.warning("screl: checkpoints in SHADOW MODE: the %s sampler %s (docs/checkpointing.md)",
                        self.run.async_rl.sampler.get("target", self.run.sampler.name), SHADOW_MODE_NOTE)
        restore = None
        if self.resume is not None:
            restore = (self.resume.controller_state, self.resume.data_plane_dir, self.resume.data_plane_remote)
        self.runtime = runtime
        colocated: dict[str, Any] = {}
        if self.colocated:
            link = self._ranks.link if self._ranks is not None else None
            colocated = {"model": module.model, "autocast": self._engine_autocast(module), "link": link}
        runtime.start(self.task, policy, run_dir, initial_weights, self.seed, restore=restore,
                      config_dict=self.config_dict, val_task=self.val_task,
                      distillation=getattr(module, "distillation", None), **colocated)
        self.events_path = runtime.events_path

    @override
    def teardown(self, stage: str) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the controller, workers and data plane (and Ray, if this module started it). Idempotent.

        Only rank 0 holds a runtime; on the other ranks this only forgets that the run started."""
        self._started = False
        if self.runtime is not None:
            runtime, self.runtime = self.runtime, None
            runtime.shutdown()

    @override
    def state_dict(self) -> dict[str, Any]:
        # the rollout side's state lives in the checkpoint bundle (captured under the data-plane barrier)
        return {"screl_bundle_format": 1}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("screl_bundle_format") != 1:
            raise ValueError(f"unknown RolloutDataModule state {state_dict!r}: resume from a screl bundle")

    # -- the train pump's side ---------------------------------------------------------------------------
    @override
    def train_dataloader(self) -> _StepStream:
        return _StepStream()

    @override
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
        """Block for the next chunk (metadata from the controller, tensors from the data plane).

        Every rank calls it; rank 0 fetches the chunk and broadcasts it, and each data-parallel replica
        keeps its share of the groups."""
        t0 = time.perf_counter()
        self._ensure_started()

        def fetch() -> dict[str, Any] | None:
            if self.colocated:  # the engine generates while the trainer waits (idempotent after the refit's wake)
                self.runtime.wake()
            meta = self.runtime.next_chunk()
            if meta is None:
                return None
            phase: dict[str, float] = {}
            if self.colocated:  # the step's batch is complete: the engine stands down for the train step
                phase = self.runtime.stand_down()
            batch = collate_chunk(meta, self.runtime.fetch(meta["keys"], self._schema.names), self._pad_id,
                                  self._schema)
            batch["wait_s"] = time.perf_counter() - t0
            batch.update(phase)  # colocated: the engine's generation phase (rollout/engine_busy_s, engine_tokens)
            return batch

        chunk = self._with_engine(fetch)
        shards, shard = self._data_parallel()
        if chunk is None or shards == 1:
            return chunk
        return shard_groups(chunk, self.run.algo.num_generations_per_prompt, shards, shard, self._schema)

    def _data_parallel(self) -> tuple[int, int]:
        """(data-parallel replicas, this rank's replica) from the strategy: model-parallel peers share one."""
        if self._world_size() == 1:
            return 1, 0
        trainer: Any = self.trainer
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    @functools.cached_property
    def engine(self) -> EngineCapabilities:
        """What the configured engine declares it can do (resolved once: every refit reads its naming)."""
        return engine_capabilities(self.generation.backend)

    @property
    def refit_naming(self) -> str:
        """The names the engines load (the engine declares them: Megatron's own, or Hugging Face's)."""
        return self.engine.weight_naming

    def exported_weights(self, module: Any) -> dict[str, torch.Tensor]:
        """The module's full weights as the engines load them (a collective under a model-parallel strategy)."""
        if self.refit_naming == "hf":  # a user module's export_weights() need not take a naming
            return module.export_weights()  # type: ignore[no-any-return]
        return module.export_weights(naming=self.refit_naming)  # type: ignore[no-any-return]

    @property
    def colocated(self) -> bool:
        """Generation decodes with the trainer's module in this process (``generation.colocated.enabled``)."""
        return bool(self.generation.colocated.enabled)

    @property
    def broadcasts_weights(self) -> bool:
        """The trainer sends the policy module itself to the engines (vLLM NCCL transfer): no export needed."""
        return bool(getattr(self.runtime, "broadcasts_weights", False))

    def complete_step(
        self, weights: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]] | torch.nn.Module | None
    ) -> dict[str, Any]:
        """Retire the finished step and refit the workers with ``weights``: a state dict, or the buckets of the
        weight export (called by WeightSync on every rank; only rank 0's weights go to the controller)."""
        if self.colocated:  # the engine holds the trainer's module: nothing to send (the export is never drawn)
            return self._on_rank_zero(lambda: self.runtime.complete_step_in_place(changed=weights is not None))
        if isinstance(weights, torch.nn.Module):  # the NCCL broadcast: rank 0 sends (a replicated module)
            return self._on_rank_zero(lambda: self.runtime.complete_step(weights))
        if weights is not None and not isinstance(weights, Mapping) and self._world_size() > 1 and \
                self._global_rank() != 0:
            for _ in weights:  # a bucketed export is a collective: every rank takes part in each bucket
                pass
        return self._on_rank_zero(lambda: self.runtime.complete_step(weights))

    def finish_validation(self) -> list[dict[str, Any]]:
        """At the end of training: the final validation (``val_at_end``) and every result not yet logged, as
        ``{"version", "metrics"}`` (called by WeightSync on every rank)."""
        if self.val_task is None or not self._started:
            return []
        def finish() -> list[dict[str, Any]]:
            if self.colocated:  # the last validation decodes on the colocated engine
                self.runtime.wake()
            return self.runtime.finish_validation()  # type: ignore[no-any-return]

        return self._with_engine(finish)


def _held_out(task: Task, val_task: Task | None, algo: Any, key: str) -> Task | None:
    """The validation prompts: ``val_task``, else the task's ``val_prompts()``; an error if validation is on and
    there are none (before anything starts)."""
    from screl.envs import HeldOut

    chosen = val_task if val_task is not None else (HeldOut(task) if task.val_prompts() else None)
    wanted = algo.val_period or algo.val_at_start or algo.val_at_end
    if wanted and (chosen is None or not chosen.prompts()):
        raise ValueError(
            f"validation is on ({key}.val_period={algo.val_period}, val_at_start={algo.val_at_start}, val_at_end="
            f"{algo.val_at_end}) but there are no held-out prompts: give data.init_args.val_task, or a task with "
            f"val_prompts() (e.g. CountLetter(holdout=20)), or turn validation off")
    return chosen if wanted else None
