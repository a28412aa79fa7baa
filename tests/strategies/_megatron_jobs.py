"""Jobs that ``test_megatron_strategy.py`` runs in spawned gloo ranks; each writes its results to a file.

Every job trains the same tiny Qwen2-layout model (initialized from one Hugging Face state dict) on the
same global batches with AdamW, so results from different parallel layouts compare directly.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

GLOBAL_BATCH = 4
SEQ = 12
STEPS = 3
LR = 1e-2
MAX_GRAD_NORM = 0.5
ADAM_EPS = 1e-3
"""Adam divides each gradient by its own running magnitude, which turns float-rounding differences in
near-zero gradients into O(lr) weight differences; a large eps keeps the update linear there, so layouts
can be compared tightly over several steps."""


def hf_model() -> Any:
    """The tiny Hugging Face model whose weights every job starts from."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=43,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg).eval()


def batch(step: int) -> dict[str, Tensor]:
    """The global batch of step ``step``: token ids and a loss mask over next-token targets."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 43, (GLOBAL_BATCH, SEQ), generator=g)
    mask = (torch.rand(GLOBAL_BATCH, SEQ - 1, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    return {"ids": ids, "mask": mask}


def rows(b: dict[str, Tensor], start: int, stop: int) -> dict[str, Tensor]:
    return {k: v[start:stop] for k, v in b.items()}


def microbatches(b: dict[str, Tensor], n: int) -> list[dict[str, Tensor]]:
    size = b["ids"].shape[0] // n
    return [rows(b, i * size, (i + 1) * size) for i in range(n)]


def dp_shard(b: dict[str, Tensor]) -> dict[str, Tensor]:
    """This data-parallel rank's rows of a global batch."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    size = b["ids"].shape[0] // dp
    return rows(b, rank * size, (rank + 1) * size)


def logprobs(strategy: Any, model: torch.nn.Module, mb: dict[str, Tensor]) -> Tensor:
    ids = mb["ids"]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, pos, None)
    return strategy.token_logprobs(logits[:, :-1], ids[:, 1:])


