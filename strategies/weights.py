"""Full (un-sharded) weights out of, and Hugging Face weights into, a tensor/pipeline-parallel ``GPTModel``.

:func:`iter_export_buckets` gathers the model's shards bucket by bucket on every rank (the same
collectives, in the same order, everywhere) and yields full tensors named as a Hugging Face Qwen2/Qwen3/Llama
checkpoint names them, which is what the generation engines load. :func:`load_hf_weights` is the
inverse: each rank copies its slice of a Hugging Face state dict into its shard.

Megatron's layouts that differ from Hugging Face's:

- ``linear_qkv`` interleaves per key/value group ``[q heads of the group, k, v]``, each head
  ``kv_channels`` (Hugging Face ``head_dim``) rows wide, which need not be ``hidden_size / heads``; tensor
  parallelism splits whole groups, so the shards concatenate to the full interleaved matrix.
- Qwen3's per-head ``q_norm``/``k_norm`` are ``self_attention.q_layernorm``/``k_layernorm``, replicated over
  tensor-parallel ranks.
- A gated MLP's ``linear_fc1`` holds ``[gate; up]`` *per shard*: the full gate is the concatenation of
  every shard's first half.
- The embedding (and an untied output layer) has padded vocabulary rows, dropped on export.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from screl.strategies.provider import UNPADDED_VOCAB_ATTR
from torch import Tensor

__all__ = ["Naming", "export_weights", "iter_export_buckets", "load_hf_weights", "load_megatron_bucket",
           "megatron_parameter_names"]

Naming = Literal["hf", "megatron"]

DEFAULT_BUCKET_BYTES = 256 * 2**20

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_TOP_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.final_layernorm.bias": "model.norm.bias",
    "output_layer.weight": "lm_head.weight",
}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class _Layout:
    """What the name conversion needs to know about the model."""

    num_query_groups: int
    heads_per_group: int
    head_dim: int
    gated: bool
    vocab_size: int


@dataclass(frozen=True)
class _ParamMeta:
    name: str  # Megatron name with the global layer index
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: int | None  # None: replicated across tensor-parallel ranks

    @property
    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n


def _layout(module: MegatronModule) -> _Layout:
    cfg = module.config
    groups = cfg.num_query_groups or cfg.num_attention_heads
    return _Layout(
        num_query_groups=groups,
        heads_per_group=cfg.num_attention_heads // groups,
        head_dim=cfg.kv_channels,
        gated=bool(cfg.gated_linear_unit),
        vocab_size=int(getattr(module, UNPADDED_VOCAB_ATTR, getattr(module, "vocab_size", 0))),
    )


def _global_name(module: MegatronModule, name: str) -> str:
    m = _LAYER.match(name)
    if m is None:
        return name
    layer = module.decoder.layers[int(m.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"


def _local_params(module: MegatronModule, tied_copy: bool = True) -> list[tuple[_ParamMeta, Tensor]]:
    """This rank's parameters; ``tied_copy=False`` leaves out the last pipeline stage's copy of tied embeddings."""
    out = []
    skip = not tied_copy and bool(getattr(module, "share_embeddings_and_output_weights", False))
    for name, p in module.named_parameters():
        if skip and name == "output_layer.weight":  # PP > 1: the first stage exports the embedding it copies
            continue
        if ".experts." in name:
            raise NotImplementedError(f"export_weights: expert (MoE) parameters are not supported ({name}).")
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        out.append((_ParamMeta(_global_name(module, name), tuple(p.shape), p.dtype, dim), p.detach()))
    return out


def _hf_names(meta_name: str, layout: _Layout) -> list[str]:
    """The Hugging Face name(s) of one full Megatron parameter."""
    if meta_name in _TOP_NAMES:
        return [_TOP_NAMES[meta_name]]
    m = _LAYER.match(meta_name)
    if m is not None:
        i, rest = m.group(1), m.group(2)
        prefix = f"model.layers.{i}."
        if rest in _LAYER_NAMES:
            return [prefix + _LAYER_NAMES[rest]]
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
        if rest == "mlp.linear_fc1.weight" and layout.gated:
            return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    raise ValueError(
        f"export_weights: no Hugging Face (Qwen2/Qwen3/Llama) name for Megatron parameter {meta_name!r}; "
        "use naming='megatron'."
    )


def _split_qkv(full: Tensor, layout: _Layout) -> list[Tensor]:
    g, q, d = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    grouped = full.reshape(g, q + 2, d, *full.shape[1:])
    rest = full.shape[1:]
    return [
        grouped[:, :q].reshape(g * q * d, *rest),
        grouped[:, q].reshape(g * d, *rest),
        grouped[:, q + 1].reshape(g * d, *rest),
    ]


def _merge_qkv(q: Tensor, k: Tensor, v: Tensor, layout: _Layout) -> Tensor:
    g, qh, d = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(g, qh, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1
    )
    return grouped.reshape(g * (qh + 2) * d, *rest)


def _unshard(meta: _ParamMeta, shards: list[Tensor], layout: _Layout) -> Tensor:
    """One parameter's full tensor in the tensor-parallel-size-1 layout, vocabulary padding dropped."""
    if meta.partition_dim is None:
        full = shards[0]
    elif _LAYER.sub(r"\2", meta.name) == "mlp.linear_fc1.weight" and layout.gated:
        halves = [s.chunk(2, dim=0) for s in shards]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    else:
        full = torch.cat(shards, dim=meta.partition_dim)
    if meta.name in _VOCAB and layout.vocab_size:
        full = full[: layout.vocab_size]
    return full


