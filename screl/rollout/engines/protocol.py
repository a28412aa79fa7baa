"""The generation engine protocol: one request per sample, per-token logprobs and weight versions.

Shaped after vLLM's ``AsyncLLM`` (docs/generation.md) so a vLLM engine slots in behind it:
``SamplingParams`` maps onto vLLM's (``max_new_tokens`` -> ``max_tokens``, ``min_new_tokens`` ->
``min_tokens``, ``top_k=None`` -> ``0``, ``logprobs=0``), ``abort`` and ``pause``/``resume`` onto
``abort`` / ``pause_generation(mode=...)`` / ``resume_generation``, and per-token weight versions onto
``CompletionOutput.weight_versions`` spans.

**Logprob convention.** ``GenerationResult.logprobs[i]`` is ``log_softmax(logits / temperature)`` of
the sampled token over the *whole* vocabulary: temperature-scaled, but before top-k/top-p truncation
and before the ``min_new_tokens`` EOS mask (vLLM: ``logprobs_mode="processed_logprobs"`` with top-k/top-p
off). The trainer computes the same quantity from its own forward pass, so with a single weight
version the behaviour logprobs equal the trainer's. ``temperature == 0`` is greedy decoding and
reports ``log_softmax(logits)`` (temperature 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from screl.models.vision_inputs import VisionInputs

FinishReason = Literal["length", "stop", "abort"]
PauseMode = Literal["abort", "wait", "keep"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion."""

    max_new_tokens: int = 16
    """Completion length cap (vLLM ``max_tokens``)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 is off."""
    top_k: int | None = None
    """Keep the k most likely tokens; None is off."""
    min_new_tokens: int = 0
    """Stop tokens are masked out until this many tokens exist; equal to ``max_new_tokens`` gives fixed-length
    completions (vLLM ``min_tokens``)."""
    seed: int | None = None
    """Per-request seed: the same seed, prompt and weights give the same completion, whatever the batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the model's (:mod:`screl.rollout.engines.stop_tokens`: the tokenizer's EOS, the
    generation config's EOS ids and the chat template's end-of-turn token)."""
    ignore_eos: bool = False
    """Never stop at the model's stop tokens (stop_token_ids still stop)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams(max_new_tokens={self.max_new_tokens}) must be >= 1.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"SamplingParams(min_new_tokens={self.min_new_tokens}) must be in [0, max_new_tokens="
                f"{self.max_new_tokens}]."
            )
        if self.temperature < 0:
            raise ValueError(f"SamplingParams(temperature={self.temperature}) must be >= 0 (0 = greedy).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams(top_p={self.top_p}) must be in (0, 1].")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"SamplingParams(top_k={self.top_k}) must be >= 1, or None for off.")


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate."""

    request_id: str
    """Unique among requests in flight on an engine; ``abort`` addresses it."""
    prompt_token_ids: Sequence[int]
    """The tokenized prompt (non-empty)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    """Lower is more urgent (vLLM's ``priority``): a worker holding requests of several priorities decodes the
    most urgent ones first, in a batch of their own. The controller sets a group's target step, so at start-up
    step 0 is not held back by decoding step 1 beside it."""
    vision: VisionInputs | None = None
    """A vision-language policy's prompt: its processed images (``prompt_token_ids`` holds their placeholder
    tokens); None for a text prompt."""


@dataclass
class GenerationResult:
    """One finished (or aborted) sample."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Sampled tokens, including a final stop token when ``finish_reason == "stop"``."""
    logprobs: list[float]
    """Per sampled token: ``log_softmax(logits / temperature)[token]`` (see the module docstring)."""
    finish_reason: FinishReason
    """``length`` (hit max_new_tokens), ``stop`` (sampled a stop token: which one and by which rule in
    ``stop_token_id`` and ``stop_kind``) or ``abort`` (partial tokens)."""
    weight_versions: list[int]
    """Per sampled token: the weight version of the forward pass whose logits produced it."""
    start_version: int
    """Engine weight version when the request started (its prefill)."""
    end_version: int
    """Engine weight version when the request finished."""
    stop_token_id: int | None = None
    """With ``finish_reason == "stop"``: the token that stopped it (the last of ``token_ids``); else None."""
    stop_kind: str | None = None
    """With ``finish_reason == "stop"``: which rule that token belongs to (:mod:`screl.rollout.engines.stop_tokens`):
    ``eos`` (the tokenizer's), ``generation_config`` (its ``eos_token_id`` list), ``end_of_turn`` (the chat
    template's) or ``request`` (``SamplingParams.stop_token_ids`` only); else None."""
    num_cached_tokens: int | None = None
    """Prompt tokens the engine read from its prefix cache instead of computing them (vLLM's
    ``RequestOutput.num_cached_tokens``); None where the engine keeps no prefix cache (torch)."""
    routing: torch.Tensor | None = None
    """Rollout routing replay (a mixture-of-experts policy, the engine recording): ``[prompt + completion
    positions, MoE layers, top_k]`` int16, the experts each layer chose for each position the engine fed (``-1`` for
    the last sampled token, never fed); None otherwise (:mod:`screl.rollout.engines.routing`)."""

    vision: VisionInputs | None = None
    """The request's processed images (a vision-language prompt), echoed so the row carries them; else None."""

    def weight_version_spans(self) -> list[tuple[int, int, int]]:
        """``(version, start, end)`` runs over output-token indexes, as vLLM reports them."""
        spans: list[tuple[int, int, int]] = []
        for i, v in enumerate(self.weight_versions):
            if spans and spans[-1][0] == v:
                spans[-1] = (v, spans[-1][1], i + 1)
            else:
                spans.append((v, i, i + 1))
        return spans


