"""``screl.Distill`` with ``estimator: top_k``, without Ray: the teacher's top-k rows, their collation, and the loss
and gradient of a micro-batch against the same figures computed from both models' full logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from screl.algos import ClippedPGLoss
from screl.algos.distill import TOP_K_KL
from screl.config_distill import DistillationConfig
from screl.datamodule import collate_chunk
from screl.models import HFCausalLM, TinyCausalLM
from screl.modules.distill import Distill
from screl.rollout import GenerationRequest, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.teachers import DISTILL_TOP_K_SCHEMA, completion_logprobs, completion_top_k

TEACHERS = Path(__file__).resolve().parents[1] / "examples" / "distill" / "teachers"
STUDENT = TinyCausalLM(seed=0)
TEACHER = HFCausalLM(path=str(TEACHERS / "addition"), tokenizer_path=str(TEACHERS / "addition" / "tokenizer"))
"""The shipped addition teacher: sharp on sums, far from the random student (a KL of several nats)."""
GROUPS, G = 2, 2


def _module(k: int, direction: str = "reverse") -> Distill:
    cfg = DistillationConfig.coerce({"teachers": [{"name": "t", "policy": TEACHER}], "default_teacher": "t",
                                     "estimator": "top_k", "top_k": k, "kl_direction": direction})
    return Distill(policy=STUDENT, distillation=cfg, loss_fn=ClippedPGLoss(),
                   algo={"num_prompts_per_step": GROUPS, "num_generations_per_prompt": G})


def _batch(k: int) -> dict[str, Any]:
    """The student's own samples (prompts of two lengths), each row scored by the teacher as a teacher worker does."""
    engine = TorchGenerationEngine(STUDENT, seed=0)
    tok = STUDENT.build_tokenizer()
    reqs = [GenerationRequest(f"p{i}_g{s}", tok(p, add_special_tokens=False)["input_ids"],
                              SamplingParams(max_new_tokens=5, min_new_tokens=5, seed=3 * i + s))
            for i, p in enumerate(["1+2=", "13+24="]) for s in range(G)]
    results = engine.generate(reqs)
    teacher = TEACHER.build_model().eval()
    scored = completion_top_k(teacher, [(r.prompt_token_ids + r.token_ids, len(r.prompt_token_ids)) for r in results], k)
    rows = [_row(res, i, *s) for i, (res, s) in enumerate(zip(results, scored, strict=True))]
    data = DISTILL_TOP_K_SCHEMA.merge(rows)
    meta = {"keys": [r.request_id for r in reqs], "trainer_version": 0, "step_groups": GROUPS, "last_chunk": True,
            "start_weight": [0] * len(reqs)}
    return collate_chunk(meta, data, pad_id=0, schema=DISTILL_TOP_K_SCHEMA)


def _row(res: Any, i: int, lp: list[float], top_ids: torch.Tensor, top_lp: torch.Tensor) -> dict[str, torch.Tensor]:
    from screl.rollout.rows import ROW_SCHEMA

    row = ROW_SCHEMA.build(res, float(i % 2))
    row.update(teacher_logprobs=torch.tensor(lp), teacher_top_ids=top_ids, teacher_top_logprobs=top_lp)
    return row


def _full_reference(module: Distill, batch: dict[str, Any], k: int, direction: str) -> torch.Tensor:
    """The top-k KL (``direction``) from the student's and the teacher's full logits, over the chunk's valid tokens."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    student = torch.log_softmax(module.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float(), -1)
    with torch.no_grad():
        teacher = torch.log_softmax(TEACHER.build_model().eval()(input_ids=ids, attention_mask=attention)
                                    .logits[:, :-1].float(), -1)
    top_lp, top = teacher.topk(k, -1)
    mask = batch["token_mask"].bool()
    kl = TOP_K_KL[direction](student.gather(-1, top)[mask], top_lp[mask])
    return kl.sum() / mask.sum()


@pytest.mark.parity
@pytest.mark.parametrize(("k", "direction"), [(3, "reverse"), (44, "reverse"), (3, "forward"), (44, "forward")])
def test_the_micro_batch_loss_and_gradient_equal_the_full_logits_reference(k: int, direction: str) -> None:
    module = _module(k, direction)
    vocab = module.model.get_output_embeddings().weight.shape[0]
    k = min(k, vocab)  # 44: the whole vocabulary of the character tokenizer
    batch = _batch(k)
    assert batch["teacher_top_ids"].shape == (*batch["token_mask"].shape, k)
    mask = batch["token_mask"].bool()
    assert int(mask.sum()) == GROUPS * G * 5
    chunk = module._chunk_tensors(batch)
    loss, metrics = module._micro_batch_loss(batch, chunk, slice(0, GROUPS * G))
    params = [p for p in module.model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    ref = _full_reference(module, batch, k, direction)
    want = torch.autograd.grad(ref, params, allow_unused=True)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)  # the surrogate of a 0 advantage adds 0
    assert ref.item() > 1.0  # a sharp teacher and a random student: a KL that could be wrong
    assert metrics[f"{direction}_kl"].item() == pytest.approx(ref.item(), rel=1e-5)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None or float(a.abs().max()) == 0.0
            continue
        assert a is not None
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the teacher's logprob of the sampled tokens is still logged, and it is the teacher worker's
    teacher_lp = completion_logprobs(TEACHER.build_model().eval(), [
        (batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist(), int((~mask[0]).long().argmin()) + 1)])[0]
    assert batch["teacher_logprobs"][0][mask[0]].tolist() == pytest.approx(teacher_lp, abs=1e-5)


def test_a_chunk_without_top_k_rows_is_refused() -> None:
    module = _module(3)
    batch = _batch(3)
    for key in ("teacher_top_ids", "teacher_top_logprobs"):
        del batch[key]
    with pytest.raises(RuntimeError, match=r"estimator is top_k but the chunk's rows carry no teacher_top_ids"):
        module._micro_batch_loss(batch, module._chunk_tensors(batch), slice(0, 2))


def test_bad_estimator_settings_are_refused_naming_the_key() -> None:
    cfg = {"teachers": [{"name": "t", "policy": TEACHER}], "default_teacher": "t", "estimator": "exact", "top_k": 0}
    with pytest.raises(ValueError, match=r"distillation.estimator = 'exact'.*distillation.top_k = 0"):
        Distill(policy=STUDENT, distillation=DistillationConfig.coerce(cfg))


def test_a_forward_kl_needs_the_top_k_estimator_and_a_known_direction() -> None:
    base = {"teachers": [{"name": "t", "policy": TEACHER}], "default_teacher": "t"}
    with pytest.raises(ValueError, match=r"distillation.kl_direction = 'forward'.*estimates the reverse KL only.*"
                                         r"set estimator: top_k, or kl_direction: reverse"):
        Distill(policy=STUDENT, distillation=DistillationConfig.coerce({**base, "kl_direction": "forward"}))
    with pytest.raises(ValueError, match=r"distillation.kl_direction = 'sideways'.*\['reverse', 'forward'\]"):
        Distill(policy=STUDENT, distillation=DistillationConfig.coerce(
            {**base, "estimator": "top_k", "kl_direction": "sideways"}))
