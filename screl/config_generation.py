"""The generation side of a run's config (``data.init_args.generation``, ``policy.generation`` in the spec)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_WORKFLOW = "screl.rollout.workflows.workflow.SingleTurnWorkflow"
"""The rollout workflow a worker runs unless ``generation.workflow`` names another."""
TORCH_DECODE_PATHS = ("auto", "static", "hf", "continuous")
"""The torch backend's ``backend_args.decode`` values (:mod:`screl.rollout.engines.torch_engine`)."""

VLLM_GPU_MEMORY_UTILIZATION = 0.5
"""The share of its GPU's memory a vLLM engine takes on ``device: cuda`` unless ``backend_args`` sets
``gpu_memory_utilization``. vLLM's own default, 0.9, assumes the GPU is the engine's alone; a screl worker may share
its GPU with the trainer (one GPU, non-colocated, a fractional ``num_gpus_per_worker``), and 0.5 leaves the trainer
half of it. On a GPU of its own, raise it (0.85-0.9) for a larger KV cache."""
_VLLM_COMMON: dict[str, Any] = {
    "max_model_len": None,  # the model's max_position_embeddings
    "enable_prefix_caching": True,  # requests carry a cache salt of their weight version (screl.rollout.engines.vllm_engine)
    "scheduling_policy": "priority",
    "max_logprobs": 0,
}
VLLM_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"dtype": "float32", "enforce_eager": True, **_VLLM_COMMON},
    "cuda": {"dtype": "auto", "enforce_eager": False, "gpu_memory_utilization": VLLM_GPU_MEMORY_UTILIZATION,
             **_VLLM_COMMON},
}
"""The vLLM engine arguments screl sets per device kind unless ``backend_args`` says otherwise: on CPU fp32 and eager
(vLLM's CPU build), on CUDA the model's own dtype (``auto``: bf16 for current checkpoints), CUDA graphs
(``enforce_eager: false``) and :data:`VLLM_GPU_MEMORY_UTILIZATION`; prefix caching on both."""


