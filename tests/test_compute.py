"""The compute adapters (``screl.modules.compute``): chosen once from the strategy, asked by the algorithms, never
tested by them; they hold no parameters, so a module's checkpoint is its models' alone."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import torch

from screl.algos import ClippedPGLoss
from screl.models import TinyCausalLM
from screl.modules.compute import HFCompute
from screl.modules.grpo import GRPO
from screl.modules.megatron_compute import compute_for
from screl.modules.ppo import PPO
from tests.test_grpo_module import _Batches, _rollouts

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("screl/modules/grpo.py", "screl/modules/ppo.py", "screl/modules/distill.py", "screl/modules/chunked.py",
              "screl/modules/policy_gradient.py")
# what a test of the compute path looks like: the strategy's attribute, its type, Megatron's process groups
_PATH_TESTS = re.compile(r"_megatron_strategy|_megatron\(\)|isinstance\([^)]*Megatron|parallel_state")


def test_the_algorithms_ask_the_compute_adapter_never_which_path_runs() -> None:
    found = [f"{rel}:{n}: {line.strip()}" for rel in ALGORITHMS
             for n, line in enumerate((ROOT / rel).read_text().splitlines(), 1) if _PATH_TESTS.search(line)]
    assert not found, "call self.compute.<op> (screl/modules/compute.py) instead:\n" + "\n".join(found)


def test_the_path_check_sees_a_path_test() -> None:
    assert _PATH_TESTS.search("        if self._megatron_strategy is None:")
    assert _PATH_TESTS.search("            group = parallel_state.get_data_parallel_group()")
    assert not _PATH_TESTS.search("        if self.compute.pipelined:")


def test_a_module_computes_on_hugging_face_models_until_a_trainer_configures_it() -> None:
    module = GRPO(policy=TinyCausalLM(seed=0), loss_fn=ClippedPGLoss(),
                  algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2})
    assert isinstance(module.compute, HFCompute) and not module.compute.sharded
    keys = set(module.state_dict())
    from screl.datamodule import collate_chunk

    meta, data = _rollouts(3, temperature=1.0)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=_Batches([collate_chunk(meta, data, pad_id=0)]))
    assert isinstance(module.compute, HFCompute)  # Lightning's own strategy: the Hugging Face path
    assert set(module.state_dict()) == keys and not any("compute" in k for k in keys)


def test_compute_for_picks_the_megatron_adapter_under_megatron_strategy() -> None:
    from screl.strategies import MegatronStrategy

    compute = compute_for(SimpleNamespace(strategy=MegatronStrategy()))
    assert compute.sharded and not compute.pipelined
    assert type(compute_for(None)) is HFCompute
    assert type(compute_for(SimpleNamespace(strategy=object()))) is HFCompute


def test_the_loss_scales_undo_the_reduction_that_the_path_runs() -> None:
    sharded, whole = {"dp_shards": 2}, {"dp_shards": 1}
    hf = HFCompute()
    assert hf.grad_scale(sharded) == 2.0 and hf.grad_scale(whole) == 1.0  # DDP averages a chunk's shards
    assert hf.sum_grads_scale(sharded) == 1.0  # PPO's own gradient sum: nothing to undo
    assert hf.sum_over_shards(torch.tensor(3.0), whole) == 3.0  # an unsharded chunk: no collective
    assert hf.row_offset(whole, 6, torch.device("cpu")) == 0
    assert hf.clip(torch.nn.Module(), None) is None  # no max norm: no clipping


def test_ppo_keeps_its_critic_on_the_path_of_its_policy() -> None:
    module = PPO(policy=TinyCausalLM(seed=0), value=TinyCausalLM(seed=1),
                 algo={"num_prompts_per_step": 3, "num_generations_per_prompt": 2})
    assert isinstance(module.compute, HFCompute)
    exported = module.export_critic_weights()
    assert set(exported) == set(module.critic.state_dict())
    assert all(v.device.type == "cpu" for v in exported.values())