class MeanLoss:
    """Masked token mean per microbatch (Megatron averages it over microbatches and DP ranks)."""

    def forward(self, batch: dict[str, Tensor], output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        loss = -(output * batch["mask"]).sum() / batch["mask"].sum()
        return loss, {"loss": loss.detach()}

    def reduce(self, values: list[dict[str, Tensor]]) -> Tensor:
        return torch.stack([v["loss"] for v in values]).mean()


class TokenSumLoss:
    """Masked token sum with its token count: Megatron's per-token loss (``calculate_per_token_loss``)."""

    def forward(self, batch: dict[str, Tensor], output: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        loss = -(output * batch["mask"]).sum()
        n = batch["mask"].sum().to(torch.int)
        return loss, n, {"sum": loss.detach(), "n": n.detach().float()}

    def reduce(self, values: list[dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
        return torch.stack([v["sum"] for v in values]).sum(), torch.stack([v["n"] for v in values]).sum()


class FromLogits:
    """``loss`` over the logprobs of the last pipeline stage's logits (earlier stages return hidden states)."""

    def __init__(self, strategy: Any, loss: Any) -> None:
        self.strategy, self.loss = strategy, loss

    def forward(self, batch: dict[str, Tensor], output: Tensor) -> Any:
        ids = batch["ids"]
        return self.loss.forward(batch, self.strategy.token_logprobs(output[:, :-1], ids[:, 1:]))

    def reduce(self, values: list[dict[str, Tensor]]) -> Any:
        return self.loss.reduce(values)


def make_strategy(
    tp: int, world: int, per_token: bool = False, pp: int = 1, weight_decay: float | None = None, **strategy_args: Any
) -> Any:
    """A ``MegatronStrategy`` set up by hand (no Trainer) on the already-initialized process group, with a torch
    AdamW (``weight_decay``: None keeps torch's default); ``strategy_args`` go to the strategy."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from screl.strategies import GPTModelProvider, MegatronStrategy, ParallelismConfig, load_hf_weights

    hf = hf_model()
    provider = GPTModelProvider.from_hf_config(hf.config, calculate_per_token_loss=per_token)
    strategy = MegatronStrategy(
        parallelism=ParallelismConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        model_provider=provider,
        **strategy_args,
        accelerator=CPUAccelerator(),
        parallel_devices=[torch.device("cpu")] * world,
        cluster_environment=LightningEnvironment(),
    )
    module = LightningModule()
    strategy.connect(module)
    strategy.setup_environment()
    module.model = strategy.build_model()
    load_hf_weights(module.model, hf.state_dict(), strict=pp == 1)  # a stage holds its layers only
    strategy.wrap_megatron_modules()
    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    strategy.optimizers = [torch.optim.AdamW(module.parameters(), lr=LR, eps=ADAM_EPS, **decay)]
    return strategy


def model_of(strategy: Any) -> Any:
    return strategy.lightning_module.model


def full_grads(strategy: Any) -> dict[str, Tensor]:
    """The reduced gradients, gathered to full tensors in Hugging Face naming (test-only: swaps data)."""
    inner = model_of(strategy).module
    saved = {}
    with torch.no_grad():
        for name, p in inner.named_parameters():
            saved[name] = p.data.clone()
            p.data.copy_(p.main_grad)
    grads = strategy.export_weights()
    with torch.no_grad():
        for name, p in inner.named_parameters():
            p.data.copy_(saved[name])
    return grads


def train_step(
    strategy: Any, b: dict[str, Tensor], n_micro: int, loss: Any, record: dict[str, list[Any]] | None,
    pipelined: bool = False,
) -> float:
    """One optimizer step on this rank's share of ``b`` split into ``n_micro`` microbatches."""
    mbs = microbatches(dp_shard(b), n_micro)
    if pipelined:  # the model's output is hidden states on every stage but the last
        value = strategy.forward_backward(
            mbs, lambda m, mb: m(mb["ids"], torch.arange(mb["ids"].shape[1]).expand_as(mb["ids"]), None),
            FromLogits(strategy, loss))
    else:
        value = strategy.forward_backward(mbs, lambda m, mb: logprobs(strategy, m, mb), loss)
    norm = strategy.clip_gradients(MAX_GRAD_NORM)
    if record is not None:
        record["grads"].append(full_grads(strategy))
        record["grad_norm"].append(float(norm))
    strategy.optimizers[0].step()
    strategy.zero_grad_buffers()
    return float(value)


def probe_loss(strategy: Any) -> float:
    b = dp_shard(batch(99))
    return float(
        strategy.forward_backward(
            [b], lambda m, mb: logprobs(strategy, m, mb), TokenSumLoss(), forward_only=True
        )
    )


def save(strategy: Any, path: str, step: int) -> None:
    checkpoint = {
        "state_dict": strategy.lightning_module_state_dict(),
        "optimizer_states": [strategy.optimizer_state(strategy.optimizers[0])],
        "global_step": step,
    }
    strategy.save_checkpoint(checkpoint, path)


def load(strategy: Any, path: str) -> dict[str, Any]:
    loaded = strategy.load_checkpoint(path)
    strategy.load_model_state_dict(loaded)
    strategy.load_optimizer_state_dict(loaded)
    return loaded


def run_training(strategy: Any, n_micro: int, loss: Any, steps: int, pipelined: bool = False) -> dict[str, list[Any]]:
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "grad_norm": []}
    for step in range(steps):
        record["loss"].append(train_step(strategy, batch(step), n_micro, loss, record, pipelined))
    return record


def register_stage_fs() -> None:
    """A non-local fsspec protocol (``stagetest://``) over the local disk, to exercise checkpoint staging."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class StageTestFileSystem(LocalFileSystem):
        protocol = ("stagetest",)

    fsspec.register_implementation("stagetest", StageTestFileSystem, clobber=True)


# ----------------------------------------------------------------------------------------- jobs
def reference_job(rank: int, out: str) -> None:
    """World size 1 (TP=1, DP=1): the reference numbers, plus Megatron-vs-Hugging-Face logits."""
    from screl.strategies.parallel import destroy_model_parallel

    hf = hf_model()
    result: dict[str, Any] = {}
    s = make_strategy(tp=1, world=1)
    ids = batch(0)["ids"]
    with torch.no_grad():
        logits = model_of(s)(ids, torch.arange(SEQ).expand_as(ids), None)
        result["logit_diff"] = float((logits[..., :43] - hf(ids).logits).abs().max())
        result["logprob_diff"] = float(
            (
                s.token_logprobs(logits[:, :-1], ids[:, 1:])
                - torch.log_softmax(hf(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            )
            .abs()
            .max()
        )
    result["export0"] = s.export_weights()
    result["mean"] = run_training(s, n_micro=2, loss=MeanLoss(), steps=STEPS)
    result["mean"]["export"] = s.export_weights()
    result["probe_after"] = probe_loss(s)
    result["mean"]["next_loss"] = train_step(s, batch(STEPS), 2, MeanLoss(), None)
    result["mean"]["next_export"] = s.export_weights()
    destroy_model_parallel(remove_shim=False)
    s = make_strategy(tp=1, world=1)
    result["plain"] = run_training(s, n_micro=1, loss=MeanLoss(), steps=STEPS)
    destroy_model_parallel(remove_shim=False)
    s = make_strategy(tp=1, world=1, per_token=True)
    result["tokens"] = run_training(s, n_micro=2, loss=TokenSumLoss(), steps=STEPS)
    result["tokens"]["export"] = s.export_weights()
    torch.save(result, out)


def parallel_job(rank: int, out: str) -> None:
    """World size 2: TP=2 training, export and checkpoint; then TP=1 (DP=2) reload and DP=2 training."""
    from screl.strategies.parallel import destroy_model_parallel

    register_stage_fs()
    result: dict[str, Any] = {}
    s = make_strategy(tp=2, world=2)
    result["export0"] = s.export_weights()
    result["tp2"] = run_training(s, n_micro=2, loss=MeanLoss(), steps=STEPS)
    result["tp2"]["export"] = s.export_weights()
    result["tp2"]["probe_after"] = probe_loss(s)
    url = f"stagetest://{os.path.dirname(out)}/ckpt_tp2"
    save(s, url, STEPS)
    result["ckpt_files"] = sorted(os.listdir(f"{os.path.dirname(out)}/ckpt_tp2"))
    destroy_model_parallel(remove_shim=False)

    s = make_strategy(tp=1, world=2)  # DP=2, fresh weights, then the TP=2 checkpoint
    loaded = load(s, url)
    result["tp1_reload"] = {
        "global_step": loaded["global_step"],
        "probe": probe_loss(s),
        "next_loss": train_step(s, batch(STEPS), 1, MeanLoss(), None),
        "next_export": s.export_weights(),
    }
    destroy_model_parallel(remove_shim=False)

    s = make_strategy(tp=1, world=2, per_token=True)
    result["dp2"] = run_training(s, n_micro=1, loss=TokenSumLoss(), steps=STEPS)
    result["dp2"]["export"] = s.export_weights()
    destroy_model_parallel(remove_shim=False)

    s = make_strategy(tp=1, world=2, pp=2)  # tied embeddings: the last stage's copy starts as the first's
    result["pp2"] = run_training(s, n_micro=2, loss=MeanLoss(), steps=STEPS, pipelined=True)
    result["pp2"]["export"] = s.export_weights()
    destroy_model_parallel(remove_shim=False)

    result["pp2_export"] = pipeline_export()
    torch.save(result, f"{out}.{rank}")


def pipeline_export() -> dict[str, Any]:
    """PP=2 export of a model with untied embeddings (each stage holds only its own end of the model)."""
    from megatron.core import parallel_state
    from screl.strategies import GPTModelProvider, ParallelismConfig, export_weights, load_hf_weights
    from screl.strategies.parallel import initialize_model_parallel
    from transformers import Qwen2ForCausalLM

    initialize_model_parallel(ParallelismConfig(pipeline_model_parallel_size=2), seed=0, cpu=True)
    config = hf_model().config
    config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        hf = Qwen2ForCausalLM(config)
    stage = GPTModelProvider.from_hf_config(config)(
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    load_hf_weights(stage, hf.state_dict(), strict=False)
    exported = export_weights(stage, bucket_bytes=4096)
    return {
        "exported": exported,
        "expected": hf.state_dict(),
        "local": [n for n, _ in stage.named_parameters()],
    }


def lightning_job(rank: int, out: str) -> None:
    """World size 2, TP=2, through ``lightning.Trainer``: fit, checkpoint, resume one more step."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from screl.strategies import GPTModelProvider, MegatronStrategy, ParallelismConfig, load_hf_weights

    hf = hf_model()
    root = os.path.dirname(out)

    class Batches(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __init__(self, start: int, stop: int) -> None:
            self.start, self.stop = start, stop

        def __iter__(self) -> Any:
            return (batch(i) for i in range(self.start, self.stop))

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.losses: list[float] = []

        @property
        def megatron(self) -> MegatronStrategy:
            strategy = self.trainer.strategy
            assert isinstance(strategy, MegatronStrategy)
            return strategy

        def configure_model(self) -> None:
            if self.model is None:
                self.model = self.megatron.build_model()
                load_hf_weights(self.model, hf.state_dict())

        def training_step(self, b: dict[str, Tensor], idx: int) -> Tensor:
            mbs = microbatches(b, 2)
            loss = self.megatron.forward_backward(
                mbs, lambda m, mb: logprobs(self.megatron, m, mb), MeanLoss()
            )
            self.losses.append(float(loss))
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.megatron.clip_gradients(MAX_GRAD_NORM)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR, eps=ADAM_EPS)

    def trainer(max_steps: int, **kwargs: Any) -> Trainer:
        strategy = MegatronStrategy(
            parallelism=ParallelismConfig(tensor_model_parallel_size=2),
            model_provider=GPTModelProvider.from_hf_config(hf.config),
        )
        return Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=[ModelCheckpoint(dirpath=f"{root}/ckpts", filename="last", every_n_train_steps=STEPS)],
            **kwargs,
        )

    first = Module()
    trainer(STEPS).fit(
        first, train_dataloaders=torch.utils.data.DataLoader(Batches(0, STEPS), batch_size=None)
    )
    resumed = Module()
    trainer(STEPS + 1).fit(
        resumed,
        train_dataloaders=torch.utils.data.DataLoader(Batches(STEPS, STEPS + 1), batch_size=None),
        ckpt_path=f"{root}/ckpts/last.ckpt",
    )

    class PlainModule(Module):
        def training_step(self, b: dict[str, Tensor], idx: int) -> Tensor:
            """Automatic optimization without ``forward_backward``: Lightning backpropagates the loss."""
            out = logprobs(self.megatron, self.model, b)
            loss = -(out * b["mask"]).sum() / b["mask"].sum()
            self.losses.append(float(loss.detach()))
            return loss

    class ManualModule(Module):
        """Manual optimization, as screl's GRPO does: ``manual_backward``, clip, ``opt.step()``."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, b: dict[str, Tensor], idx: int) -> Tensor:
            opt = self.optimizers()
            assert not isinstance(opt, list)
            loss = torch.zeros(())
            for mb in microbatches(b, 2):  # accumulate two half-batches: the same full-batch gradient
                out = logprobs(self.megatron, self.model, mb)
                part = -(out * mb["mask"]).sum() / b["mask"].sum()
                self.manual_backward(part)
                loss = loss + part.detach()
            self.megatron.clip_gradients(MAX_GRAD_NORM)
            opt.step()
            opt.zero_grad()
            self.losses.append(float(loss))
            return loss

    manual = ManualModule()
    trainer(STEPS).fit(
        manual, train_dataloaders=torch.utils.data.DataLoader(Batches(0, STEPS), batch_size=None)
    )
    plain = PlainModule()
    trainer(STEPS).fit(
        plain, train_dataloaders=torch.utils.data.DataLoader(Batches(0, STEPS), batch_size=None)
    )
    try:
        trainer(1, gradient_clip_val=1.0).fit(
            Module(), train_dataloaders=torch.utils.data.DataLoader(Batches(0, 1), batch_size=None)
        )
        clip_error = ""
    except ValueError as err:
        clip_error = str(err)
    torch.save(
        {
            "clip_error": clip_error,
            "fit": first.losses,
            "resumed": resumed.losses,
            "plain": plain.losses,
            "manual": manual.losses,
            "ckpt_is_dir": os.path.isdir(f"{root}/ckpts/last.ckpt"),
        },
        f"{out}.{rank}",
    )


# ------------------------------------------------------------------------------------- launcher
def _entry(rank: int, job: Callable[[int, str], None], world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        job(rank, out)
    finally:
        dist.destroy_process_group()


def spawn(job: Callable[[int, str], None], world: int, workdir: str) -> str:
    """Run ``job`` on ``world`` gloo ranks over loopback (file:// rendezvous); returns its output path."""
    os.makedirs(workdir, exist_ok=True)
    init_file = tempfile.mktemp(dir=workdir, prefix="pg_")
    out = os.path.join(workdir, "result.pt")
    mp.spawn(_entry, args=(job, world, init_file, out), nprocs=world, join=True)
    return out