def vllm_engine_args(device: str, backend_args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The vLLM engine arguments of a worker on ``device`` (``cpu``, ``cuda``, ``cuda:N``): :data:`VLLM_DEFAULTS`
    for its kind, overridden key by key by ``backend_args``."""
    kind = "cuda" if device == "cuda" or device.startswith("cuda:") else device
    if kind not in VLLM_DEFAULTS:
        raise ValueError(f"data.init_args.generation.device={device!r}: vLLM runs on cpu or cuda")
    return {**VLLM_DEFAULTS[kind], **dict(backend_args or {})}


@dataclass
class Resources:
    """Devices set aside for generation when not colocated."""

    num_nodes: int = 1
    """Nodes for generation."""
    gpus_per_node: int = 0
    """Generation GPUs per node (0 on CPU). On a node the trainer also uses, they are the node's last GPUs and the
    trainer gets the first ``trainer.devices`` (``screl check`` prints the device map, :mod:`screl.placement`)."""
    node_gpus: int | None = None
    """GPUs each node has in all (trainer's, generation's and any left over). None: ``screl fit`` counts the node's
    own (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi``) and ``screl check`` assumes exactly what the plan uses. Set
    it to have ``screl check`` refuse a plan that does not fit the node."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU in GB (80 for an H100), for the memory budget of a GPU the trainer shares with generation
    (fractional ``num_gpus_per_worker``). None: the budget is printed as shares only and the trainer's memory
    estimate is not checked against what the engines leave it."""


@dataclass
class ColocatedConfig:
    """Whether generation shares the training devices."""

    enabled: bool = False
    """Colocated generation: the engine decodes with the trainer's own module in the trainer's process and stands
    down for each train step (``backend: torch``, one trainer process; docs/generation.md)."""
    resources: Resources = field(default_factory=Resources)
    """Generation devices when not colocated."""


@dataclass
class HttpServerConfig:
    """The OpenAI-compatible policy server (``generation.expose_http_server: true``; docs/agents.md)."""

    host: str = "127.0.0.1"
    """Bind address. Anything but loopback needs ``api_key``."""
    port: int = 0
    """TCP port; 0 picks a free one (the URL is logged)."""
    api_key: str | None = None
    """When set, every ``/v1`` request must send ``Authorization: Bearer <api_key>`` (401 otherwise)."""
    model_name: str = "screl-policy"
    """The model id ``/v1/models`` lists."""
    tool_parser: str = "auto"
    """How replies become ``tool_calls``: ``hermes`` (``<tool_call>`` JSON: Hermes, Qwen), ``compact`` (the
    character tokenizer's ``=args``), ``auto`` (compact for the character tokenizer, else hermes), or a class path
    (``screl.rollout.server.tool_calls.ToolParser``)."""
    max_body_bytes: int = 16 * 2**20
    """Largest request body, checked from ``Content-Length`` and while reading, before parsing (413 beyond)."""
    max_prompt_tokens: int | None = None
    """Longest prompt after templating (400 naming the field beyond). None: the model's context length."""
    max_request_tokens: int | None = None
    """Largest ``max_tokens`` a request may ask for (400 beyond). None: the model's context length, or
    ``generation.max_new_tokens`` when larger."""
    max_choices: int = 64
    """Largest ``n`` (times the prompts of a ``/v1/completions`` batch): the engine requests of one request (400)."""
    max_messages: int = 1024
    """Most chat messages (``/v1/responses``: input items, with a continued response's) in one request (400)."""
    max_tools: int = 128
    """Most tools in one request (400)."""
    max_concurrent_requests: int = 1024
    """Requests served at once; more get 429 with ``Retry-After``. Keep it above the agents that run at once
    (``generation.num_workers`` x ``AgentWorkflow``'s ``max_concurrent``)."""
    max_open_sessions: int = 4096
    """Sessions the server holds records for; a new session beyond it gets 429 with ``Retry-After``."""
    session_idle_timeout_s: float = 3600.0
    """A session with no request for this long (and none in flight) is closed: its records freed, its later
    requests answered with a 404 naming it."""


SERVER_LIMIT_KEYS = ("max_body_bytes", "max_prompt_tokens", "max_request_tokens", "max_choices", "max_messages",
                     "max_tools", "max_concurrent_requests", "max_open_sessions", "session_idle_timeout_s")
"""The policy server's limits (docs/agents.md, "Limits"): each a positive number (the token ones may be None)."""


def server_limit_problems(http_server: Any) -> list[tuple[str, Any, str]]:
    """(key, value, problem) for every limit of ``http_server`` (an :class:`HttpServerConfig`) that is not a
    positive number."""
    out = []
    for key in SERVER_LIMIT_KEYS:
        value = getattr(http_server, key)
        if value is None and key in ("max_prompt_tokens", "max_request_tokens"):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or value <= 0 or (key != "session_idle_timeout_s" and not isinstance(value, int)):
            kind = "a number of seconds" if key == "session_idle_timeout_s" else "an integer"
            out.append((f"generation.http_server.{key}", value, f"must be {kind} > 0"))
    return out


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def bind_problem(host: str, api_key: str | None) -> str | None:
    """Why the policy server may not bind ``host`` (a non-loopback address without an API key), or None."""
    if host in LOOPBACK_HOSTS or api_key:
        return None
    return (f"generation.http_server.host={host!r} is not loopback and no generation.http_server.api_key is set: "
            "anyone who can reach the port could drive the policy")


@dataclass
class GenerationConfig:
    """The generation side (``policy.generation`` in the spec)."""

    backend: str = "torch"
    """Engine: ``torch`` (HF model, CPU or GPU), ``vllm`` (an ``AsyncLLM`` per worker; needs vLLM installed, see
    docs/generation.md), or the class path of your own engine (``package.module.Class`` implementing
    ``screl.rollout.GenerationEngine``; see docs/extending.md), or ``megatron`` (the policy's megatron-core
    ``GPTModel``; needs ``trainer.strategy`` MegatronStrategy, docs/generation.md)."""
    backend_args: dict[str, Any] = field(default_factory=dict)
    """Backend-specific settings, passed to the backend's ``from_options`` as ``EngineOptions.args``."""
    num_workers: int = 1
    """Generation worker actors (each holds a copy of the policy)."""
    num_cpus_per_worker: float = 1.0
    """Logical CPUs Ray reserves for each worker (0 only with ``resources`` or ``num_gpus_per_worker``: a worker
    placed by those alone, e.g. on generation nodes that offer no CPU to the rest of the run)."""
    num_gpus_per_worker: float | None = None
    """GPUs Ray reserves for each worker. None: ``colocated.resources`` (num_nodes x gpus_per_node) split
    over the workers when ``device`` is cuda, else 0."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each worker reserves, e.g. ``{rollout_node: 1}``: the workers run only on nodes that
    offer them (``ray start --resources='{"rollout_node": 4}'``), which is how a multi-node run puts
    generation on its own nodes (docs/scaling.md). ``CPU``/``GPU`` go in ``num_cpus_per_worker``/
    ``num_gpus_per_worker`` instead."""
    refit_bucket_mb: float = 64.0
    """Weights travel to the workers in buckets of about this many MiB (the trainer never serializes the whole
    model as one object). Under ``MegatronStrategy`` its ``export_bucket_bytes`` sets the bucket size instead."""
    workflow: str = DEFAULT_WORKFLOW
    """Rollout workflow class (``package.module.Class``) each worker runs per sibling: generate, reward, build
    the row (see docs/extending.md). The default generates once and scores with the task;
    ``screl.rollout.MultiTurnWorkflow`` runs conversations with the task's environments (docs/agents.md)."""
    workflow_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the workflow class (``MultiTurnWorkflow``: ``max_turns``, ``max_total_tokens``,
    ``env_actors``); checked against its signature before anything starts."""
    max_new_tokens: int = 16
    """Completion length cap."""
    min_new_tokens: int = 0
    """Ignore EOS before this many tokens (set equal to max_new_tokens for fixed-length completions)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); logprobs are those of the temperature-scaled distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int | None = None
    """Top-k sampling (None: off)."""
    async_engine: bool = True
    """Must be true: every engine screl runs is asynchronous (vLLM's AsyncLLM, the torch engine's request loop); the
    key is the spec's, and ``screl check`` refuses ``false``, which would select nothing."""
    colocated: ColocatedConfig = field(default_factory=ColocatedConfig)
    """Colocation and generation resources."""
    num_threads: int | None = None
    """Torch intra-op threads per worker on CPU. None: automatic (``screl.threads.thread_plan``): all cores
    when generation and training take turns (sync), half of them when they overlap (async)."""
    max_batch_size: int = 64
    """Requests a worker generates together."""
    batch_window_s: float = 0.01
    """How long a worker waits for more groups to join a decode batch once one arrived (0: start at once)."""
    device: str = "cpu"
    """Device of the torch engine (``cpu`` or ``cuda``)."""
    max_worker_restarts: int = -1
    """Times Ray restarts a dead generation worker (its model rebuilt, the latest weights pushed before its next
    request); -1: without limit, 0: never (a dead worker's share moves to the others)."""
    generation_timeout_s: float | None = None
    """Deadline of one generate request (None: none). A request past it is aborted and its sibling retried as a
    rollout failure (``fail`` event, reason ``timeout``) within ``rollout_failure.max_infra_attempts``. Time
    the engine spends paused for a refit does not count."""
    rollout_timeout_s: float | None = None
    """Deadline of one sibling's whole rollout (every generate call and the reward), same handling."""
    expose_http_server: bool = False
    """Serve the policy over an OpenAI-compatible HTTP server (chat and completions, with token ids, logprobs and
    weight versions): for agents that speak OpenAI, and required by ``screl.rollout.AgentWorkflow``."""
    http_server: HttpServerConfig = field(default_factory=HttpServerConfig)
    """Where and how the server listens."""
    injected_latency_s: float = 0.0
    """Testing aid: random extra latency per request, uniform in [0, this] (out-of-order completions)."""
