#!/usr/bin/env python
"""screl's torch engine on one GPU against Hugging Face ``generate``, transformers' continuous batching and the HBM
roofline, on nano-vllm's workload (issue 49).

    python bench/engine_gpu.py                       # GPU: Qwen3-0.6B and Qwen2.5-1.5B shapes (< 5 min on one H100)
    python bench/engine_gpu.py --cpu                 # CI: the tiny model, 8 sequences (writes engine_gpu_cpu.json)
    python bench/engine_gpu.py --decode static --models qwen2.5-1.5b

The workload (nano-vllm's ``bench.py``): ``--seqs`` sequences (256), random prompts of 100-1024 tokens, each with its
own output length of 100-1024 tokens, EOS ignored, one fixed seed; random-init bf16 weights built from the model's
``config.json`` (throughput depends on the shapes only). Greedy decoding everywhere. Systems, one after another:

- ``engine``: screl's ``TorchGenerationEngine`` through its public API (``generate`` of ``GenerationRequest`` s, one
  request per sequence, ``max_new_tokens = min_new_tokens`` = its length, ``ignore_eos``), ``max_batch_size`` =
  ``--seqs``, ``backend_args.decode`` = ``--decode`` (whatever the engine offers: auto, static, hf, ...; ``auto`` is
  the continuous path on a GPU, the static one on a CPU), after a warm-up call on a few sequences; where it captures
  CUDA graphs, the whole workload once more untimed first, so every decode shape is captured before the timed run
  (``graph_captures`` counts them).
- ``engine_continuous``: the same with ``decode: continuous``: one slot per sequence (``max_rows`` = ``--seqs``) of
  the workload's longest sequence (``max_len``), as many as ``--kv-cache-gb`` holds; ``kv_cache`` says what it got.
- ``hf_generate``: ``model.generate`` with its static cache (``cache_implementation="static"``; on CUDA transformers
  compiles the decode step: ``hf_generate_path`` says which ran, eager where the compiled run failed), batches of
  ``--hf-batch`` left-padded sequences, each batch decoding to its longest output; a row's tokens beyond its own
  length are dropped (the waste of static batching is part of its time).
- ``hf_continuous``: transformers' continuous batching (``init_continuous_batching``: paged KV cache, a request per
  sequence with its own ``max_new_tokens``, no EOS).
- ``roofline``: the time the decode steps of this workload need at the device's copy bandwidth (a large
  device-to-device copy, read + write bytes over its time), each step reading every weight once plus the KV cache
  of every sequence still decoding (all sequences in one batch; prefill not counted): tokens/s at that time.

Ratios are given for both engine systems (``engine_continuous_over_...`` beside ``engine_over_...``).
Per system: output tokens (each sequence's must equal its requested length: ``tokens_ok``), seconds, tokens/s, peak
device memory (``torch.cuda.max_memory_allocated``; on CPU not measured: null). Ratios: ``engine_over_hf_generate``,
``engine_over_hf_continuous``, ``engine_over_roofline``. ``targets``: on one H100 at Qwen2.5-1.5B the engine >= 3x
HF generate and >= 40% of the roofline (``met``: null on CPU, where the shapes are not the targets').

Writes ``bench/results/engine_gpu.json`` (GPU) or ``bench/results/engine_gpu_cpu.json`` (``--cpu``); ``--out``
elsewhere. The JSON also goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from screl.models.spec import PolicySpec  # noqa: E402

MODELS = {"qwen3-0.6b": REPO / "configs/recipes/shapes/qwen3-0.6b/config.json",
          "qwen2.5-1.5b": REPO / "examples/models/qwen2.5-1.5b-instruct/config.json"}
TARGETS = {"model": "qwen2.5-1.5b", "engine_over_hf_generate": 3.0, "engine_over_roofline": 0.4}
SYSTEMS = ("engine", "engine_continuous", "hf_generate", "hf_continuous", "roofline")


class RandomShapeSpec(PolicySpec):
    """A model of a real ``config.json``'s shapes with random bf16 weights (seeded), and the in-memory character
    tokenizer (the workload is token ids: the tokenizer only names the pad and stop tokens)."""

    def __init__(self, config: str, dtype: str = "bfloat16", seed: int = 0) -> None:
        self.config, self.dtype, self.seed = config, dtype, seed

    def build_model(self) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        from screl.models.spec import resolve_dtype

        cfg = AutoConfig.from_pretrained(str(Path(self.config).parent))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return AutoModelForCausalLM.from_config(cfg, dtype=resolve_dtype(self.dtype))

    def build_tokenizer(self) -> Any:
        from screl.models.tokenizer import build_char_tokenizer

        return build_char_tokenizer()


class Prebuilt(PolicySpec):
    """``spec`` with its model already built (and on the device): the engine takes it as a worker would build it."""

    def __init__(self, spec: PolicySpec, model: Any) -> None:
        self.spec, self.model, self.dtype = spec, model, getattr(spec, "dtype", "float32")

    def build_model(self) -> Any:
        return self.model

    def build_tokenizer(self) -> Any:
        return self.spec.build_tokenizer()


def workload(seqs: int, prompt: tuple[int, int], out: tuple[int, int], vocab: int, seed: int = 0
             ) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's: random prompt tokens and lengths, random output lengths (one seed)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(*prompt))] for _ in range(seqs)]
    return prompts, [rng.randint(*out) for _ in range(seqs)]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak_reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def _peak_mib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None


def _figures(tokens: list[int], lengths: list[int], seconds: float, dev: torch.device, **extra: Any) -> dict[str, Any]:
    return {"output_tokens": sum(tokens), "tokens_ok": tokens == lengths, "seconds": seconds,
            "tokens_per_s": sum(tokens) / seconds, "peak_memory_mib": _peak_mib(dev), **extra}


def run_engine(spec: PolicySpec, model: Any, prompts: list[list[int]], lengths: list[int], dev: torch.device,
               decode: str, kv_cache_gb: float = 1.0) -> dict[str, Any]:
    """screl's torch engine through its public API (the spec's model, already on the device). The continuous path
    gets slots of the workload's longest sequence, up to one per sequence, from ``kv_cache_gb``."""
    from screl.rollout.engines.protocol import EngineOptions, GenerationRequest, SamplingParams
    from screl.rollout.engines.torch_engine import TorchGenerationEngine

    prebuilt = Prebuilt(spec, model)
    args: dict[str, Any] = {"decode": decode, "max_len": max(len(p) for p in prompts) + max(lengths),
                            "max_rows": len(prompts), "kv_cache_gb": kv_cache_gb}  # the continuous path's (auto: GPU)
    options = EngineOptions(device=str(dev), num_threads=None, max_batch_size=len(prompts), seed=0, args=args)
    engine = TorchGenerationEngine.from_options(prebuilt, options)

    def requests(tag: str, n: int) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}{i}", prompts[i], SamplingParams(
            max_new_tokens=lengths[i], min_new_tokens=lengths[i], temperature=0.0, ignore_eos=True, seed=i))
            for i in range(n)]

    warm = [GenerationRequest(f"w{i}", prompts[i][:16], SamplingParams(max_new_tokens=4, temperature=0.0))
            for i in range(min(4, len(prompts)))]
    engine.generate(warm)
    graphs = getattr(engine.continuous, "graphs", None)
    if graphs is not None and graphs.capture:  # capture every decode shape the run takes before timing it
        engine.generate(requests("w", len(prompts)))
    _peak_reset(dev)
    _sync(dev)
    t0 = time.perf_counter()
    results = engine.generate(requests("r", len(prompts)))
    _sync(dev)
    seconds = time.perf_counter() - t0
    path = getattr(engine, "decode_path", decode)
    extra = {"kv_cache": engine.continuous.describe()} if engine.continuous is not None else {}
    if graphs is not None:
        extra["graph_captures"] = graphs.captures
    return _figures([len(r.token_ids) for r in results], lengths, seconds, dev, decode=decode, decode_path=path,
                    attention=attention_path(engine, dev), **extra)


