"""Generation backends by name or class path, the docs' example backend, bucketed refits, worker resources."""

from __future__ import annotations

import asyncio
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from screl.config import GenerationConfig, RunConfig
from screl.controller.resources import check_cluster_fits, engine_options, worker_resources
from screl.envs import CountLetter
from screl.models import TinyCausalLM
from screl.rollout import EngineOptions, GenerationEngine, GenerationRequest, SamplingParams
from screl.rollout.engines.buckets import iter_buckets, merge_buckets
from screl.rollout.engines.registry import build_engine, resolve_backend
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import ROW_SCHEMA
from screl.rollout.workflows.workflow import RolloutItem, SingleTurnWorkflow

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
POLICY = TinyCausalLM(hidden_size=32, num_layers=1)


def test_torch_is_the_builtin_and_a_class_path_names_the_same_class() -> None:
    assert resolve_backend("torch") is TorchGenerationEngine
    assert resolve_backend("screl.rollout.engines.torch_engine.TorchGenerationEngine") is TorchGenerationEngine
    engine = build_engine("torch", POLICY, EngineOptions(max_batch_size=3, seed=5))
    assert isinstance(engine, TorchGenerationEngine) and isinstance(engine, GenerationEngine)
    assert engine.max_batch_size == 3


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("no_such.module.Engine", r"neither a built-in backend \(\['megatron', 'torch', 'vllm'\]\) nor an importable "
         r"class"),
        ("screl.envs.CountLetter", r"does not implement the GenerationEngine protocol: missing \['from_options'"),
    ],
)
def test_a_backend_that_cannot_be_used_is_named(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_backend(name)


def test_megatron_names_the_megatron_engine_which_takes_no_backend_args() -> None:
    from screl.models import TinyCausalLM
    from screl.rollout.engines.megatron_engine import MegatronGenerationEngine
    from screl.rollout.engines.protocol import EngineOptions

    assert resolve_backend("megatron") is MegatronGenerationEngine
    with pytest.raises(ValueError, match=r"backend_args=\{'decode': 'hf'\}: the megatron backend takes none"):
        MegatronGenerationEngine.from_options(TinyCausalLM(), EngineOptions(args={"decode": "hf"}))


def test_the_torch_backend_takes_only_decode_in_backend_args() -> None:
    with pytest.raises(ValueError, match=r"backend_args=\{'beam': 4\}: the torch backend takes only 'decode' "
                                         r"\(auto\|static\|hf\|continuous\), 'kv_cache_gb', 'max_rows', 'max_len', "
                                         r"'prefill_tokens', 'sync_every', 'cuda_graphs' \(auto\|True\|False\), "
                                         r"not \['beam'\]"):
        TorchGenerationEngine.from_options(POLICY, EngineOptions(args={"beam": 4}))
    assert TorchGenerationEngine.from_options(POLICY, EngineOptions(args={"decode": "hf"})).decode_path == "hf"


def test_each_engine_declares_its_backend_args_and_their_defaults() -> None:
    from screl.rollout.engines.registry import engine_capabilities

    torch_args = engine_capabilities("torch").backend_args
    continuous = {"kv_cache_gb": 1.0, "max_rows": 256, "max_len": None, "prefill_tokens": 2048, "sync_every": 4,
                  "cuda_graphs": "auto"}
    assert dict(torch_args.defaults) == {"decode": "auto", **continuous}
    assert torch_args.choices["decode"] == ("auto", "static", "hf", "continuous")
    assert torch_args.resolve(None, "torch") == {"decode": "auto", **continuous}
    assert torch_args.resolve({"decode": "hf"}, "torch") == {"decode": "hf", **continuous}
    assert torch_args.value({}, "decode") == "auto" and torch_args.value({"decode": "static"}, "decode") == "static"
    megatron_args = engine_capabilities("megatron").backend_args
    assert dict(megatron_args.defaults) == {} and megatron_args.resolve({}, "megatron") == {}
    # an engine that declares nothing is passed its backend_args untouched
    plain = engine_capabilities("tests.engine_plugins.PlainEngine").backend_args
    assert plain.open and plain.resolve({"anything": 1}, "PlainEngine") == {"anything": 1}


def _example_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text().split("## A new backend", 1)[1], re.S)
    assert blocks, "docs/extending.md lost its backend example"
    assert len(blocks[0].splitlines()) < 60
    (tmp_path / "docs_backend.py").write_text(blocks[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "docs_backend", raising=False)
    return "docs_backend.UniformEngine"


def test_the_docs_backend_runs_the_default_workflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine(_example_backend(tmp_path, monkeypatch), POLICY, EngineOptions(seed=1, args={"vocab_size": 7}))
    assert isinstance(engine, GenerationEngine)
    task = CountLetter()
    tok = POLICY.build_tokenizer()
    items = [RolloutItem(f"g{p.prompt_id}_g0_a1", p, tuple(tok(p.text, add_special_tokens=False)["input_ids"]),
                         SamplingParams(max_new_tokens=5, seed=i)) for i, p in enumerate(task.prompts()[:2])]

    async def generate(requests: list[GenerationRequest]) -> Any:
        return engine.generate(requests)

    engine.update_weights({}, 3)
    out = asyncio.run(SingleTurnWorkflow(task=task, tokenizer=tok).run(items, generate))
    assert [o.status for o in out] == ["sealed", "sealed"]
    for o in out:
        assert o.row is not None and set(o.row) == set(ROW_SCHEMA.names)
        assert o.row["token_versions"].tolist() == [3] * 5
        assert torch.equal(o.row["generation_logprobs"], torch.full((5,), -math.log(7)))
        assert all(0 <= t < 7 for t in o.row["input_ids"][-5:].tolist())
    engine.abort(["x"])
    aborted = engine.generate([GenerationRequest("x", [1, 2], SamplingParams(max_new_tokens=4))])[0]
    assert (aborted.finish_reason, aborted.token_ids) == ("abort", [])


def test_buckets_hold_every_tensor_once_in_order_and_merge_back() -> None:
    state = {f"w{i}": torch.full((n,), float(i)) for i, n in enumerate([4, 4, 20, 1, 3])}  # float32: 4 bytes each
    buckets = list(iter_buckets(state.items(), bucket_bytes=32))
    assert [list(b) for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]  # w2 (80 B) travels alone
    merged = merge_buckets(buckets)
    assert list(merged) == list(state) and all(torch.equal(merged[k], state[k]) for k in state)
    assert all(merged[k].data_ptr() != state[k].data_ptr() for k in state), "buckets are copies"
    with pytest.raises(ValueError, match=r"weight buckets overlap on \['w0'\]"):
        merge_buckets([buckets[0], {"w0": state["w0"]}])


def test_the_bucketed_export_equals_the_one_dict_export() -> None:
    from screl.modules.grpo import GRPO

    module = GRPO(policy=TinyCausalLM(hidden_size=32, num_layers=1))
    module.configure_model()
    buckets = list(module.iter_export_weights(bucket_bytes=4096))
    whole = module.export_weights()
    assert len(buckets) > 3 and max(sum(t.numel() * 4 for t in b.values()) for b in buckets if len(b) > 1) <= 4096
    assert merge_buckets(buckets).keys() == whole.keys()
    engine = TorchGenerationEngine(module.policy_spec)
    engine.update_weights(merge_buckets(buckets), 2)  # a complete state: the engine accepts it
    assert engine.version == 2


def _gen(**kw: Any) -> GenerationConfig:
    return GenerationConfig(**kw)


@pytest.mark.parametrize(
    ("kw", "cpus", "gpus", "spread"),
    [
        ({}, 1.0, 0.0, False),
        ({"num_cpus_per_worker": 2.5}, 2.5, 0.0, False),
        ({"device": "cuda", "num_workers": 2,
          "colocated": {"resources": {"num_nodes": 2, "gpus_per_node": 3}}}, 1.0, 3.0, True),
        ({"device": "cuda"}, 1.0, 1.0, False),
        ({"device": "cuda", "num_gpus_per_worker": 0.5}, 1.0, 0.5, False),
    ],
)
def test_worker_resources_come_from_the_config(kw: dict[str, Any], cpus: float, gpus: float, spread: bool) -> None:
    from screl.config import from_dict

    res = worker_resources(from_dict(GenerationConfig, kw))
    assert (res.num_cpus, res.num_gpus, res.spread) == (cpus, gpus, spread)
    assert res.actor_options()["num_cpus"] == cpus and res.actor_options()["num_gpus"] == gpus
    assert ("scheduling_strategy" in res.actor_options()) is spread


def test_workers_that_do_not_fit_the_cluster_fail_naming_the_knobs() -> None:
    g = _gen(num_workers=3, num_cpus_per_worker=2.0)
    check_cluster_fits(g, {"CPU": 6.0})
    with pytest.raises(RuntimeError, match=r"3 worker\(s\) x 2 CPU = 6 CPU, the Ray cluster has 5 "
                                           r"\(data.init_args.generation.num_cpus_per_worker"):
        check_cluster_fits(g, {"CPU": 5.0})
    with pytest.raises(RuntimeError, match=r"1 GPU, the Ray cluster has 0 .*num_gpus_per_worker"):
        check_cluster_fits(_gen(device="cuda"), {"CPU": 8.0})


def test_custom_resources_reach_the_actor_options_and_the_fit_check() -> None:
    g = _gen(num_workers=2, resources={"rollout_node": 1.5})
    res = worker_resources(g)
    assert res.actor_options()["resources"] == {"rollout_node": 1.5}
    assert res.demand() == {"CPU": 1.0, "rollout_node": 1.5}
    assert "resources" not in worker_resources(_gen()).actor_options()
    check_cluster_fits(g, {"CPU": 2.0, "rollout_node": 3.0})
    with pytest.raises(RuntimeError, match=r"2 worker\(s\) x 1.5 rollout_node = 3 rollout_node, the Ray cluster "
                                           r"has 0 \(data.init_args.generation.resources.rollout_node; start a node"):
        check_cluster_fits(g, {"CPU": 8.0})


def test_engine_options_carry_the_generation_settings() -> None:
    g = _gen(max_batch_size=7, backend_args={"k": 1}, num_threads=2)
    run = RunConfig.from_dict({"grpo": {}, "async_rl": {"recompute_kv_cache_after_weight_updates": True}})
    opts = engine_options(g, run, seed=11)
    assert opts == EngineOptions(device="cpu", num_threads=2, max_batch_size=7,
                                 recompute_kv_cache_after_weight_updates=True, seed=11, args={"k": 1})