def _buckets(metas: list[_ParamMeta], bucket_bytes: int) -> Iterator[list[int]]:
    bucket: list[int] = []
    size = 0
    for i, m in enumerate(metas):
        nbytes = m.numel * m.dtype.itemsize
        if bucket and (size + nbytes > bucket_bytes or metas[bucket[0]].dtype != m.dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(i)
        size += nbytes
    if bucket:
        yield bucket


def _full_shape(meta: _ParamMeta, tp: int, layout: _Layout) -> tuple[int, ...]:
    shape = list(meta.local_shape)
    if meta.partition_dim is not None:
        shape[meta.partition_dim] *= tp
    if meta.name in _VOCAB and layout.vocab_size:
        shape[0] = layout.vocab_size
    return tuple(shape)


def _gather_bucket(
    metas: list[_ParamMeta], local: list[Tensor] | None, tp: int, device: torch.device
) -> list[list[Tensor]]:
    """All-gather one bucket's local shards over tensor parallel: per parameter, the ``tp`` shards."""
    numels = [m.numel for m in metas]
    if local is not None:
        flat = torch.cat([t.reshape(-1) for t in local])
    else:
        flat = torch.empty(sum(numels), dtype=metas[0].dtype, device=device)
    if tp == 1:
        per_rank = [flat]
    else:
        per_rank = [torch.empty_like(flat) for _ in range(tp)]
        dist.all_gather(per_rank, flat, group=parallel_state.get_tensor_model_parallel_group())
    out: list[list[Tensor]] = []
    offset = 0
    for m, n in zip(metas, numels, strict=True):
        out.append([r[offset : offset + n].view(m.local_shape) for r in per_rank])
        offset += n
    return out


def _broadcast_full(
    metas: list[_ParamMeta],
    full: list[Tensor] | None,
    src: int,
    tp: int,
    device: torch.device,
    layout: _Layout,
) -> list[Tensor]:
    """Broadcast one bucket's full tensors from pipeline stage ``src`` (a global rank) to its stage peers."""
    shapes = [_full_shape(m, tp, layout) for m in metas]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if full is not None:
        flat = torch.cat([t.reshape(-1) for t in full])
    else:
        flat = torch.empty(sum(numels), dtype=metas[0].dtype, device=device)
    dist.broadcast(flat, src=src, group=parallel_state.get_pipeline_model_parallel_group())
    out, offset = [], 0
    for s, n in zip(shapes, numels, strict=True):
        out.append(flat[offset : offset + n].view(s))
        offset += n
    return out


def iter_export_buckets(
    module: MegatronModule,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    naming: Naming = "hf",
    device: torch.device | str | None = "cpu",
) -> Iterator[dict[str, Tensor]]:
    """Yield the model's full weights in buckets of about ``bucket_bytes`` of local shards, on every rank.

    Every rank must call it and consume every bucket: the gathers are collectives. ``naming="hf"``:
    Qwen2/Qwen3/Llama names (``model.layers.0.self_attn.q_proj.weight``, ...); ``"megatron"``: Megatron's
    names with global layer indices, in the tensor-parallel-size-1 layout. Each bucket holds about
    ``bucket_bytes x tensor-parallel size`` at its peak. ``device``: where the yielded tensors go
    (``None``: stay on the parameters' device).
    """
    layout = _layout(module)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if tp > 1 and layout.num_query_groups % tp:
        raise ValueError(
            f"export_weights: num_query_groups={layout.num_query_groups} must be a multiple of "
            f"tensor_model_parallel_size={tp}."
        )
    params = _local_params(module, tied_copy=False)
    param_device = params[0][1].device if params else torch.device("cpu")
    out_device = None if device is None else torch.device(device)
    stages = _pipeline_stages([m for m, _ in params], pp)
    own = {m.name: t for m, t in params}
    rank = dist.get_rank()
    for src, metas in stages:
        owner = pp == 1 or src == rank
        for idx in _buckets(metas, bucket_bytes):
            bucket = [metas[i] for i in idx]
            full: list[Tensor] | None = None
            if owner:
                shards = _gather_bucket(bucket, [own[m.name] for m in bucket], tp, param_device)
                full = [_unshard(m, s, layout) for m, s in zip(bucket, shards, strict=True)]
            if pp > 1:
                full = _broadcast_full(bucket, full, src, tp, param_device, layout)
            assert full is not None
            out: dict[str, Tensor] = {}
            for m, t in zip(bucket, full, strict=True):
                out.update(_rename(m, t, layout, naming))
            yield {k: (v if out_device is None else v.to(out_device)).clone() for k, v in out.items()}


def _pipeline_stages(metas: list[_ParamMeta], pp: int) -> list[tuple[int, list[_ParamMeta]]]:
    """(source rank, parameter metadata) of every pipeline stage: each stage broadcasts its own list."""
    if pp == 1:
        return [(0, metas)]
    group = parallel_state.get_pipeline_model_parallel_group()
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    stages: list[tuple[int, list[_ParamMeta]]] = []
    for stage, src in enumerate(dist.get_process_group_ranks(group)):
        box: list[object] = [metas if stage == my_stage else None]
        dist.broadcast_object_list(box, src=src, group=group)
        stages.append((src, box[0]))  # type: ignore[arg-type]
    return stages


def _rename(meta: _ParamMeta, full: Tensor, layout: _Layout, naming: Naming) -> dict[str, Tensor]:
    """Name one full tensor already in the tensor-parallel-size-1 Megatron layout."""
    if naming == "megatron":
        return {meta.name: full}
    names = _hf_names(meta.name, layout)
    short = _LAYER.sub(r"\2", meta.name)
    if short in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return dict(zip(names, _split_qkv(full, layout), strict=True))
    if short == "mlp.linear_fc1.weight" and layout.gated:
        return dict(zip(names, full.chunk(2, dim=0), strict=True))
    return {names[0]: full}


def export_weights(
    module: MegatronModule,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    naming: Naming = "hf",
    device: torch.device | str | None = "cpu",
) -> dict[str, Tensor]:
    """All of :func:`iter_export_buckets` in one dict (for models that fit in memory twice)."""
    out: dict[str, Tensor] = {}
    for bucket in iter_export_buckets(module, bucket_bytes, naming, device):
        out.update(bucket)
    return out


def _local_slice(meta: _ParamMeta, full: Tensor, layout: _Layout, tp: int, tp_rank: int) -> Tensor:
    """This rank's shard of a full (TP=1 layout, unpadded vocab) Megatron tensor."""
    if meta.name in _VOCAB:
        rows = meta.local_shape[0] * (tp if meta.partition_dim == 0 else 1)
        if full.shape[0] < rows:
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    if meta.partition_dim is None:
        return full
    short = _LAYER.sub(r"\2", meta.name)
    if short == "mlp.linear_fc1.weight" and layout.gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=meta.partition_dim)[tp_rank]


