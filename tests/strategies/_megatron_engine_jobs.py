"""Jobs that ``test_megatron_generation.py`` runs in spawned gloo ranks (see ``_megatron_jobs.spawn``).

The Megatron engine and the torch engine decode the same weights for the same seeded requests; the trainer's own
recompute (Megatron's full forward, as GRPO computes logprobs) scores the Megatron engine's completions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from screl.models import TinyCausalLM
from screl.rollout import GenerationRequest, SamplingParams

PROMPTS = [[5, 9, 17, 3, 11, 2, 30], [7, 8, 1], [12, 4, 4, 4, 20], [3]]
MAX_NEW = 12


def policy() -> TinyCausalLM:
    return TinyCausalLM(scale="tiny", seed=3)


def requests(tag: str, temperature: float = 1.0) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}-{i}", p, SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature,
                                                              seed=100 + i)) for i, p in enumerate(PROMPTS)]


def as_lists(results: list[Any]) -> list[dict[str, Any]]:
    return [{"tokens": r.token_ids, "logprobs": r.logprobs, "finish": r.finish_reason, "versions": r.weight_versions}
            for r in results]


def trainer_gpt(spec: TinyCausalLM, hf: Any) -> Any:
    """The trainer's GPTModel of ``spec`` in this process's parallel layout, with the HF weights."""
    from screl.strategies import GPTModelProvider, load_hf_weights

    model = GPTModelProvider.from_hf_config(hf.config, params_dtype="float32")()
    load_hf_weights(model, hf.state_dict())
    return model


def recompute(model: Any, results: list[Any], temperature: float) -> list[list[float]]:
    """The trainer's logprobs of each completion (Megatron's full forward over prompt + completion, at TP=1)."""
    from screl.rollout.engines.megatron_decode import unpadded_vocab_size

    vocab, out = unpadded_vocab_size(model), []
    with torch.no_grad():
        for r in results:
            seq = torch.tensor([r.prompt_token_ids + r.token_ids])
            logits = model(seq, torch.arange(seq.shape[1])[None], None)[0, :, :vocab].float() / temperature
            lp = torch.log_softmax(logits[:-1], -1).gather(1, seq[0, 1:, None])[:, 0]
            out.append(lp[len(r.prompt_token_ids) - 1:].tolist())
    return out


def engine_job(rank: int, out: str) -> None:
    """One process: the worker's Megatron engine (its own TP=1 GPTModel) against the torch engine."""
    from screl.strategies import iter_export_buckets
    from screl.strategies.parallel import ParallelismConfig, initialize_model_parallel

    from screl.rollout.engines.megatron_engine import MegatronGenerationEngine
    from screl.rollout.engines.torch_engine import TorchGenerationEngine

    spec = policy()
    hf = spec.build_model()
    initialize_model_parallel(ParallelismConfig(), seed=0, cpu=True)
    trainer = trainer_gpt(spec, hf)
    engine = MegatronGenerationEngine(policy(), seed=1)
    with torch.no_grad():  # the engine's own init differs until the refit
        before = engine.generate(requests("b", 0.0))
    buckets = list(iter_export_buckets(trainer, bucket_bytes=8 * 1024, naming="megatron"))
    engine.update_weights(iter(buckets), 1)
    torch_engine = TorchGenerationEngine(policy(), decode="hf")
    torch_engine.update_weights(hf.state_dict(), 1)
    result: dict[str, Any] = {"buckets": len(buckets), "before": as_lists(before)}
    for temp in (1.0, 0.7):
        tag = f"t{temp}"
        mg = engine.generate(requests(tag, temp))
        result[tag] = {"megatron": as_lists(mg), "torch": as_lists(torch_engine.generate(requests(tag, temp))),
                       "recompute": recompute(trainer, mg, temp)}
    result["greedy"] = as_lists(engine.generate(requests("g", 0.0)))
    # a refit that misses a parameter is refused, and the engine refuses to generate with the mix
    partial = [{k: v for k, v in b.items() if "linear_fc2" not in k} for b in buckets]
    try:
        engine.update_weights(iter(partial), 2)
        result["partial"] = "accepted"
    except KeyError as err:
        result["partial"] = str(err)
    try:
        engine.generate(requests("after-partial"))
        result["after_partial"] = "generated"
    except RuntimeError as err:
        result["after_partial"] = str(err)
    engine.update_weights(iter(buckets), 3)
    result["after_full_refit"] = as_lists(engine.generate(requests("g2", 0.0)))
    result["version"] = engine.version
    torch.save(result, f"{out}.{rank}")


def tensor_parallel_job(rank: int, out: str, autocast: torch.dtype | None = None) -> None:
    """Two ranks: rank 0's engine decodes with its TP=2 shard, rank 1 follows through the decode link; two turns,
    the trainer's step between them flipping every weight in place (``autocast`` bf16: each rank decodes a bf16 copy
    of its fp32 shard, freed at the end of each turn and cast again at the next, under the new weights)."""
    from screl.strategies.parallel import ParallelismConfig, initialize_model_parallel

    from screl.rollout.engines.megatron_decode import DecodeLink, TensorParallelRanks
    from screl.rollout.engines.megatron_engine import MegatronGenerationEngine
    from screl.rollout.engines.torch_engine import TorchGenerationEngine

    spec = policy()
    hf = spec.build_model()
    initialize_model_parallel(ParallelismConfig(tensor_model_parallel_size=2), seed=0, cpu=True)
    model = trainer_gpt(spec, hf)
    model.train()  # a trainer's module: the engine switches it to eval for each forward and back
    link = DecodeLink(dist.new_group([0, 1], backend="gloo"), src=0)
    result: dict[str, Any] = {"megatron": [], "torch": [], "forwards": [], "freed": []}
    engine = MegatronGenerationEngine(policy(), model=model, link=link, seed=1, max_batch_size=2,
                                      autocast=autocast) if rank == 0 else None
    ranks = TensorParallelRanks(link, model, autocast) if rank else None
    ref = TorchGenerationEngine(policy(), decode="hf", model=hf, autocast=autocast) if rank == 0 else None
    for turn in range(2):
        if engine is not None and ref is not None:
            result["megatron"].append(as_lists(engine.generate(requests(f"tp{turn}", 1.0))))
            link.end()
            twin = getattr(engine.model, "screl_decode_copy", None)
            if twin is not None:
                twin.free()  # the colocated host's stand-down
            result["casts"] = None if twin is None else twin.casts
            result["torch"].append(as_lists(ref.generate(requests(f"tp{turn}", 1.0))))  # fp32 spec: the masters
            result["copied"] = engine.model is not model
        elif ranks is not None:
            result["forwards"].append(ranks.follow())
            result["copied"] = ranks._decode is not model
            result["freed"].append(all(p.numel() == 0 for p in ranks._decode.parameters()))
            twin = getattr(ranks._decode, "screl_decode_copy", None)
            result["casts"] = None if twin is None else twin.casts
        with torch.no_grad():  # the trainer's step: every master flipped in place, on each rank's shard
            for p in list(model.parameters()) + (list(hf.parameters()) if rank == 0 else []):
                p.mul_(-1.0)
        dist.barrier()
    result["still_training"] = model.training
    torch.save(result, f"{out}.{rank}")


def tensor_parallel_bf16_job(rank: int, out: str) -> None:
    tensor_parallel_job(rank, out, torch.bfloat16)
