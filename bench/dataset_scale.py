"""DatasetTask at scale: start-up time and memory over a GSM8K-like parquet of 10k, 100k and 1M rows.

    python bench/dataset_scale.py [--sizes 10000 100000 1000000]

For each size, in a temp dir: a parquet file in GSM8K's layout (``question``, ``answer`` ending in ``#### n``) plus
a string ``id``, a ``source``, an integer ``level`` and a struct ``meta`` column. Each size runs in fresh processes
(a cold ``datasets`` cache under the temp dir, so the first read converts the parquet, as a first run does):

* the driver: ``DatasetTask(...)`` (string ids, ``max_prompt_tokens``), ``prepare`` with a policy whose subword
  tokenizer (a BPE trained here on the generated text: no download) counts every prompt's tokens and whose config
  gives a context (so the context check runs too), then one pass over ``prompts()`` reading what the controller
  reads of each record (id, ``task_source``, ``dataset_id``). ``startup_s`` is all of it; its parts are listed.
* a worker: a new process that unpickles the prepared task (the pickle's size is reported) and looks up 1000
  prompts by id (the first opens the dataset again from the ``datasets`` cache).
* the rollout controller: a new process that unpickles the task, builds the core's table of the training prompts
  (``screl.controller.settings.core_prompts``: ids and routing keys) and starts a ``RolloutCore`` over it.

RSS is ``VmRSS`` (``rss_mb``) with its anonymous part (``anon_mb``: the process's own memory) and its file-backed
part (``file_mb``: pages of the memory-mapped Arrow cache, shared and reclaimable), each less the same process's
figure after its imports. Targets (issue 47): RSS growth from 10k to 1M rows <= 200 MB per process; start-up at 1M
rows <= 30 s on a 2-core machine. Writes ``bench/results/dataset_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from screl.models.spec import PolicySpec

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "dataset_scale.json"
WORDS = ("natalia sold clips to of her friends in april and then she half as many may how did sell altogether "
         "weng earns an hour for babysitting yesterday just minutes much betty is saving money new wallet which "
         "costs grandparents gave twice parents need more buy julie reading book pages read today").split()


def _status() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return {"rss_mb": out["VmRSS"], "anon_mb": out["RssAnon"], "file_mb": out["RssFile"], "peak_mb": out["VmHWM"]}


def _growth(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 1) for k in after}


def write_parquet(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(rows)
    chunk = 100_000
    writer = None
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        questions = [" ".join(rng.choices(WORDS, k=rng.randint(25, 60))) + f" {rng.randint(1, 99)}?" for _ in range(n)]
        answers = [" ".join(rng.choices(WORDS, k=rng.randint(30, 70))) + f" #### {rng.randint(1, 999)}"
                   for _ in range(n)]
        table = pa.table({
            "id": [f"gsm8k-like/train/{start + i:07d}" for i in range(n)], "question": questions, "answer": answers,
            "source": ["gsm8k" if i % 3 else "math" for i in range(n)], "level": [i % 5 for i in range(n)],
            "meta": [{"split": "train", "index": start + i} for i in range(n)]})
        writer = writer or pq.ParquetWriter(str(path), table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def train_tokenizer(folder: Path) -> None:
    """A 2000-token BPE over the benchmark's words, saved as a ``transformers`` fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rng = random.Random(0)
    sample = [" ".join(rng.choices(WORDS, k=40)) + f" {rng.randint(0, 999)}" for _ in range(2000)]
    tk.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<pad>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(str(folder))


class BenchPolicy(PolicySpec):
    """The benchmark's policy: a subword tokenizer and a 4096-position context; no model."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir

    def build_model(self) -> Any:
        raise NotImplementedError("bench/dataset_scale.py builds no model")

    def build_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def build_config(self) -> Any:
        return type("Config", (), {"max_position_embeddings": 4096})()


def driver(parquet: str, tokenizer_dir: str, blob: str) -> dict[str, Any]:
    """Construct, prepare and read the prompts once, as a run's start does; pickle the task for the worker."""
    from screl.envs import DatasetTask

    policy = BenchPolicy(tokenizer_dir)
    base = _status()
    t0 = time.perf_counter()
    task = DatasetTask(parquet, prompt_column="question", id_column="id", task_source_column="source",
                       max_prompt_tokens=400, reward_fn="operator:eq")
    t1 = time.perf_counter()
    task.prepare(policy, os.path.join(os.path.dirname(blob), "run"))
    t2 = time.perf_counter()
    core = [(p.prompt_id, p.metadata.get("task_source"), p.metadata.get("dataset_id")) for p in task.prompts()]
    t3 = time.perf_counter()
    kept = len(core)
    del core
    data = pickle.dumps(task)
    Path(blob).write_bytes(data)
    return {"construct_s": round(t1 - t0, 2), "prepare_s": round(t2 - t1, 2), "prompts_pass_s": round(t3 - t2, 2),
            "startup_s": round(t3 - t0, 2), "prompts": kept, "pickle_bytes": len(data),
            "rss_growth": _growth(_status(), base)}


