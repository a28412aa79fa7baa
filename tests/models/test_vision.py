"""A vision-language policy without Ray: the tiny Qwen2-VL, ShapesTask's images, the multimodal rows, the torch
engine's generation with images and the trainer's recompute on the same images (logprob parity in fp32)."""

from __future__ import annotations

import pickle

import pytest
import torch

from screl.envs import ShapesTask
from screl.models import TinyCausalLM, TinyVisionLM, VisionInputs
from screl.models.logprobs import token_logprobs
from screl.models.vision import VISION_TOKENS, vision_token_ids
from screl.modules.vision_inputs import vision_forward_inputs
from screl.rollout import GenerationRequest, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import VISION_SCHEMA, vision_of_rows

SPEC = TinyVisionLM()
TASK = ShapesTask(num_prompts=16)


@pytest.fixture(scope="module")
def engine() -> TorchGenerationEngine:
    return TorchGenerationEngine(SPEC, seed=0)


def _requests(engine: TorchGenerationEngine, n: int, max_new: int = 6) -> list[GenerationRequest]:
    out = []
    for i, record in enumerate(TASK.prompts()[:n]):
        ids, vision = SPEC.prompt_inputs(engine.tokenizer, record.text, TASK.images(record))
        out.append(GenerationRequest(f"r{i}", ids, SamplingParams(max_new_tokens=max_new, seed=i), vision=vision))
    return out