def attention_path(engine: Any, dev: torch.device) -> str:
    """What computes the engine's attention (its decode path's words, as its start-up line says them)."""
    return f"{engine.attention_path} ({dev.type})"


def run_hf_generate(model: Any, prompts: list[list[int]], lengths: list[int], dev: torch.device, batch: int,
                    pad: int) -> dict[str, Any]:
    """``model.generate`` with the static cache, ``batch`` sequences at a time; compiled on CUDA, else eager."""
    path = "static cache, torch.compile (transformers' compile on CUDA)" if dev.type == "cuda" else \
        "static cache, eager (no compile off CUDA)"
    try:
        return _hf_generate(model, prompts, lengths, dev, batch, pad, compile_=dev.type == "cuda", path=path)
    except Exception as err:  # noqa: BLE001 - the compiled run failed: the eager one is the figure, with why
        reason = f"{type(err).__name__}: {err}"[:300]
        _peak_reset(dev)
        return _hf_generate(model, prompts, lengths, dev, batch, pad, compile_=False,
                            path=f"static cache, eager (compiled run failed: {reason})")


def _hf_generate(model: Any, prompts: list[list[int]], lengths: list[int], dev: torch.device, batch: int, pad: int,
                 compile_: bool, path: str) -> dict[str, Any]:
    chunks = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]

    def one(idx: list[int], limit: int | None = None) -> list[int]:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            attn[row, width - len(prompts[i]):] = 1
        new = limit or max(lengths[i] for i in idx)
        with torch.no_grad():
            out = model.generate(ids.to(dev), attention_mask=attn.to(dev), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, cache_implementation="static", disable_compile=not compile_,
                                 pad_token_id=pad, eos_token_id=None)
        return [min(out.shape[1] - width, lengths[i]) for i in idx]

    one(chunks[0], limit=4)  # warm-up at the first batch's rows and width (the compile; a longer cache may recompile)
    _peak_reset(dev)
    _sync(dev)
    t0 = time.perf_counter()
    tokens = [n for idx in chunks for n in one(idx)]
    _sync(dev)
    return _figures(tokens, lengths, time.perf_counter() - t0, dev, batch=batch, hf_generate_path=path)


