"""``ShapesTask``: CLEVR-like questions about generated images of coloured shapes (no download).

Each prompt is a scene of up to four shapes (square, circle, triangle) in a 2 x 2 grid of cells on a white canvas,
drawn with PIL, and a question about it: ``how many red squares?`` (a count, answered by a digit in ``0 ..
max_shapes``) or ``what colour is the circle?`` (asked only of a scene with exactly one circle). The answers are
drawn first and balanced over the prompts in use (each answer equally often, within one), so a policy blind to the
image scores chance: ``1 / (max_shapes + 1)``, or one over the number of colours. The scene, the question and the answer follow from
the prompt id and the task's seed alone, so every process draws the same image.

The images never pass through the controller: a prompt record carries the scene as plain metadata (cells, shapes,
colours) and :meth:`ShapesTask.images` draws it where it is needed, on the rollout worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from screl.envs.base import PromptRecord, Task

COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = ("count", "colour")


class ShapesTask(Task):
    """Questions about generated shape images; reward 1.0 for the exact answer (the completion, stripped and lower
    case), else 0.0.

    Args:
        num_prompts: Prompts (ids ``0 .. num_prompts - 1``).
        questions: Question kinds to ask: ``count`` (``how many <colour> <shape>s?``) and/or ``colour``
            (``what colour is the <shape>?``).
        colours: Colours to draw from (names of ``COLOURS``).
        shapes: Shapes to draw from (of ``SHAPES``).
        max_shapes: Shapes per scene, at most (1 to 4; at least 1).
        image_size: Canvas side in pixels.
        seed: Scenes and questions are drawn from ``(seed, prompt_id)``, the answers from ``seed``.
        blank_images: Every image is the blank canvas (the answers unchanged): the blind control of a learning
            figure (``bench/vlm_learning.py``), which can only learn the answers' shares.
    """

    def __init__(self, num_prompts: int = 256, questions: Sequence[str] = QUESTIONS,
                 colours: Sequence[str] = tuple(COLOURS), shapes: Sequence[str] = SHAPES, max_shapes: int = 3,
                 image_size: int = 56, seed: int = 0, blank_images: bool = False) -> None:
        bad = [q for q in questions if q not in QUESTIONS] + [c for c in colours if c not in COLOURS]
        bad += [s for s in shapes if s not in SHAPES]
        if bad or not questions or not colours or not shapes:
            raise ValueError(f"ShapesTask: unknown or empty questions/colours/shapes {bad}; choose from {QUESTIONS}, "
                             f"{tuple(COLOURS)}, {SHAPES}")
        if not 1 <= max_shapes <= 4:
            raise ValueError(f"ShapesTask: max_shapes={max_shapes} must be in 1..4 (a 2 x 2 grid of cells)")
        if num_prompts < 1 or image_size < 8:
            raise ValueError(f"ShapesTask: num_prompts={num_prompts} must be >= 1 and image_size={image_size} >= 8")
        self.num_prompts, self.questions, self.colours = num_prompts, tuple(questions), tuple(colours)
        self.shapes, self.max_shapes, self.image_size, self.seed = tuple(shapes), max_shapes, image_size, seed
        self.blank_images = blank_images
        self._records = [self._record(i, kind, a) for i, (kind, a) in enumerate(self._balanced_answers())]

    def prompts(self) -> list[PromptRecord]:
        return list(self._records)

    def _balanced_answers(self) -> list[tuple[str, int]]:
        """Each prompt's question kind and answer index, drawn first: within each kind, the answers (counts
        ``0 .. max_shapes``; colours) cycle over that kind's prompts in a seeded random order, so every answer is
        asked equally often (within one) over the prompts in use and a policy blind to the image scores chance."""
        rng = random.Random(f"shapes:{self.seed}:answers")
        kinds = [self.questions[rng.randrange(len(self.questions))] for _ in range(self.num_prompts)]
        out: list[tuple[str, int]] = [("", 0)] * self.num_prompts
        for kind in self.questions:
            ids = [i for i, k in enumerate(kinds) if k == kind]
            options = self.max_shapes + 1 if kind == "count" else len(self.colours)
            for n, i in enumerate(rng.sample(ids, len(ids))):
                out[i] = (kind, n % options)
        return out

    def _record(self, prompt_id: int, kind: str, answer_index: int) -> PromptRecord:
        rng = random.Random(f"shapes:{self.seed}:{prompt_id}")
        if kind == "colour":  # exactly one of the asked shape, in the answer's colour; others of other shapes
            colour, shape = self.colours[answer_index], rng.choice(self.shapes)
            cells = rng.sample(range(4), rng.randint(1, self.max_shapes))
            others = [s for s in self.shapes if s != shape]
            scene = [[cells[0], shape, colour]]
            scene += [[c, rng.choice(others), rng.choice(self.colours)] for c in cells[1:]] if others else []
            scene, text, answer = sorted(scene), f"what colour is the {shape}?", colour
        else:
            colour, shape, count = rng.choice(self.colours), rng.choice(self.shapes), answer_index
            scene = self._count_scene(rng, colour, shape, count)
            text, answer = f"how many {colour} {shape}s?", str(count)
        return PromptRecord(prompt_id, text, {"scene": scene, "answer": answer, "question": kind})

    def _count_scene(self, rng: random.Random, colour: str, shape: str, count: int) -> list[list[Any]]:
        """``count`` shapes of the asked kind and up to ``max_shapes - count`` others (another colour or shape), in
        random cells: the answer is drawn first, uniformly, so a policy blind to the image scores ``1 / (max_shapes +
        1)`` at best."""
        others = [(s, c) for s in self.shapes for c in self.colours if (s, c) != (shape, colour)]
        extra = rng.randint(0, self.max_shapes - count) if others else 0
        cells = rng.sample(range(4), count + extra)
        scene = [[cell, shape, colour] for cell in cells[:count]]
        scene += [[cell, *rng.choice(others)] for cell in cells[count:]]
        return sorted(scene)

    def images(self, prompt: PromptRecord) -> list[Any]:
        """The prompt's image, drawn from its scene (a PIL ``RGB`` image)."""
        from PIL import Image, ImageDraw

        size = self.image_size
        image = Image.new("RGB", (size, size), (255, 255, 255))
        if self.blank_images:
            return [image]
        draw = ImageDraw.Draw(image)
        half, pad = size // 2, max(1, size // 14)
        for cell, shape, colour in prompt.metadata["scene"]:
            x0, y0 = (cell % 2) * half + pad, (cell // 2) * half + pad
            x1, y1 = x0 + half - 2 * pad, y0 + half - 2 * pad
            fill = COLOURS[colour]
            if shape == "square":
                draw.rectangle((x0, y0, x1, y1), fill=fill)
            elif shape == "circle":
                draw.ellipse((x0, y0, x1, y1), fill=fill)
            else:
                draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
        return [image]

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        return 1.0 if completion.strip().lower() == prompt.metadata["answer"] else 0.0
