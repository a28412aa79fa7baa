"""Load on the OpenAI-compatible policy server (issue 40 item 4).

The server (``screl.rollout.server.server.PolicyServer``) runs as the runtime starts it for ``configs/grpo_agent_tiny.yaml``:
a Ray actor (``max_concurrency=1000``) bound to 127.0.0.1 in front of torch-engine generation workers with the
agent config's tiny model. Clients are the official ``openai.AsyncOpenAI``. For each concurrency level, that many
sessions run for a bounded time: each session is 3 chat turns under its own ``X-Session-Id`` (each turn sends the
conversation so far, the assistant's reply appended), and when it ends the session is taken from the server as
``AgentWorkflow`` does (``take_session``), then a new one starts. Reported per level and overall: requests/s,
p50/p99 latency of a request, errors (target 0), and the server actor's RSS at the start and the end (target: growth
< 10% over a 5-minute run).

    .venv/bin/python bench/server_load.py                      # 64, 128, 256 sessions x 100 s: a 5-minute run
    .venv/bin/python bench/server_load.py --sessions 64 --duration-s 30 --out-name server_load_quick
    .venv/bin/python bench/server_load.py --sessions 32 --duration-s 40 --tracemalloc   # where the Python heap grows
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from bench._report import RESULTS, machine_info, print_table, write_result  # noqa: E402

TURNS = 3
QUESTIONS = ["3+4", "7*2", "9-5", "8+1", "6*6", "2+9"]


def start_server(num_workers: int, max_tokens: int) -> tuple[Any, str, list[Any], int]:
    """Ray on loopback, ``num_workers`` torch-engine workers with the agent config's tiny model, and the policy
    server in front of them as ``RolloutRuntime._start_server`` starts it. Returns (server, url, workers, its pid)."""
    import ray

    from screl.dataplane import start_local_ray
    from screl.models import TinyCausalLM
    from screl.rollout.server.server import PolicyServer
    from screl.rollout.worker import spawn_workers

    start_local_ray(num_cpus=max(4, num_workers + 2))
    policy = TinyCausalLM(scale="tiny")
    model = policy.build_model().eval()
    workers = spawn_workers(num_workers, policy, namespace_prefix="screl-load", max_restarts=0)
    ray.get([w.update_weights.remote([model.state_dict()], 0) for w in workers], timeout=300)
    server = ray.remote(PolicyServer).options(num_cpus=0, max_concurrency=1000).remote(
        workers, policy, host="127.0.0.1", port=0, max_tokens=max_tokens, temperature=1.0)
    url = ray.get(server.start.remote(), timeout=120)
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    return server, url, workers, int(pid)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def drive(url: str, server: Any, sessions: int, duration_s: float, max_tokens: int) -> dict[str, Any]:
    """``sessions`` concurrent 3-turn sessions for ``duration_s`` (a session under way at the end finishes)."""
    import openai

    latencies: list[float] = []
    errors: list[str] = []
    completed = 0
    deadline = time.monotonic() + duration_s
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120.0)

    async def session(k: int) -> None:
        nonlocal completed
        n = 0
        while time.monotonic() < deadline:
            sid = f"load-{k}-{n}-{uuid.uuid4().hex[:6]}"
            n += 1
            messages: list[dict[str, str]] = [{"role": "user", "content": QUESTIONS[(k + n) % len(QUESTIONS)]}]
            ok = True
            for turn in range(TURNS):
                t0 = time.monotonic()
                try:
                    reply = await client.chat.completions.create(
                        model="screl-policy", messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                        extra_headers={"X-Session-Id": sid})
                except Exception as err:  # noqa: BLE001 - counted and reported
                    errors.append(f"{type(err).__name__}: {err}"[:300])
                    ok = False
                    break
                latencies.append(time.monotonic() - t0)
                text = reply.choices[0].message.content or ""
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": str(turn)}]
            try:  # the session's record, as AgentWorkflow takes it (else the server keeps it)
                await server.take_session.remote(sid)
            except Exception as err:  # noqa: BLE001
                errors.append(f"take_session: {type(err).__name__}: {err}"[:300])
                ok = False
            completed += ok

    t0 = time.monotonic()
    async with client:
        await asyncio.gather(*(session(k) for k in range(sessions)))
    wall = time.monotonic() - t0
    return {"sessions": sessions, "duration_s": duration_s, "wall_s": wall, "requests": len(latencies),
            "requests_per_s": len(latencies) / wall, "sessions_completed": completed,
            "p50_ms": 1e3 * percentile(latencies, 50), "p99_ms": 1e3 * percentile(latencies, 99),
            "errors": len(errors), "error_samples": sorted(set(errors))[:5]}


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _trace_start(self: Any) -> None:
    """In the server actor: start tracemalloc (12 frames a trace) and take the baseline snapshot."""
    import gc
    import tracemalloc

    tracemalloc.start(12)
    gc.collect()
    self._trace_base = tracemalloc.take_snapshot()


def _trace_diff(self: Any, top: int = 10) -> dict[str, Any]:
    """In the server actor: the Python heap's growth since :func:`_trace_start` (imports and tracemalloc's own left
    out), the part allocated with a frame of screl's code on the stack, and where it grew most."""
    import gc
    import tracemalloc

    gc.collect()
    skip = [tracemalloc.Filter(False, f) for f in ("<frozen importlib._bootstrap>",
                                                   "<frozen importlib._bootstrap_external>", tracemalloc.__file__,
                                                   "*/linecache.py")]
    diff = tracemalloc.take_snapshot().filter_traces(skip).compare_to(self._trace_base.filter_traces(skip),
                                                                        "traceback")
    tracemalloc.stop()
    ours = [d for d in diff if any("/screl/" in f.filename for f in d.traceback)]
    return {"growth_bytes": sum(d.size_diff for d in diff), "screl_growth_bytes": sum(d.size_diff for d in ours),
            "top": [{"kb": d.size_diff / 1024, "count": d.count_diff, "where": d.traceback.format()[-6:]}
                    for d in diff[:top]]}