def worker(blob: str) -> dict[str, Any]:
    """Unpickle the task and look 1000 prompts up by id (the first opens the dataset again)."""
    import numpy as np

    from screl.envs import DatasetTask
    from screl.envs.dataset_columns import string_prompt_id

    assert DatasetTask
    data = Path(blob).read_bytes()
    base = _status()
    t0 = time.perf_counter()
    task = pickle.loads(data)
    rows = task.selected("train")
    rng = np.random.default_rng(0)
    ids = [string_prompt_id(f"gsm8k-like/train/{int(r):07d}") for r in rng.choice(rows, size=min(1000, len(rows)))]
    t1 = time.perf_counter()
    texts = [task.prompt(pid).text for pid in ids]
    t2 = time.perf_counter()
    assert all(texts)
    return {"unpickle_s": round(t1 - t0, 2), "lookups_1000_s": round(t2 - t1, 2), "rss_growth": _growth(_status(), base)}


def controller(blob: str) -> dict[str, Any]:
    """The rollout controller's share: unpickle the task, build the core's prompt table from it and start the core
    over it (what ``RolloutController`` does when it starts)."""
    from screl.controller.settings import core_prompts
    from screl.data.core import RolloutCore
    from screl.data.core_types import CoreSettings
    from screl.data.ledger import RecoveryPolicy
    from screl.data.samplers import InOrderSampler
    from screl.envs import DatasetTask

    assert DatasetTask
    data = Path(blob).read_bytes()
    base = _status()
    t0 = time.perf_counter()
    task = pickle.loads(data)
    prompts = core_prompts(task)
    t1 = time.perf_counter()
    core = RolloutCore(CoreSettings(prompts=prompts, groups_per_step=8, generations_per_prompt=4, max_num_epochs=1),
                       InOrderSampler(), RecoveryPolicy())
    t2 = time.perf_counter()
    assert core.batches_per_epoch == len(prompts) // 8
    return {"prompt_table_s": round(t1 - t0, 2), "core_s": round(t2 - t1, 2), "rss_growth": _growth(_status(), base)}


def _child(*args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        role, *rest = args.child
        sys.path.insert(0, str(REPO))
        print(json.dumps({"driver": driver, "worker": worker, "controller": controller}[role](*rest)))
        return
    results: dict[str, Any] = {"cpus": os.cpu_count(), "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "hf_cache")
        train_tokenizer(Path(tmp) / "tok")
        for rows in args.sizes:
            parquet = Path(tmp) / f"gsm8k_like_{rows}.parquet"
            t = time.perf_counter()
            write_parquet(parquet, rows)
            blob = str(Path(tmp) / f"task_{rows}.pkl")
            entry = {"parquet_mb": round(parquet.stat().st_size / 2**20, 1), "write_s": round(time.perf_counter() - t, 1),
                     "driver": _child("--child", "driver", str(parquet), str(Path(tmp) / "tok"), blob),
                     "worker": _child("--child", "worker", blob),
                     "controller": _child("--child", "controller", blob)}
            results["sizes"][str(rows)] = entry
            print(rows, json.dumps(entry), flush=True)
    small, large = (results["sizes"].get(str(n)) for n in (min(args.sizes), max(args.sizes)))
    if small and large and small is not large:
        results["growth_mb_smallest_to_largest"] = {
            role: {k: round(large[role]["rss_growth"][k] - small[role]["rss_growth"][k], 1)
                   for k in ("rss_mb", "anon_mb", "file_mb")} for role in ("driver", "worker", "controller")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