def run_hf_continuous(model: Any, prompts: list[list[int]], lengths: list[int], dev: torch.device) -> dict[str, Any]:
    """transformers' continuous batching: a request per sequence, its own ``max_new_tokens``, no EOS."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=-1, pad_token_id=0)
    # CUDA: the cache sized from free device memory (transformers' default); CPU: a small fixed cache (its default
    # takes most of the host's free memory)
    cb = ContinuousBatchingConfig() if dev.type == "cuda" else ContinuousBatchingConfig(
        page_size=64, num_blocks=4 * len(prompts), max_batch_tokens=512)
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb,
                                                   warmup=dev.type == "cuda") as manager:
        warm = manager.add_request(prompts[0][:16], max_new_tokens=2, eos_token_id=-1)
        manager.get_result(warm, timeout=600)
        _peak_reset(dev)
        _sync(dev)
        t0 = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        got: dict[str, int] = {}
        while len(got) < len(ids):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError(f"continuous batching returned {len(got)} of {len(ids)} requests")
            if out.error:
                raise RuntimeError(f"continuous batching failed a request: {out.error}")
            if out.is_finished():
                got[out.request_id] = len(out.generated_tokens)
        _sync(dev)
        seconds = time.perf_counter() - t0
    return _figures([got[f"r{i}"] for i in range(len(ids))], lengths, seconds, dev,
                    attention=str(getattr(model.config, "_attn_implementation", "unknown")))


def copy_bandwidth(dev: torch.device, mib: int) -> float:
    """Bytes/s of a device-to-device copy of ``mib`` MiB (read + write), the best of 5."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def roofline(model: Any, prompts: list[list[int]], lengths: list[int], bandwidth: float) -> dict[str, Any]:
    """Decode time of the workload at ``bandwidth``: every step reads the weights once (the input embedding
    table only where it is not the output layer's) plus the KV cache of every sequence still decoding."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        weights -= embed.numel() * embed.element_size()
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv_token = 2 * int(cfg.num_hidden_layers) * int(getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
    kv_token *= embed.element_size()
    steps, kv_bytes = max(lengths), 0
    for step in range(steps):
        kv_bytes += kv_token * sum(len(p) + step for p, n in zip(prompts, lengths, strict=True) if n > step)
    total = steps * weights + kv_bytes
    seconds = total / bandwidth
    return {"output_tokens": sum(lengths), "tokens_ok": True, "seconds": seconds,
            "tokens_per_s": sum(lengths) / seconds, "peak_memory_mib": None, "weights_bytes_per_step": weights,
            "kv_bytes_per_token": kv_token, "decode_steps": steps, "bytes_read": total, "bandwidth_gb_s": bandwidth / 1e9}


def bench_model(name: str, spec: PolicySpec, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """The four systems on one model's shapes."""
    model = spec.build_model().to(dev).eval().requires_grad_(False)
    prompts, lengths = workload(args.seqs, args.prompt_len, args.output_len, int(model.config.vocab_size))
    out: dict[str, Any] = {"model": name, "parameters": sum(p.numel() for p in model.parameters()),
                           "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                           "sequences": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
                           "requested_output_tokens": sum(lengths), "systems": {}}
    runs = {"engine": lambda: run_engine(spec, model, prompts, lengths, dev, args.decode),
            "engine_continuous": lambda: run_engine(spec, model, prompts, lengths, dev, "continuous",
                                                    args.kv_cache_gb),
            "hf_generate": lambda: run_hf_generate(model, prompts, lengths, dev, args.hf_batch, 0),
            "hf_continuous": lambda: run_hf_continuous(model, prompts, lengths, dev),
            "roofline": lambda: roofline(model, prompts, lengths, args.bandwidth)}
    for system in args.systems:
        try:
            out["systems"][system] = runs[system]()
        except Exception as err:  # noqa: BLE001 - one system's failure is its figure; the others still run
            out["systems"][system] = {"error": f"{type(err).__name__}: {err}"[:2000],
                                      "traceback": traceback.format_exc()[-2000:]}
        print(f"engine_gpu: {name} {system}: {json.dumps(out['systems'][system], default=str)[:300]}",
              file=sys.stderr, flush=True)
    out["ratios"] = ratios(out["systems"])
    runs.clear()
    return out