def _chunk(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    meta = {"keys": list(range(len(rows))), "trainer_version": 0, "start_weight": [0] * len(rows)}
    return VISION_SCHEMA.collate(meta, VISION_SCHEMA.merge(rows), 0)


def test_shapes_task_is_deterministic_from_the_prompt_id_and_draws_its_scene() -> None:
    again = ShapesTask(num_prompts=16)
    assert TASK.prompts() == again.prompts()
    assert ShapesTask(num_prompts=16, seed=1).prompts() != TASK.prompts()
    record = next(r for r in TASK.prompts() if r.metadata["question"] == "colour")
    assert record.text.startswith("what colour is the ") and record.metadata["answer"] in ("red", "green", "blue")
    image = TASK.images(record)[0]
    assert image.size == (56, 56) and image.tobytes() == again.images(record)[0].tobytes()
    cell, shape, colour = record.metadata["scene"][0]
    centre = ((cell % 2) * 28 + 14, (cell // 2) * 28 + 18)  # inside every shape of the cell (a triangle's lower half)
    assert image.getpixel(centre) == {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}[colour]
    assert TASK.reward(record, f" {record.metadata['answer'].upper()} ") == 1.0
    assert TASK.reward(record, record.metadata["answer"] + "x") == 0.0


def test_answers_are_balanced_over_the_prompts_in_use_and_match_the_scene() -> None:
    """The answers are drawn first and balanced (each equally often, within one), so the majority answer's share,
    what a policy blind to the image can reach, is chance: 1/4 here, 1/2 for grpo_vlm_tiny's 256 prompts."""
    task = ShapesTask(num_prompts=202, questions=["count"], colours=["red", "blue"], shapes=["square"], max_shapes=3)
    answers = [r.metadata["answer"] for r in task.prompts()]
    assert sorted(answers.count(a) for a in "0123") == [50, 50, 51, 51]
    tiny = ShapesTask(num_prompts=256, questions=["count"], colours=["red"], shapes=["square"], max_shapes=1)
    assert [r.metadata["answer"] for r in tiny.prompts()].count("1") == 128
    mixed = ShapesTask(num_prompts=120)
    colours = [r.metadata["answer"] for r in mixed.prompts() if r.metadata["question"] == "colour"]
    assert max(colours.count(c) for c in ("red", "green", "blue")) - min(colours.count(c) for c in
                                                                          ("red", "green", "blue")) <= 1
    for record in mixed.prompts():
        if record.metadata["question"] == "colour":
            shape = record.text.removeprefix("what colour is the ").removesuffix("?")
            assert [c for _, s, c in record.metadata["scene"] if s == shape] == [record.metadata["answer"]]
    for record in task.prompts():
        _, colour, shape = record.text.removesuffix("s?").split()[-3:]
        drawn = sum(1 for _, s, c in record.metadata["scene"] if (s, c) == (shape, colour))
        assert str(drawn) == record.metadata["answer"] and len(record.metadata["scene"]) <= 3


def test_blank_images_keep_the_questions_and_answers_and_draw_a_white_canvas() -> None:
    blind = ShapesTask(num_prompts=16, blank_images=True)
    assert blind.prompts() == TASK.prompts()
    drawn = {blind.images(r)[0].tobytes() for r in blind.prompts()}
    assert len(drawn) == 1 and set(blind.images(blind.prompts()[0])[0].getdata()) == {(255, 255, 255)}
    assert len({TASK.images(r)[0].tobytes() for r in TASK.prompts()}) > 8


def test_prompt_records_carry_no_images_so_the_controller_never_sees_one() -> None:
    blob = pickle.dumps(TASK.prompts())  # what the controller gets: ids, text and plain metadata
    assert b"PIL" not in blob and len(blob) < 100 * len(TASK.prompts())


def test_shapes_task_refuses_unknown_questions() -> None:
    with pytest.raises(ValueError, match=r"unknown or empty questions/colours/shapes \['size'\]"):
        ShapesTask(questions=["size"])


def test_the_prompt_holds_one_placeholder_per_merged_patch_and_vision_inputs_check_their_grid() -> None:
    tok = SPEC.build_tokenizer()
    record = TASK.prompts()[0]
    ids, vision = SPEC.prompt_inputs(tok, record.text, TASK.images(record))
    assert vision is not None and tuple(vision.pixel_values.shape) == (16, 1176)
    assert vision.image_grid_thw.tolist() == [[1, 4, 4]]
    image_token = tok.convert_tokens_to_ids(VISION_TOKENS[2])
    assert ids.count(image_token) == 4  # 16 patches, merged 2 x 2
    with pytest.raises(ValueError, match=r"the grids hold 16 patches, pixel_values 15"):
        VisionInputs(vision.pixel_values[:15], vision.image_grid_thw)


def test_engine_logprobs_equal_the_trainers_recompute_on_the_same_images(engine: TorchGenerationEngine) -> None:
    results = engine.generate(_requests(engine, 6))
    banned = set(vision_token_ids(engine.model.config))
    assert all(not banned & set(r.token_ids) for r in results)  # image placeholders are never sampled
    batch = _chunk([VISION_SCHEMA.build(r, 0.0) for r in results])
    trainer = SPEC.build_model().train()  # what GRPO trains: the same weights, train mode
    with torch.no_grad():
        mine = token_logprobs(trainer, batch["input_ids"], batch["attention_mask"], 1.0, None,
                              vision_forward_inputs(trainer, batch, slice(0, 6)))
    mask = batch["token_mask"].bool()
    assert int(mask.sum()) == sum(len(r.token_ids) for r in results)
    assert (mine - batch["generation_logprobs"])[mask].abs().max() < 1e-5
    image = batch["input_ids"][:, 1:] == engine.model.config.image_token_id
    assert image.sum() == 24 and not (image & mask).any()  # the loss mask never covers an image placeholder
    blind = {k: v for k, v in vision_forward_inputs(trainer, batch, slice(0, 6)).items() if k == "position_ids"}
    with torch.no_grad():  # without the images the logprobs differ: the trainer really reads the pixels
        other = token_logprobs(trainer, batch["input_ids"], batch["attention_mask"], 1.0, None,
                               {**blind, "pixel_values": torch.zeros(96, 1176),
                                "image_grid_thw": torch.tensor([[1, 4, 4]] * 6)})
    assert (other - mine)[mask].abs().max() > 1e-4


def test_multimodal_rows_collate_padded_and_unpad_to_the_engines_images(engine: TorchGenerationEngine) -> None:
    requests = _requests(engine, 2, max_new=2)
    small = VisionInputs(torch.randn(8, 1176), torch.tensor([[1, 2, 4]]))
    rows = [VISION_SCHEMA.build(r, 1.0) for r in engine.generate(requests)]
    rows[1]["pixel_values"], rows[1]["image_grid_thw"] = small.pixel_values, small.image_grid_thw
    batch = _chunk(rows)
    assert tuple(batch["pixel_values"].shape) == (2, 16, 1176) and tuple(batch["image_grid_thw"].shape) == (2, 1, 3)
    assert batch["pixel_values"][1, 8:].abs().sum() == 0
    joined = vision_of_rows(batch["pixel_values"], batch["image_grid_thw"])
    assert joined.image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 4]]
    assert torch.equal(joined.pixel_values[16:], small.pixel_values)
    assert torch.equal(joined.pixel_values[:16], requests[0].vision.pixel_values)  # type: ignore[union-attr]


def test_a_text_engine_refuses_images_and_a_vision_trainer_refuses_rows_without_them() -> None:
    text = TorchGenerationEngine(TinyCausalLM(), seed=0)
    vision = VisionInputs(torch.zeros(16, 1176), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match=r"carries images, and Qwen2ForCausalLM has no vision tower"):
        text.generate([GenerationRequest("a", [3, 4], vision=vision)])
    model = SPEC.build_model()
    with pytest.raises(ValueError, match=r"the chunk's rows carry no images"):
        vision_forward_inputs(model, {"input_ids": torch.ones(1, 3, dtype=torch.long)}, slice(0, 1))


def test_grpo_trains_a_vision_policy_on_vision_rows() -> None:
    from screl import GRPO

    module = GRPO(policy=SPEC)
    assert module.row_schema is VISION_SCHEMA and {"pixel_values", "image_grid_thw"} <= set(module.row_schema.names)


def test_hf_vision_lm_loads_a_saved_qwen2_vl_with_its_processor(tmp_path: object) -> None:
    from screl.models import HFVisionLM

    path = str(tmp_path)
    model = SPEC.build_model()
    model.save_pretrained(path)
    SPEC.build_tokenizer().save_pretrained(path)
    SPEC.build_processor().save_pretrained(path)
    spec = HFVisionLM(path, chat_template=False)
    record = TASK.prompts()[0]
    mine = SPEC.prompt_inputs(SPEC.build_tokenizer(), record.text, TASK.images(record))
    theirs = spec.prompt_inputs(spec.build_tokenizer(), record.text, TASK.images(record))
    # exact: the saved processor loads back as the same class (Qwen2VLImageProcessorPil) with the same settings
    assert mine[0] == theirs[0] and torch.equal(mine[1].pixel_values, theirs[1].pixel_values)  # type: ignore[union-attr]
    loaded = spec.build_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True))
    with pytest.raises(FileNotFoundError, match=r"HFVisionLM: path='/nope' is neither a local directory nor a hub id"):
        HFVisionLM("/nope").build_model()


