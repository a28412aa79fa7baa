"""Jobs that ``test_distributed_optimizer.py`` runs in spawned gloo ranks (``_megatron_jobs.spawn``).

Every job trains the tiny Qwen2-layout model of ``_megatron_jobs`` from the same Hugging Face weights on the same
global batches, with per-token loss (so data-parallel replicas give the one-process gradient), clipping and AdamW
with weight decay; the distributed optimizer replaces the AdamW through ``MegatronStrategy.distribute_optimizer``
(what ``setup_optimizers`` does under a Trainer).
"""

from __future__ import annotations

import os
from typing import Any

import _megatron_jobs as jobs
import torch
from torch import Tensor

WEIGHT_DECAY = 0.1
STEPS = jobs.STEPS


def make(tp: int = 1, world: int = 1, pp: int = 1, distributed: bool = True) -> Any:
    """A ``MegatronStrategy`` set up by hand on the running process group, its AdamW swapped when ``distributed``."""
    strategy = jobs.make_strategy(tp, world, per_token=True, pp=pp, weight_decay=WEIGHT_DECAY,
                                  use_distributed_optimizer=distributed)
    if distributed:
        strategy.optimizers = [strategy.distribute_optimizer(strategy.optimizers[0])]
    return strategy


def step(strategy: Any, index: int, pipelined: bool = False) -> tuple[float, float]:
    """One optimizer step on this rank's share of global batch ``index``: (loss, gradient norm before clipping)."""
    mbs = jobs.microbatches(jobs.dp_shard(jobs.batch(index)), 1)
    loss = jobs.TokenSumLoss()
    if pipelined:
        value = strategy.forward_backward(
            mbs, lambda m, mb: m(mb["ids"], torch.arange(mb["ids"].shape[1]).expand_as(mb["ids"]), None),
            jobs.FromLogits(strategy, loss))
    else:
        value = strategy.forward_backward(mbs, lambda m, mb: jobs.logprobs(strategy, m, mb), loss)
    norm = strategy.clip_gradients(jobs.MAX_GRAD_NORM)
    strategy.optimizers[0].step()
    strategy.optimizers[0].zero_grad()
    strategy.zero_grad_buffers()
    return float(value), float(norm)


def train(strategy: Any, start: int, stop: int, pipelined: bool = False) -> dict[str, list[Any]]:
    """Steps ``start..stop-1``: each step's loss and gradient norm, and the exported weights after each."""
    record: dict[str, list[Any]] = {"loss": [], "grad_norm": [], "weights": []}
    for i in range(start, stop):
        loss, norm = step(strategy, i, pipelined)
        record["loss"].append(loss)
        record["grad_norm"].append(norm)
        record["weights"].append(strategy.export_weights())
    return record


def shard_sizes(strategy: Any) -> dict[str, int]:
    """Elements of fp32 main parameters and Adam moments this rank holds, and the model's parameter elements."""
    opt = strategy.optimizers[0]
    inner = opt.megatron.optimizer
    mains = [p for g in inner.param_groups for p in g["params"]]
    return {
        "main": sum(p.numel() for p in mains),
        "exp_avg": sum(inner.state[p]["exp_avg"].numel() for p in mains),
        "main_dtypes": sorted({str(p.dtype) for p in mains}),  # type: ignore[dict-item]
        "model": sum(p.numel() for p in strategy.lightning_module.parameters()),
    }


def reference_job(rank: int, out: str) -> None:
    """One process: the torch AdamW path (the reference), then the distributed optimizer at DP=1."""
    from screl.strategies.parallel import destroy_model_parallel

    result: dict[str, Any] = {}
    s = make(distributed=False)
    result["torch"] = train(s, 0, STEPS + 1)
    destroy_model_parallel(remove_shim=False)
    s = make()
    result["dp1"] = train(s, 0, STEPS + 1)
    result["dp1_shards"] = shard_sizes(s)
    destroy_model_parallel(remove_shim=False)
    torch.save(result, out)


def _save(strategy: Any, path: str) -> None:
    jobs.save(strategy, path, STEPS)


def _errors(path: str) -> dict[str, str]:
    """What the strategy says to the mistakes it refuses (each message, or '' when nothing was raised)."""
    from screl.strategies.parallel import destroy_model_parallel

    said: dict[str, str] = {}
    s = make(world=2, distributed=False)  # a torch-AdamW strategy meets the distributed optimizer's checkpoint
    try:
        jobs.load(s, path)
        said["torch_loads_distributed"] = ""
    except ValueError as err:
        said["torch_loads_distributed"] = str(err)
    try:
        s.distribute_optimizer(torch.optim.SGD(s.lightning_module.parameters(), lr=0.1))
        said["sgd"] = ""
    except TypeError as err:
        said["sgd"] = str(err)
    try:
        s.distribute_optimizer(torch.optim.AdamW(list(s.lightning_module.parameters())[:2], lr=0.1))
        said["subset"] = ""
    except ValueError as err:
        said["subset"] = str(err)
    destroy_model_parallel(remove_shim=False)
    return said


def parallel_job(rank: int, out: str) -> None:
    """Two ranks: DP=2 training and checkpoint; resume at DP=2 and at TP=2 (DP=1); PP=2; refusals."""
    from screl.strategies.parallel import destroy_model_parallel

    result: dict[str, Any] = {}
    path = os.path.join(os.path.dirname(out), "ckpt_dp2")
    s = make(world=2)
    result["dp2"] = train(s, 0, STEPS)
    result["dp2_shards"] = shard_sizes(s)
    _save(s, path)
    result["ckpt_files"] = sorted(os.listdir(path))
    result["dp2"]["next"] = train(s, STEPS, STEPS + 1)
    destroy_model_parallel(remove_shim=False)

    for name, kwargs in (("resume_dp2", {}), ("resume_tp2", {"tp": 2})):
        s = make(world=2, **kwargs)
        loaded = jobs.load(s, path)
        result[name] = {"global_step": loaded["global_step"], **train(s, STEPS, STEPS + 1)}
        result[name]["step_state"] = sorted(
            {float(st["step"]) for st in s.optimizers[0].megatron.optimizer.state.values()}
        )
        destroy_model_parallel(remove_shim=False)

    s = make(world=2, pp=2)
    result["pp2"] = train(s, 0, STEPS, pipelined=True)
    destroy_model_parallel(remove_shim=False)

    result["errors"] = _errors(path)
    torch.save(result, f"{out}.{rank}")


def weights_close(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """The largest absolute difference between two exported weight dicts with the same keys."""
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def ppo_job(rank: int, out: str) -> None:
    """One of 2 ranks: ``test_ppo_megatron``'s PPO step (policy and critic AdamW, a LambdaLR on the critic, eps
    raised by a callback through ``param_groups``) under a real Trainer at TP=2 with the distributed optimizer."""
    from lightning.pytorch import Trainer
    from screl.strategies import MegatronStrategy, ParallelismConfig
    from test_ppo_megatron import Record, _Once, make_ppo

    chunk = torch.load(os.path.join(os.path.dirname(out), "chunk.pt"))
    module, record = make_ppo(0), Record()
    strategy = MegatronStrategy(
        parallelism=ParallelismConfig(tensor_model_parallel_size=2), use_distributed_optimizer=True
    )
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )
    trainer.fit(module, train_dataloaders=_Once(chunk))
    optimizers = [type(o).__name__ for o in strategy.optimizers]
    torch.save({**record.out, "optimizers": optimizers, "update_counts": dict(module.update_counts)}, f"{out}.{rank}")
