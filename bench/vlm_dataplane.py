#!/usr/bin/env python
"""What a multimodal row costs in the data plane, for the two layouts a vision-language row could take.

* ``pixels`` (what screl writes: ``screl.rollout.rows.VISION_SCHEMA``): the row carries the processor's
  ``pixel_values`` and ``image_grid_thw``; the trainer reads them back as they are.
  ``trainer_get_step_s`` is the get alone: the part on the trainer's path (the workers put while it trains).
* ``reference``: the row carries the text fields only (the prompt id is in the metadata already); the trainer would
  redraw or reload each prompt's images and run the processor again (``ShapesTask.images`` +
  ``TinyVisionLM.prompt_inputs``), timed here per step as ``trainer_redraw_s``.

One step of ``configs/grpo_vlm_tiny.yaml`` (P=16 prompts x G=8 rows, real rows from the torch engine): bytes per row,
and the median over ``--iters`` of one put + get + clear of the step's 128 rows through TransferQueue
(``screl.dataplane.DataPlane``, one storage unit), for each layout. Light: a few seconds of CPU.

    python bench/vlm_dataplane.py [--iters 10]

Writes ``bench/results/vlm_dataplane.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402

P, G = 16, 8


def step_rows() -> tuple[list[dict[str, Any]], Any, Any, list[Any]]:
    from screl.envs import ShapesTask
    from screl.models import TinyVisionLM
    from screl.rollout import GenerationRequest, SamplingParams
    from screl.rollout.engines.torch_engine import TorchGenerationEngine
    from screl.rollout.rows import VISION_SCHEMA

    spec = TinyVisionLM()
    task = ShapesTask(num_prompts=256, questions=["count"], colours=["red"], shapes=["square"], max_shapes=1)
    engine = TorchGenerationEngine(spec, seed=0)
    requests = []
    for p, record in enumerate(task.prompts()[:P]):
        ids, vision = spec.prompt_inputs(engine.tokenizer, record.text, task.images(record))
        requests += [GenerationRequest(f"{p}-{g}", ids, SamplingParams(max_new_tokens=1, seed=g), vision=vision)
                     for g in range(G)]
    rows = [VISION_SCHEMA.build(r, 0.0) for r in engine.generate(requests)]
    return rows, spec, task, task.prompts()[:P]


def nbytes(row: dict[str, Any], fields: tuple[str, ...]) -> int:
    return sum(int(row[f].numel() * row[f].element_size()) for f in fields)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=c.RESULTS)
    args = parser.parse_args(argv)
    c.quiet()
    from screl.rollout.rows import ROW_SCHEMA, VISION_SCHEMA

    rows, spec, task, records = step_rows()
    layouts = {"pixels": VISION_SCHEMA.names, "reference": ROW_SCHEMA.names}
    result: dict[str, Any] = {"config": {"prompts_per_step": P, "group": G, "iters": args.iters,
                                         "image_size": spec.image_size}}
    result["bytes_per_row"] = {k: statistics.mean(nbytes(r, f) for r in rows) for k, f in layouts.items()}
    started = c.start_bench_ray()
    try:
        from screl.dataplane import DataPlane

        dp = DataPlane.start(num_storage_units=1, partition_id="bench-vlm")
        try:
            times: dict[str, list[float]] = {k: [] for k in layouts}
            gets: dict[str, list[float]] = {k: [] for k in layouts}
            for i in range(args.iters + 2):  # two warm-up rounds
                for name, fields in layouts.items():
                    keys = [f"{name}{i}_{j}" for j in range(len(rows))]
                    t0 = time.perf_counter()
                    dp.put(keys, {f: [r[f] for r in rows] for f in fields})
                    t1 = time.perf_counter()
                    dp.get(keys, fields)
                    t2 = time.perf_counter()
                    dp.clear(keys)
                    if i >= 2:
                        times[name].append(time.perf_counter() - t0)
                        gets[name].append(t2 - t1)
        finally:
            dp.shutdown()
    finally:
        c.stop_bench_ray(started)
    result["dataplane_step_s"] = {k: statistics.median(v) for k, v in times.items()}
    # the trainer waits on the get only (the workers put while it trains)
    result["trainer_get_step_s"] = {k: statistics.median(v) for k, v in gets.items()}
    redraw = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        for record in records:  # the trainer's work per step without pixels in the rows: one image per prompt
            spec.prompt_inputs(spec.build_tokenizer(), record.text, task.images(record))
        redraw.append(time.perf_counter() - t0)
    result["trainer_redraw_s"] = statistics.median(redraw)
    out = args.out_dir / "vlm_dataplane.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