def ratios(systems: dict[str, Any]) -> dict[str, float | None]:
    def tps(name: str) -> float | None:
        value = systems.get(name, {}).get("tokens_per_s")
        return float(value) if value else None

    out: dict[str, float | None] = {}
    for mine in ("engine", "engine_continuous"):
        engine = tps(mine)
        out.update({f"{mine}_over_{k}": (engine / tps(k)) if engine and tps(k) else None  # type: ignore[operator]
                    for k in ("hf_generate", "hf_continuous", "roofline")})
    return out


def targets(models: list[dict[str, Any]], cpu: bool) -> dict[str, Any]:
    row = next((m for m in models if m["model"] == TARGETS["model"]), None)
    out: dict[str, Any] = dict(TARGETS)
    for key in ("engine_over_hf_generate", "engine_over_roofline"):
        got = None if row is None else row["ratios"].get(key)
        out[f"{key}_measured"] = got
        out[f"{key}_met"] = None if cpu or got is None else bool(got >= TARGETS[key])
    out["met"] = None if cpu else (out["engine_over_hf_generate_met"] is True
                                   and out["engine_over_roofline_met"] is True)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny model, 8 sequences of 8-32 tokens, outputs 8-16")
    parser.add_argument("--decode", default="auto", help="the torch engine's backend_args.decode ('engine')")
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="engine_continuous's KV-cache budget (default: 30 on a GPU, 0.05 on CPU)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ",".join(MODELS))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ",".join(SYSTEMS))
    parser.add_argument("--seqs", type=int, default=None)
    parser.add_argument("--hf-batch", type=int, default=None, help="HF generate's batch (default: all sequences)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    args.seqs = args.seqs or (8 if args.cpu else 256)
    args.kv_cache_gb = args.kv_cache_gb or (0.05 if args.cpu else 30.0)
    args.hf_batch = args.hf_batch or args.seqs
    args.prompt_len, args.output_len = ((8, 32), (8, 16)) if args.cpu else ((100, 1024), (100, 1024))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("engine_gpu.py: no CUDA device; --cpu runs the small CPU mode", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.cpu else "cuda")
    t0 = time.perf_counter()
    args.bandwidth = copy_bandwidth(dev, 64 if args.cpu else 4096)
    if args.cpu:
        from screl.models import TinyCausalLM

        specs: dict[str, PolicySpec] = {"tiny": TinyCausalLM(scale="tiny", seed=0)}
    else:
        specs = {m: RandomShapeSpec(str(MODELS[m])) for m in args.models.split(",") if m}
    models = [bench_model(name, spec, args, dev) for name, spec in specs.items()]
    result = {"mode": "cpu" if args.cpu else "gpu",
              "device": "cpu" if args.cpu else torch.cuda.get_device_name(dev),
              "copy_bandwidth_gb_s": args.bandwidth / 1e9, "decode": args.decode,
              "workload": {"sequences": args.seqs, "prompt_tokens": list(args.prompt_len),
                           "output_tokens": list(args.output_len), "seed": 0, "sampling": "greedy, EOS ignored"},
              "models": models, "targets": targets(models, args.cpu), "wall_s": time.perf_counter() - t0}
    text = json.dumps(result, indent=1, default=str)
    out = args.out or REPO / "bench" / "results" / ("engine_gpu_cpu.json" if args.cpu else "engine_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text, flush=True)
    errors = [s for m in models for s, v in m["systems"].items() if "error" in v]
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
