"""``RowSchema``: the one declaration of a rollout row's fields (writer, data-plane read and collate use it).

A row is one sibling: the prompt and completion tokens, the prompt length, the sampled tokens' logprobs and
weight versions (one per completion token), and the reward. Each ``RowField`` also says how it collates
into a training chunk (its ``kind``), so a workflow that adds a field (a loss mask over the model's own
tokens, a value estimate) adds one ``RowField`` here: the writer, the data-plane read, ``collate_chunk``
and the data-parallel shard (``screl.datamodule.ROW_KEYS``) all follow from the schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from screl.models.vision_inputs import VisionInputs
from screl.rollout.engines.protocol import GenerationResult

Kind = Literal["sequence", "prompt_len", "per_completion_token", "completion_mask", "scalar", "per_sequence_token",
               "per_row"]
KINDS: tuple[str, ...] = get_args(Kind)

_SEQUENCE_DERIVED = ("attention_mask", "token_mask")  # from the sequence and the prompt length
_CHUNK_DERIVED = ("start_weight",)  # from the chunk's metadata
_DEFAULT_MASK = "sample_mask"  # all ones when no field collates to it
#: Per-row tensors of a collated chunk that no field names.
DERIVED_KEYS = _SEQUENCE_DERIVED + _CHUNK_DERIVED

#: ``finish_reason`` codes in a row (and in a collated chunk's ``finish_reason``).
FINISH_CODES = {"stop": 0, "length": 1, "abort": 2}


@dataclass(frozen=True)
class RowField:
    """One tensor of a rollout row, and how it collates into a training chunk.

    ``kind``:

    * ``sequence``: the prompt + completion token ids (exactly one per schema). Collated right-padded
      with ``pad_id`` into ``(rows, length)``, with ``attention_mask`` (1 on real tokens) and
      ``token_mask`` (``(rows, length - 1)``, 1 where position ``j`` predicts a completion token).
    * ``prompt_len``: ``[prompt length]`` (exactly one). Places the completion; not collated itself.
    * ``per_completion_token``: one value (of any trailing shape) per completion token. Collated next-token aligned
      like ``token_mask``: row ``i``'s values at positions ``p - 1 .. p - 2 + resp``, ``fill`` elsewhere, into
      ``(rows, length - 1, ...)`` (a distillation teacher's top-k ids and logprobs carry a trailing ``k``).
    * ``completion_mask``: one 0/1 value per completion token (exactly one per schema), multiplied into
      ``token_mask``: a multi-turn row's environment and tool tokens carry 0, so the loss, the advantages'
      token weights and the IS diagnostics see the model's own tokens only. Not collated itself.
    * ``scalar``: ``[value]``. Collated stacked into ``(rows,)``.
    * ``per_sequence_token``: one value (of any trailing shape) per prompt and completion token, aligned with the
      sequence: collated right-padded with ``fill`` into ``(rows, length, ...)`` (the MoE routing of routing replay).
    * ``per_row``: a tensor of any leading length per row (a prompt's image patches): collated right-padded with
      ``fill`` along its first dimension into ``(rows, longest, ...)``.

    ``collate_as``: the name in the collated chunk (default ``name``). ``fill`` (per_completion_token):
    the value where no completion token is predicted; a ``str`` names the chunk-metadata key whose value
    is used (``"trainer_version"``).
    """

    name: str
    dtype: torch.dtype
    doc: str
    kind: Kind
    collate_as: str | None = None
    fill: float | str = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"row field {self.name!r}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def collated(self) -> tuple[str, ...]:
        """This field's per-row tensors in a collated chunk."""
        if self.kind in ("prompt_len", "completion_mask"):
            return ()
        own = self.collate_as or self.name
        return (own, *_SEQUENCE_DERIVED) if self.kind == "sequence" else (own,)


@dataclass(frozen=True)
class _Chunk:
    """Where each row's tokens sit in a collated chunk."""

    meta: Mapping[str, Any]
    pad_id: int
    lengths: tuple[int, ...]  # prompt + completion tokens, per row
    prompts: tuple[int, ...]  # prompt tokens, per row

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Collated sequence length: the longest row (an empty chunk's tensors are ``(0, 1)``)."""
        return max(self.lengths) if self.lengths else 1

    @property
    def token_width(self) -> int:
        """Next-token-aligned length: one less than ``width`` (an empty chunk's: 1)."""
        return self.width - 1 if self.lengths else 1


Collate = Callable[[RowField, Sequence[torch.Tensor], _Chunk], dict[str, torch.Tensor]]


def _sequence(field: RowField, column: Sequence[torch.Tensor], chunk: _Chunk) -> dict[str, torch.Tensor]:
    ids = torch.full((chunk.rows, chunk.width), chunk.pad_id, dtype=field.dtype)
    attention = torch.zeros((chunk.rows, chunk.width), dtype=torch.long)
    token_mask = torch.zeros((chunk.rows, chunk.token_width))
    for i, (n, p) in enumerate(zip(chunk.lengths, chunk.prompts, strict=True)):
        ids[i, :n] = column[i].to(field.dtype)
        attention[i, :n] = 1
        token_mask[i, p - 1:n - 1] = 1.0
    name, attention_key, token_key = field.collated
    return {name: ids, attention_key: attention, token_key: token_mask}


def _per_completion_token(field: RowField, column: Sequence[torch.Tensor],
                          chunk: _Chunk) -> dict[str, torch.Tensor]:
    fill = chunk.meta[field.fill] if isinstance(field.fill, str) else field.fill
    fill = float(fill) if field.dtype.is_floating_point else int(fill)
    trailing = tuple(column[0].shape[1:]) if chunk.rows else ()
    out = torch.full((chunk.rows, chunk.token_width, *trailing), fill, dtype=field.dtype)
    for i, (n, p) in enumerate(zip(chunk.lengths, chunk.prompts, strict=True)):
        out[i, p - 1:n - 1] = column[i].to(field.dtype).reshape(-1, *trailing)[:n - p]
    return {field.collated[0]: out}


def _scalar(field: RowField, column: Sequence[torch.Tensor], chunk: _Chunk) -> dict[str, torch.Tensor]:
    if not chunk.rows:
        return {field.collated[0]: torch.zeros(0, dtype=field.dtype)}
    return {field.collated[0]: torch.stack([v.to(field.dtype).reshape(-1)[0] for v in column])}


def _not_collated(field: RowField, column: Sequence[torch.Tensor], chunk: _Chunk) -> dict[str, torch.Tensor]:
    return {}  # the prompt length only places the completion (in the other kinds)


def _completion_mask(field: RowField, column: Sequence[torch.Tensor], chunk: _Chunk) -> dict[str, torch.Tensor]:
    return {}  # applied to token_mask in RowSchema.collate, once the sequence field has made it


def _per_sequence_token(field: RowField, column: Sequence[torch.Tensor], chunk: _Chunk) -> dict[str, torch.Tensor]:
    trailing = tuple(column[0].shape[1:]) if chunk.rows else ()
    out = torch.full((chunk.rows, chunk.width, *trailing), float(field.fill), dtype=field.dtype)
    for i, n in enumerate(chunk.lengths):
        if column[i].shape[0] != n:
            raise ValueError(f"row field {field.name!r}: {column[i].shape[0]} positions for a sequence of {n} tokens")
        out[i, :n] = column[i].to(field.dtype)
    return {field.collated[0]: out}


def _per_row(field: RowField, column: Sequence[torch.Tensor], chunk: _Chunk) -> dict[str, torch.Tensor]:
    trailing = tuple(column[0].shape[1:]) if chunk.rows else ()
    longest = max((int(t.shape[0]) for t in column), default=0)
    out = torch.full((chunk.rows, longest, *trailing), float(field.fill), dtype=field.dtype)
    for i, value in enumerate(column):
        out[i, :value.shape[0]] = value.to(field.dtype)
    return {field.collated[0]: out}


_COLLATE: dict[str, Collate] = {
    "sequence": _sequence,
    "prompt_len": _not_collated,
    "per_completion_token": _per_completion_token,
    "completion_mask": _completion_mask,
    "scalar": _scalar,
    "per_sequence_token": _per_sequence_token,
    "per_row": _per_row,
}


@dataclass(frozen=True)
class RowSchema:
    fields: tuple[RowField, ...]

    def __post_init__(self) -> None:
        for kind in ("sequence", "prompt_len", "completion_mask"):
            count = sum(f.kind == kind for f in self.fields)
            if count != 1:
                raise ValueError(f"a RowSchema needs exactly one {kind!r} field, got {count}")
        for what, names in (("field", self.names), ("collated", self.collated_keys)):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"{what} names {twice} appear more than once in the RowSchema")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def collated_keys(self) -> tuple[str, ...]:
        """Per-row tensors of a collated chunk (what a data-parallel shard slices), in ``collate``'s order."""
        own = tuple(k for f in self.fields for k in f.collated)
        return own + (() if _DEFAULT_MASK in own else (_DEFAULT_MASK,)) + _CHUNK_DERIVED

    def of_kind(self, kind: Kind) -> RowField:
        """The schema's one field of ``kind`` (``sequence``, ``prompt_len`` or ``completion_mask``)."""
        return next(f for f in self.fields if f.kind == kind)

    def build(self, result: GenerationResult, reward: float,
              extra: Mapping[str, Sequence[float] | Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
        """The row of one finished single-turn sample; ``extra`` holds the values of fields beyond the five
        standard ones (a workflow that declares a field supplies it here)."""
        values: dict[str, Sequence[float] | Sequence[int] | torch.Tensor] = {
            "input_ids": list(result.prompt_token_ids) + list(result.token_ids),
            "loss_mask": [1.0] * len(result.token_ids),
            "prompt_len": [len(result.prompt_token_ids)],
            "generation_logprobs": result.logprobs,
            "token_versions": result.weight_versions,
            "reward": [reward],
            "raw_reward": [reward],
            "finish_reason": [FINISH_CODES[result.finish_reason]],
            "sample_mask": [1.0],
            **({"routing": result.routing} if result.routing is not None else {}),
            **(vision_row(result.vision) if result.vision is not None else {}),
            **(extra or {}),
        }
        return self.tensors(values, "pass them to build(..., extra=...)")

    def tensors(self, values: Mapping[str, Sequence[float] | Sequence[int] | torch.Tensor],
                fix: str) -> dict[str, torch.Tensor]:
        """The row of these per-field values, each in its field's dtype (ValueError, ending with ``fix``, naming
        any field without values)."""
        missing = [name for name in self.names if name not in values]
        if missing:
            raise ValueError(f"no values for the row fields {missing}: {fix}")
        return {f.name: (v.to(f.dtype) if isinstance(v := values[f.name], torch.Tensor) else torch.tensor(v, dtype=f.dtype))
                for f in self.fields}

    def merge(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """Per-field lists for one data-plane put; every row must have exactly the schema's fields."""
        for row in rows:
            if set(row) != set(self.names):
                raise ValueError(f"a row has fields {sorted(row)}, the schema {sorted(self.names)}")
        return {name: [row[name] for row in rows] for name in self.names}

    def collate(self, meta: Mapping[str, Any], data: Mapping[str, Sequence[torch.Tensor]],
                pad_id: int) -> dict[str, torch.Tensor]:
        """The per-row training tensors (``collated_keys``) of the chunk of rows ``meta["keys"]``.

        ``data`` holds each field's rows (as the data plane returns them; may be empty for no rows);
        ``meta`` the chunk's ``trainer_version`` (and any other ``fill`` key) and ``start_weight``."""
        rows = len(meta["keys"])
        columns = {f.name: data[f.name] if rows else [] for f in self.fields}
        sequence, prompt_len = self.of_kind("sequence"), self.of_kind("prompt_len")
        chunk = _Chunk(meta, pad_id, tuple(int(t.numel()) for t in columns[sequence.name]),
                       tuple(int(t.reshape(-1)[0]) for t in columns[prompt_len.name]))
        out: dict[str, torch.Tensor] = {}
        for f in self.fields:
            out.update(_COLLATE[f.kind](f, columns[f.name], chunk))
        mask = self.of_kind("completion_mask")
        seq_keys = sequence.collated
        out[seq_keys[2]] = out[seq_keys[2]] * _per_completion_token(
            RowField(mask.name, torch.float32, mask.doc, "per_completion_token", fill=0.0), columns[mask.name], chunk
        )[mask.name]
        out.setdefault(_DEFAULT_MASK, torch.ones(rows))
        out["start_weight"] = torch.tensor(meta["start_weight"] if rows else [], dtype=torch.long)
        return out


ROW_SCHEMA = RowSchema((
    RowField("input_ids", torch.int64, "prompt + completion token ids", "sequence"),
    RowField("prompt_len", torch.int64, "[prompt length]", "prompt_len"),
    RowField("loss_mask", torch.float32, "1 on the model's own completion tokens, 0 on environment and tool tokens "
             "(a multi-turn row): multiplied into token_mask", "completion_mask"),
    RowField("generation_logprobs", torch.float32, "sampled-token logprobs, one per completion token",
             "per_completion_token", fill=0.0),
    RowField("token_versions", torch.int64, "weight version that sampled each completion token",
             "per_completion_token", fill="trainer_version"),
    RowField("reward", torch.float32, "[reward] (after reward shaping and scaling)", "scalar", collate_as="rewards"),
    RowField("raw_reward", torch.float32, "[the task's reward, before shaping and scaling]", "scalar",
             collate_as="raw_rewards"),
    RowField("finish_reason", torch.int64, "[FINISH_CODES: 0 stop, 1 length, 2 abort]", "scalar"),
    RowField("sample_mask", torch.float32, "[1: trains; 0: masked by the task or environment]", "scalar"),
))

#: Fields of every rollout row in the data plane.
ROW_FIELDS = ROW_SCHEMA.names

#: Rollout routing replay (``model.init_args.routing_replay``): the engine's routing travels in the row.
ROUTING = RowField("routing", torch.int16, "[prompt + completion tokens, MoE layers, top_k]: the experts the engine "
                   "routed each token to (-1: not fed to the engine)", "per_sequence_token", fill=-1)
ROUTING_SCHEMA = RowSchema((*ROW_SCHEMA.fields, ROUTING))

#: A vision-language policy's rows (:mod:`screl.models.vision`): the prompt's processed images travel with the row, so
#: the trainer recomputes the logprobs on exactly the pixels the engine saw (docs/multimodal.md: measured cost).
PIXEL_VALUES = RowField("pixel_values", torch.float32, "[patches, channels x temporal x patch x patch]: the prompt's "
                        "images as the processor made them (padded with 0 in a chunk)", "per_row", fill=0.0)
IMAGE_GRID = RowField("image_grid_thw", torch.int64, "[images, 3]: each image's patch grid (padded with 0 rows in a "
                      "chunk)", "per_row", fill=0)
VISION_SCHEMA = RowSchema((*ROW_SCHEMA.fields, PIXEL_VALUES, IMAGE_GRID))


def vision_row(vision: VisionInputs) -> dict[str, torch.Tensor]:
    """The row values of a prompt's processed images."""
    return {PIXEL_VALUES.name: vision.pixel_values, IMAGE_GRID.name: vision.image_grid_thw}


def vision_of_rows(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> VisionInputs:
    """The images of collated rows (``[rows, patches, dim]`` and ``[rows, images, 3]``, zero-padded) as one forward
    pass takes them: the padding dropped, images in row order."""
    grids, pixels = [], []
    for row_pixels, row_grid in zip(pixel_values, image_grid_thw, strict=True):
        grid = row_grid[row_grid.prod(-1) > 0]
        grids.append(grid)
        pixels.append(row_pixels[: int(grid.prod(-1).sum())])
    return VisionInputs(torch.cat(pixels), torch.cat(grids))