@dataclass(frozen=True)
class EngineOptions:
    """What a generation worker tells the backend class it builds (from ``data.init_args.generation``)."""

    device: str = "cpu"
    """Torch device for the model (``cpu``, ``cuda``)."""
    num_threads: int | None = 1
    """Torch intra-op threads of the worker process (None: leave the setting alone)."""
    max_batch_size: int | None = None
    """Requests decoded together."""
    recompute_kv_cache_after_weight_updates: bool = False
    """Re-prefill in-flight sequences under new weights after a refit (else keep the old KV cache)."""
    seed: int | None = None
    """Seeds requests that carry no seed of their own."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """Backend-specific settings (``generation.backend_args``), passed through untouched."""
    record_routing: bool = False
    """Record each token's MoE routing in its result (``GenerationResult.routing``): rollout routing replay
    (``model.init_args.routing_replay``); an engine that cannot refuses it."""


BACKEND_ARGS_KEY = "data.init_args.generation.backend_args"


@dataclass(frozen=True)
class BackendArgs:
    """The ``generation.backend_args`` an engine takes (its ``capabilities.backend_args``): the keys with their
    defaults, so the defaults live with the engine and the rules read them from here."""

    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Each key it takes and the value it uses when the config leaves the key out."""
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    """The values a key may take, where the key has a fixed set (the engine refuses others)."""
    open: bool = True
    """It takes keys beyond ``defaults`` too, passed through (a plugin's own, vLLM's engine arguments)."""
    note: str = ""
    """Said after what it takes when it refuses a key (why it takes no more)."""

    def value(self, given: Mapping[str, Any] | None, key: str) -> Any:
        """``key``'s value under the configured ``given`` backend_args: the given one, else the default."""
        return (given or {}).get(key, self.defaults.get(key))

    def resolve(self, given: Mapping[str, Any] | None, engine: str) -> dict[str, Any]:
        """The defaults overridden by ``given``; ``ValueError`` names a key the engine does not take."""
        args = dict(given or {})
        unknown = [] if self.open else sorted(set(args) - set(self.defaults))
        if unknown:
            takes = "only " + ", ".join(
                f"{k!r} ({'|'.join(map(str, self.choices[k]))})" if k in self.choices else repr(k) for k in self.defaults
            ) if self.defaults else "none"
            note = f" ({self.note})" if self.note else ""
            raise ValueError(f"{BACKEND_ARGS_KEY}={args!r}: the {engine} backend takes {takes}{note}, not {unknown}")
        return {**self.defaults, **args}


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine class declares it can do (its ``capabilities`` class attribute). ``screl check`` refuses a
    feature the configured engine lacks, naming the key, and the runtime asks these instead of the engine's name.
    The defaults are the least an engine must do: a class that declares nothing gets them."""

    continuous_batching: bool = False
    """Requests join a running decode (the worker submits each group at once); else a call's rows decode together."""
    whole_call_batches: bool = False
    """A call's rows decode as one batch to its end, so the controller may merge a step's groups into one call."""
    streams_weight_buckets: bool = False
    """``update_weights`` takes an iterable of buckets, loaded one at a time in place."""
    weight_transfers: tuple[str, ...] = ("object_store",)
    """How refits reach it: ``object_store`` (exported buckets), ``nccl`` (broadcast from the trainer)."""
    weight_naming: str = "hf"
    """The weight names it loads: Hugging Face's (``hf``) or Megatron's (``megatron``)."""
    colocated: bool = False
    """It decodes with the trainer's module in the trainer's process (``generation.colocated``): its class builds
    that engine with ``on_trainer_module(policy, options, model=, autocast=, link=)``."""
    colocated_tensor_parallel: bool = False
    """Colocated across the trainer's tensor-parallel ranks (under MegatronStrategy), not in one process only: its
    class links the ranks, ``link_ranks(module, autocast, world_size)`` on every rank (:class:`RankLink`)."""
    vision_inputs: bool = False
    """Requests may carry images (vision-language policies)."""
    routing_records: bool = False
    """It returns each token's MoE routing (``model.init_args.routing_replay``)."""
    on_generation_device: bool = True
    """It runs where ``generation.device`` says (else it places itself, e.g. on the GPUs Ray gives it)."""
    claims_gpu_memory_share: bool = False
    """It preallocates a share of a GPU's memory (``backend_args.gpu_memory_utilization``; placement checks it)."""
    streams_tokens: bool = False
    """``partial_tokens(request_ids)`` gives each in-flight request's tokens so far (the policy server streams a
    reply's text as it is generated); else a streamed reply's text comes when it is done."""
    kv_cache_gib: str | None = None
    """``package.module:function`` of ``fn(backend_args) -> GiB | None``: the KV cache it holds from its start under
    these settings (placement counts it on a GPU the trainer shares); None: it allocates as it goes."""
    eos_masked_logprobs: bool = False
    """Its logprobs of the first ``min_new_tokens`` tokens are of the EOS-masked distribution (the trainer's are not)."""
    backend_args: BackendArgs = field(default_factory=BackendArgs)
    """The ``generation.backend_args`` it takes and their defaults (an engine that declares none is passed them
    untouched)."""
    config_rules: tuple[str, ...] = ()
    """``package.module:function`` rules ``screl check`` runs on its settings (``fn(context)``, as screl's own)."""
    why_not: tuple[tuple[str, str], ...] = ()
    """Its own reason for a capability it lacks, by field name (said instead of the generic refusal)."""

    def reason(self, capability: str, engine: str) -> str:
        """Why the engine ``engine`` lacks ``capability``: its own words, else the generic ones."""
        return dict(self.why_not).get(capability, f"the {engine} engine does not declare {capability}")