def load_hf_weights(module: MegatronModule, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
    """Copy a Hugging Face Qwen2/Qwen3/Llama state dict into this rank's shard (no collectives).

    ``strict``: every model parameter must be found and, without pipeline parallelism, every Hugging Face key
    used (``lm_head.weight`` may be left over when the model ties it to the embedding).
    """
    layout = _layout(module)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    used: set[str] = set()
    missing: list[str] = []
    with torch.no_grad():
        for meta, param in _local_params(module):
            names = _hf_names(meta.name, layout)
            if any(n not in state_dict for n in names):
                missing.extend(n for n in names if n not in state_dict)
                continue
            used.update(names)
            parts = [state_dict[n].to(param.dtype) for n in names]
            short = _LAYER.sub(r"\2", meta.name)
            if short in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                full = _merge_qkv(parts[0], parts[1], parts[2], layout)
            else:
                full = torch.cat(parts, dim=0)
            local = _local_slice(meta, full, layout, tp, tp_rank)
            if tuple(local.shape) != meta.local_shape:
                raise ValueError(
                    f"load_hf_weights: {names} give shape {tuple(local.shape)} for {meta.name}, "
                    f"expected {meta.local_shape} on this rank."
                )
            param.copy_(local)
    if strict:
        # under pipeline parallelism the other stages' layers (and ends of the model) are left over by design
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        unused = sorted(set(state_dict) - used - {"lm_head.weight"}) if pp == 1 else []
        if missing or unused:
            raise KeyError(f"load_hf_weights: missing keys {missing[:5]}, unexpected keys {unused[:5]}.")


def load_megatron_bucket(module: MegatronModule, bucket: Mapping[str, Tensor]) -> list[str]:
    """Copy a bucket of :func:`iter_export_buckets`' ``naming="megatron"`` output (full tensors in the
    tensor-parallel-size-1 layout, global layer indices, vocabulary unpadded) into this rank's shard, in place;
    returns the names it loaded. No collectives: each rank slices its own shard (the Megatron generation engine's
    refit, :mod:`screl.rollout.engines.megatron_engine`).

    Raises ``KeyError`` for a name the model does not have and ``ValueError`` for a tensor whose shape does not
    give this rank's shard; nothing of the bucket is copied then.
    """
    layout = _layout(module)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    params = {meta.name: (meta, param) for meta, param in _local_params(module)}
    unknown = sorted(set(bucket) - set(params))
    if unknown:
        raise KeyError(f"load_megatron_bucket: names the model does not have: {unknown[:5]} ({len(unknown)} in all); "
                       "the engine loads Megatron's own names (iter_export_buckets(naming='megatron'))")
    local: list[tuple[Tensor, Tensor]] = []
    for name, full in bucket.items():
        meta, param = params[name]
        if meta.name in _VOCAB and layout.vocab_size and full.shape[0] != layout.vocab_size:
            raise ValueError(f"load_megatron_bucket: {name} has {full.shape[0]} vocabulary rows, the model "
                             f"{layout.vocab_size}")
        piece = _local_slice(meta, full, layout, tp, tp_rank)
        if tuple(piece.shape) != meta.local_shape:
            raise ValueError(f"load_megatron_bucket: {name} of shape {tuple(full.shape)} gives {tuple(piece.shape)} "
                             f"on this rank, expected {meta.local_shape}")
        local.append((param, piece))
    with torch.no_grad():
        for param, piece in local:
            param.copy_(piece)
    return list(bucket)


def megatron_parameter_names(module: MegatronModule) -> list[str]:
    """The names :func:`load_megatron_bucket` takes, one per parameter of this rank (global layer indices)."""
    return [meta.name for meta, _ in _local_params(module)]
