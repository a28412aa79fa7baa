"""Megatron-core's ``DistributedOptimizer`` behind a torch optimizer, for ``MegatronStrategy(use_distributed_optimizer=True)``.

The LightningModule configures a plain ``torch.optim.AdamW`` over its Megatron model; the strategy swaps it for a
:class:`DistributedAdam` in ``setup_optimizers``. That builds megatron-core's own optimizer
(``get_megatron_optimizer`` with ``use_distributed_optimizer=True``) with the AdamW's hyperparameters, so:

- each data-parallel rank keeps the fp32 main parameters and the Adam moments of its 1/DP share of every gradient
  buffer only (megatron's ``DistributedDataParallel`` reduce-scatters the gradients, the optimizer updates the
  share, then all-gathers the parameters);
- bf16 models get fp32 master weights (megatron's ``main_param`` shards); fp32 models update in place;
- the LightningModule, its LR schedulers and Lightning see a torch ``Optimizer``: ``param_groups`` *are* the
  AdamW's (a scheduler bound to the AdamW still sets the learning rate, copied into megatron's groups at each
  step), ``step(closure)``, ``zero_grad()``; ``state`` is megatron's inner optimizer's (this rank's shards).

On CPU (gloo) every call into megatron's optimizer runs inside :func:`screl.strategies.cpu_shim.megatron_optimizer_calls`:
megatron-core 0.16.1 allocates its scratch tensors with ``device="cuda"`` and sorts parameters by their CUDA type
names (see :class:`~screl.strategies.cpu_shim.CudaNamesOnCpu`). Gloo does the reduce-scatter and all-gather itself.

Checkpoints use megatron's ``fully_reshardable`` layout: the state is gathered to parameter shapes and sharded like
the parameters, so a checkpoint resumes at another data- or tensor-parallel size (megatron-core 0.16.1 refuses
its default, ``fully_sharded_model_space``: "ShardedTensor.flattened_range is not supported").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import AdamOptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as MegatronDistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer
from screl.strategies import cpu_shim
from torch.optim import Optimizer

__all__ = ["SHARDING_TYPE", "DistributedAdam", "is_distributed_state"]

SHARDING_TYPE = "fully_reshardable"
"""Megatron's checkpoint layout of the optimizer state: parameter-shaped, resharded on load (any DP/TP size)."""

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def is_distributed_state(saved: Mapping[str, Any]) -> bool:
    """Whether a saved optimizer state (its common part) was written by a :class:`DistributedAdam`."""
    return "param_state_sharding_type" in saved