@runtime_checkable
class RankLink(Protocol):
    """What an engine class's ``link_ranks(module, autocast, world_size)`` returns on every rank (an engine that
    declares ``colocated_tensor_parallel``): rank 0 gives ``link`` to its colocated engine (``on_trainer_module``),
    the other ranks call :meth:`follow` while it generates."""

    link: Any

    def follow(self) -> Any:
        """A follower rank: take part in the leader's forward passes until the leader ends them."""
        ...


def declared_capabilities(engine: Any) -> EngineCapabilities:
    """What an engine (class or instance) declares; the defaults when it declares nothing."""
    declared = getattr(engine, "capabilities", None)
    return declared if isinstance(declared, EngineCapabilities) else EngineCapabilities()


@runtime_checkable
class GenerationEngine(Protocol):
    """What a generation worker drives: torch on HF models now, vLLM ``AsyncLLM`` later.

    A worker builds its engine with ``Backend.from_options(policy, EngineOptions(...))`` (``generation.backend``
    names the class). Thread safety: ``generate`` blocks; ``abort``, ``pause``, ``resume``, ``update_weights``
    and ``set_version`` may be called from other threads while it runs. The class may declare what it can do in a
    ``capabilities`` class attribute (:class:`EngineCapabilities`; the defaults when it declares none: optional,
    so not a protocol member that ``isinstance`` would demand).
    """


    @classmethod
    def from_options(cls, policy: Any, options: EngineOptions) -> GenerationEngine:
        """Build the engine for ``policy`` (a :class:`~screl.models.PolicySpec`) as a worker configures it."""
        ...

    @property
    def version(self) -> int:
        """The weight version now loaded."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate every request (in the given order) and return when all have finished or been aborted."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights (atomically between decode steps) and set the version.

        An engine whose capabilities declare ``streams_weight_buckets`` is given an iterable of buckets (name ->
        tensor dicts, fetched lazily) instead of one dict, and loads them one at a time in place; a refit that
        misses a weight fails and keeps the old version label (the torch and vLLM engines do so)."""
        ...

    def set_version(self, version: int) -> None:
        """Set the weight version label without loading weights."""
        ...

    def abort(self, request_ids: Sequence[str]) -> None:
        """Finish these in-flight requests now with their partial tokens (``finish_reason="abort"``).

        Ids not in flight are ignored (as vLLM does).
        """
        ...

    def pause(self, mode: PauseMode = "keep") -> None:
        """Stop generating until ``resume()``; returns once the engine is quiet.

        ``keep``: in-flight requests stop at a step boundary and continue after resume (their KV cache
        is kept, or recomputed if the engine is so configured); ``wait``: in-flight requests finish,
        new ones wait; ``abort``: in-flight requests are aborted. New requests wait for ``resume()``.
        """
        ...

    def resume(self) -> None:
        """Undo ``pause``."""
        ...