def run(levels: list[int], duration_s: float, num_workers: int, max_tokens: int,
        trace: bool = False) -> dict[str, Any]:
    import ray

    load_before = list(os.getloadavg())
    server, url, workers, pid = start_server(num_workers, max_tokens)
    traced: dict[str, Any] | None = None
    try:
        asyncio.run(drive(url, server, 4, 0.01, max_tokens))  # warm-up: one session each of 4, not counted
        if trace:  # past the first-time imports and caches of every code path
            asyncio.run(drive(url, server, 16, 5.0, max_tokens))
            ray.get(server.__ray_call__.remote(_trace_start), timeout=60)
        rss_start = rss_mb(pid)
        out = []
        for sessions in levels:
            before = rss_mb(pid)
            figures = asyncio.run(drive(url, server, sessions, duration_s, max_tokens))
            left = ray.get(server.__ray_call__.remote(  # every per-session record the server keeps
                lambda self: sum(map(len, (self.sessions, self.replies, self.responses, self.sticky, self.inflight,
                                           self.cancelled, self.seen)))), timeout=60)
            after = rss_mb(pid)
            figures.update(rss_start_mb=before, rss_end_mb=after, server_sessions_left=int(left),
                           rss_growth_kb_per_request=(after - before) * 1024 / max(1, figures["requests"]))
            out.append(figures)
            print(f"{sessions} sessions: {figures['requests_per_s']:.1f} req/s, p50 {figures['p50_ms']:.0f} ms, "
                  f"p99 {figures['p99_ms']:.0f} ms, errors {figures['errors']}", flush=True)
        rss_end = rss_mb(pid)
        if trace:
            traced = ray.get(server.__ray_call__.remote(_trace_diff), timeout=120)
            n = max(1, sum(lv["requests"] for lv in out))
            traced.update(growth_bytes_per_request=traced["growth_bytes"] / n,
                          screl_growth_bytes_per_request=traced["screl_growth_bytes"] / n)
    finally:
        for actor in (server, *workers):
            ray.kill(actor)
        ray.shutdown()
    return {"levels": out, "turns_per_session": TURNS, "max_tokens": max_tokens, "num_workers": num_workers,
            "server_rss_start_mb": rss_start, "server_rss_end_mb": rss_end,
            "server_rss_growth": rss_end / rss_start - 1.0, "errors": sum(lv["errors"] for lv in out),
            "loadavg_before": load_before, **({"tracemalloc": traced} if traced is not None else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="64,128,256", help="concurrency levels, comma-separated")
    p.add_argument("--duration-s", type=float, default=100.0, help="time per level")
    p.add_argument("--workers", type=int, default=1, help="generation workers behind the server")
    p.add_argument("--max-tokens", type=int, default=4, help="per reply (the agent config's max_new_tokens)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--out-name", default="server_load")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace the server actor's Python heap over the run (slower): its growth and where it grew")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.sessions.split(",")]
    started = time.time()
    result = run(levels, args.duration_s, args.workers, args.max_tokens, args.tracemalloc)
    result["machine"] = machine_info()
    result["bench_wall_s"] = time.time() - started
    print_table(["sessions", "req/s", "p50 ms", "p99 ms", "errors", "RSS start MB", "RSS end MB"],
                [[lv["sessions"], lv["requests_per_s"], lv["p50_ms"], lv["p99_ms"], lv["errors"], lv["rss_start_mb"],
                  lv["rss_end_mb"]] for lv in result["levels"]], title="policy server under load")
    print(f"server RSS {result['server_rss_start_mb']:.0f} MB -> {result['server_rss_end_mb']:.0f} MB "
          f"({100 * result['server_rss_growth']:+.1f}%), errors {result['errors']}, load average before "
          f"{result['loadavg_before']}")
    if "tracemalloc" in result:
        t = result["tracemalloc"]
        print(f"server Python heap (tracemalloc): {t['growth_bytes'] / 1024:+.1f} KB, "
              f"{t['growth_bytes_per_request']:.1f} bytes per request, of which allocated under screl's code "
              f"{t['screl_growth_bytes_per_request']:.1f}; most:")
        for d in t["top"][:5]:
            print(f"  {d['kb']:+.1f} KB ({d['count']:+d} blocks) at {' | '.join(x.strip() for x in d['where'][-2:])}")
    path = write_result(args.out_name, result, args.out_dir)
    print(f"wrote {path}")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