def _hyperparameters(group: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(float(v) if torch.is_tensor(v) else v for v in (group[k] for k in _HYPERPARAMETERS))


def _uniform_hyperparameters(optimizer: Optimizer) -> dict[str, Any]:
    """The (single) lr, betas, eps and weight decay of ``optimizer``'s parameter groups."""
    found = {_hyperparameters(g) for g in optimizer.param_groups}
    if len(found) != 1:
        raise ValueError(
            "MegatronStrategy(use_distributed_optimizer=True) needs one lr, betas, eps and weight_decay for all "
            f"parameter groups of an optimizer; got {sorted(found, key=str)}. Configure one AdamW per module."
        )
    return dict(zip(_HYPERPARAMETERS, next(iter(found)), strict=True))


def _check_source(optimizer: Optimizer) -> None:
    """Refuse what megatron's distributed Adam cannot reproduce (it is decoupled-weight-decay Adam)."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError(
            f"MegatronStrategy(use_distributed_optimizer=True) replaces a torch AdamW, got {type(optimizer).__name__}: "
            "configure torch.optim.AdamW (megatron's distributed optimizer is Adam)."
        )
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay"))
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("MegatronStrategy(use_distributed_optimizer=True): amsgrad and maximize are not supported.")
        if not decoupled and group["weight_decay"]:
            raise ValueError(
                "MegatronStrategy(use_distributed_optimizer=True): torch.optim.Adam with weight_decay (L2 in the "
                "gradient) has no megatron counterpart; use torch.optim.AdamW."
            )


def _single(optimizer: Any) -> MegatronDistributedOptimizer:
    """The one ``DistributedOptimizer`` inside what ``get_megatron_optimizer`` returned (no expert parameters)."""
    inner = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    if len(inner) != 1 or not isinstance(inner[0], MegatronDistributedOptimizer):
        raise NotImplementedError(
            "MegatronStrategy(use_distributed_optimizer=True) supports dense models only (one DistributedOptimizer "
            f"per torch optimizer), got {[type(o).__name__ for o in inner]}."
        )
    return inner[0]


class DistributedAdam(Optimizer):
    """Megatron's ``DistributedOptimizer`` (Adam, state sharded over data parallel) in place of a torch AdamW.

    Args:
        source: The torch ``AdamW`` the LightningModule configured over the parameters of ``modules``; its
            hyperparameters are read now and its ``param_groups`` at every step (LR schedulers keep working).
        modules: The Megatron ``DistributedDataParallel`` modules the optimizer updates, built with
            ``DistributedDataParallelConfig(use_distributed_optimizer=True)``; ``source`` must cover exactly
            their trainable parameters.
    """

    def __init__(self, source: Optimizer, modules: Sequence[DistributedDataParallel]) -> None:
        _check_source(source)
        hyper = _uniform_hyperparameters(source)
        self._check_covers(source, modules)
        model_config = modules[0].module.config
        if model_config.fp16:
            raise ValueError(
                "MegatronStrategy(use_distributed_optimizer=True) does not scale fp16 losses; use bf16 or fp32."
            )
        config = AdamOptimizerConfig(
            lr=float(hyper["lr"]),
            weight_decay=float(hyper["weight_decay"]),
            adam_beta1=float(hyper["betas"][0]),
            adam_beta2=float(hyper["betas"][1]),
            adam_eps=float(hyper["eps"]),
            decoupled_weight_decay=True,
            use_distributed_optimizer=True,
            clip_grad=0.0,  # the strategy clips (clip_gradients), by the norm of this rank's shards
            bf16=bool(model_config.bf16),
            params_dtype=model_config.params_dtype,
        )
        with cpu_shim.megatron_optimizer_calls():
            # config_overrides={}: weight decay on every parameter, as the torch AdamW it replaces does
            built = get_megatron_optimizer(config, list(modules), config_overrides={})
        super().__init__([p for g in source.param_groups for p in g["params"]], dict(source.defaults))
        self.param_groups = source.param_groups
        self.source = source
        self.megatron = _single(built)
        self.modules = list(modules)
        self.state = self.megatron.optimizer.state  # type: ignore[assignment]

    @staticmethod
    def _check_covers(source: Optimizer, modules: Sequence[DistributedDataParallel]) -> None:
        mine = {id(p) for g in source.param_groups for p in g["params"]}
        theirs = {id(p) for m in modules for p in m.module.parameters() if p.requires_grad}
        if not modules or mine != theirs:
            raise ValueError(
                "MegatronStrategy(use_distributed_optimizer=True): an optimizer must update exactly the trainable "
                f"parameters of its Megatron modules ({len(mine)} parameters given, {len(mine & theirs)} of them in "
                f"the modules, which hold {len(theirs)}). Build it from e.g. self.model.parameters()."
            )

    # ---------------------------------------------------------------------------------- stepping
    def _sync_hyperparameters(self) -> None:
        """Copy lr, betas, eps and weight decay (set by the LightningModule or a scheduler) into megatron's groups."""
        hyper = _uniform_hyperparameters(self)
        for group in self.megatron.optimizer.param_groups:
            group.update(hyper)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (with gradients on), then megatron's step: copy this rank's share of the reduced
        gradients, Adam on it, all-gather the parameters over data parallel. Returns the closure's value."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        with cpu_shim.megatron_optimizer_calls():
            ok, _, _ = self.megatron.step()
        if not ok:  # only a loss scaler reports a skipped step, and fp16 is refused
            raise RuntimeError("megatron's DistributedOptimizer skipped a step (inf/nan in the gradients).")
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of the model parameters and of this rank's main-parameter shards."""
        with cpu_shim.megatron_optimizer_calls():
            self.megatron.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The global L2 norm of the reduced gradients: this rank's shard, summed over all ranks (each element once:
        data-parallel shards are disjoint, tensor-parallel duplicates and shared embeddings are skipped).
        Call after the gradients are reduced (``MegatronStrategy.finalize_gradients``); a collective."""
        with cpu_shim.megatron_optimizer_calls():
            self.megatron.prepare_grads()
            return float(self.megatron.get_grad_norm())

    # ---------------------------------------------------------------------------------- checkpoints
    def _ensure_state(self) -> None:
        """Allocate Adam's state (step 0, zero moments) where no step has run yet: megatron's ``state_dict``
        reads the step from it, and a checkpoint is loaded into it in place."""
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        inner = self.megatron.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {
                        "step": torch.zeros((), dtype=scalar),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }

    def sharded_state(self, model_sharded_state: Mapping[str, Any], is_loading: bool = False) -> dict[str, Any]:
        """Megatron's sharded state dict (``fully_reshardable``) for ``dist_checkpointing``: parameter groups and
        the step in the common part, the fp32 main parameters and moments sharded like the model's parameters
        (``model_sharded_state``). ``is_loading``: the template to load into. A collective (it gathers over DP)."""
        self._ensure_state()
        with cpu_shim.megatron_optimizer_calls():
            return dict(
                self.megatron.sharded_state_dict(
                    dict(model_sharded_state),
                    is_loading=is_loading,
                    metadata={"distrib_optim_sharding_type": SHARDING_TYPE},
                )
            )

    def load_sharded_state(self, loaded: Mapping[str, Any]) -> None:
        """Load a state that :meth:`sharded_state` saved (common part merged with this rank's tensors)."""
        if not is_distributed_state(loaded):
            raise ValueError(
                "This checkpoint's optimizer state was saved without use_distributed_optimizer; resume it with "
                "MegatronStrategy(use_distributed_optimizer=False)."
            )
        common = dict(loaded)
        param_state = common.pop("param_state")
        if common.pop("param_state_sharding_type") != SHARDING_TYPE:
            raise ValueError(f"Expected a distributed optimizer state saved as {SHARDING_TYPE!r}.")
        self._ensure_state()
        inner = self.megatron.optimizer
        with cpu_shim.megatron_optimizer_calls():
            self.megatron.load_state_dict(common)  # parameter groups and the step
            # megatron-core 0.16.1 copies every key of a parameter's torch state from the loaded tensors, which
            # have no "step" (torch's AdamW keeps one per parameter; TE/apex Adam keep it in the groups)
            steps = {p: state.pop("step") for p, state in inner.state.items()}
            try:
                self.megatron.load_parameter_state_from_fully_reshardable(param_state)
            finally:
                for p, value in steps.items():  # megatron set one tensor for all: one each, as torch keeps it
                    inner.state[p]["step"] = value.clone()

    def state_dict(self) -> dict[str, Any]:
        """Not a torch state dict: this rank holds a shard. Checkpoint through ``MegatronStrategy``."""
        raise TypeError(
            "DistributedAdam holds this rank's shard of the optimizer state; save it through MegatronStrategy's "
            "checkpoints (trainer.save_checkpoint / ModelCheckpoint), which write it with dist_checkpointing."
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """See :meth:`state_dict`."""
        raise TypeError(
            "DistributedAdam loads its shard through MegatronStrategy's checkpoints (fit(ckpt_path=...))."
        )