def test_hf_vision_lm_puts_its_system_prompt_in_the_system_turn_and_the_images_in_the_user_turn(
        tmp_path: object) -> None:
    from screl.models import HFVisionLM

    path = str(tmp_path)
    SPEC.build_model().save_pretrained(path)
    tok = SPEC.build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}")
    tok.save_pretrained(path)
    SPEC.build_processor().save_pretrained(path)
    spec = HFVisionLM(path, system_prompt="count them")
    record = TASK.prompts()[0]
    ids, vision = spec.prompt_inputs(spec.build_tokenizer(), record.text, TASK.images(record))
    text = spec.build_tokenizer().decode(ids)
    assert vision is not None
    system, user = text.index("system count them "), text.index("user ")
    first_image = text.index("<|vision_start|>")
    assert system < user < first_image < text.index(record.text) < text.index("assistant")


def test_validation_of_a_vision_policy_generates_from_the_prompts_images() -> None:
    """A held-out prompt is generated with its images, as its rollouts are: the same tokens as the engine given the
    prompt's processed images (and not the text-only prompt's)."""
    import asyncio

    from screl.rollout.engines.protocol import GenerationRequest, SamplingParams
    from screl.rollout.engines.torch_engine import TorchGenerationEngine
    from screl.rollout.worker import GenerationWorker

    worker = GenerationWorker(SPEC, val_task=TASK, batch_window_s=0.0)
    record = TASK.prompt(TASK.prompts()[3].prompt_id)
    sampling = SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=1.0)
    [got] = asyncio.run(worker.validate(0, [(record.prompt_id, 0, 11)], sampling))
    tok, engine = SPEC.build_tokenizer(), TorchGenerationEngine(SPEC, seed=0)
    ids, vision = SPEC.prompt_inputs(tok, record.text, TASK.images(record))
    seeded = SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=1.0, seed=11)
    [with_images] = engine.generate([GenerationRequest("a", ids, seeded, 0, vision)])
    assert vision is not None and got["response_len"] == 6
    val_ids, val_vision = worker._val_prompt(TASK, record)  # what validate sent the engine: the images too
    assert val_ids == ids and val_vision is not None and torch.equal(val_vision.pixel_values, vision.pixel_values)
    assert len(ids) > len(SPEC.prompt_token_ids(tok, record.text))  # the image placeholders are in the prompt
    completion = tok.decode(with_images.token_ids, skip_special_tokens=True)
    assert got["reward"] == TASK.reward(record, completion)
