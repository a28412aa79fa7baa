"""Load on the OpenAI-compatible policy server (issue 40 item 4, issue 51 item 4): its memory over many requests.

The server (``screl.rollout.server.server.PolicyServer``) runs as the runtime starts it for ``configs/grpo_agent_tiny.yaml``:
a Ray actor (``max_concurrency=1000``) bound to 127.0.0.1 in front of a torch-engine generation worker with the
agent config's tiny model. Clients are the official ``openai.AsyncOpenAI``. ``--sessions`` sessions run at once until
``--requests`` requests were sent: each session is 3 chat turns under its own ``X-Session-Id`` (each turn sends the
conversation so far, the assistant's reply appended), and when it ends the session is taken from the server as
``AgentWorkflow`` does (``take_session``), then a new one starts. Reported: requests/s, p50/p99 latency of a
request, errors (target 0), and the server actor's RSS every ``--mark`` requests; the target is RSS growth of at
most 5% from the first mark (10k requests) to the last (100k), in ``rss_growth_first_to_last``.

    .venv/bin/python bench/server_load.py                                  # 100k requests, RSS every 10k
    .venv/bin/python bench/server_load.py --requests 20000 --mark 2000 --out-name server_load_quick
    .venv/bin/python bench/server_load.py --requests 6000 --mark 2000 --tracemalloc   # where the Python heap grows
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


async def drive(url: str, server: Any, sessions: int, total: int, marks: dict[int, float] | None = None,
                pid: int | None = None, max_tokens: int = 4) -> dict[str, Any]:
    """``sessions`` concurrent 3-turn sessions until ``total`` requests were sent; the server's RSS (MB) is noted
    in ``marks`` when the requests done reach each of its keys."""
    import openai

    latencies: list[float] = []
    errors: list[str] = []
    sent = completed = 0
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120.0)

    def mark() -> None:
        done = len(latencies) + len(errors)
        for at in [m for m, v in (marks or {}).items() if v < 0 and done >= m]:
            (marks or {})[at] = rss_mb(pid) if pid is not None else 0.0
            print(f"{at} requests: server RSS {marks[at]:.1f} MB, errors {len(errors)}", flush=True)

    async def turn(sid: str, messages: list[dict[str, str]]) -> str | None:
        t0 = time.monotonic()
        try:
            reply = await client.chat.completions.create(
                model="screl-policy", messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                extra_headers={"X-Session-Id": sid})
        except Exception as err:  # noqa: BLE001 - counted and reported
            errors.append(f"{type(err).__name__}: {err}"[:300])
            mark()
            return None
        latencies.append(time.monotonic() - t0)
        mark()
        return reply.choices[0].message.content or ""

    async def session(k: int) -> None:
        nonlocal completed, sent
        n = 0
        while sent < total:
            sid = f"load-{k}-{n}-{uuid.uuid4().hex[:6]}"
            n += 1
            messages: list[dict[str, str]] = [{"role": "user", "content": QUESTIONS[(k + n) % len(QUESTIONS)]}]
            ok = True
            for t in range(TURNS):
                if sent >= total:
                    break
                sent += 1
                text = await turn(sid, messages)
                if text is None:
                    ok = False
                    break
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": str(t)}]
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
    return {"sessions": sessions, "wall_s": wall, "requests": len(latencies),
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


def run(sessions: int, total: int, mark_every: int, num_workers: int, max_tokens: int,
        trace: bool = False) -> dict[str, Any]:
    import ray

    load_before = list(os.getloadavg())
    server, url, workers, pid = start_server(num_workers, max_tokens)
    traced: dict[str, Any] | None = None
    marks: dict[int, float] = {at: -1.0 for at in range(mark_every, total + 1, mark_every)}
    try:
        asyncio.run(drive(url, server, 4, 12, max_tokens=max_tokens))  # warm-up, not counted
        if trace:  # past the first-time imports and caches of every code path
            asyncio.run(drive(url, server, sessions, 600, max_tokens=max_tokens))
            ray.get(server.__ray_call__.remote(_trace_start), timeout=60)
        rss_start = rss_mb(pid)
        figures = asyncio.run(drive(url, server, sessions, total, marks, pid, max_tokens))
        left = ray.get(server.__ray_call__.remote(  # every per-session record the server keeps
            lambda self: sum(map(len, (self.sessions, self.replies, self.responses, self.sticky, self.inflight,
                                       self.cancelled, self.seen)))), timeout=60)
        rss_end = rss_mb(pid)
        if trace:
            traced = ray.get(server.__ray_call__.remote(_trace_diff), timeout=120)
            n = max(1, figures["requests"])
            traced.update(growth_bytes_per_request=traced["growth_bytes"] / n,
                          screl_growth_bytes_per_request=traced["screl_growth_bytes"] / n)
    finally:
        for actor in (server, *workers):
            ray.kill(actor)
        ray.shutdown()
    at = {k: v for k, v in marks.items() if v >= 0}
    first, last = min(at), max(at)
    return {**figures, "turns_per_session": TURNS, "max_tokens": max_tokens, "num_workers": num_workers,
            "server_sessions_left": int(left), "server_rss_start_mb": rss_start, "server_rss_end_mb": rss_end,
            "rss_mb_at_requests": at, "rss_first_mark": first, "rss_last_mark": last,
            "rss_growth_first_to_last": at[last] / at[first] - 1.0,
            "rss_growth_kb_per_request_first_to_last": (at[last] - at[first]) * 1024 / max(1, last - first),
            "loadavg_before": load_before, **({"tracemalloc": traced} if traced is not None else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000, help="requests in all")
    p.add_argument("--mark", type=int, default=10_000, help="the server's RSS is noted every this many requests")
    p.add_argument("--sessions", type=int, default=64, help="sessions at once")
    p.add_argument("--workers", type=int, default=1, help="generation workers behind the server")
    p.add_argument("--max-tokens", type=int, default=4, help="per reply (the agent config's max_new_tokens)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--out-name", default="server_load")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace the server actor's Python heap over the run (slower): its growth and where it grew")
    args = p.parse_args(argv)
    started = time.time()
    result = run(args.sessions, args.requests, args.mark, args.workers, args.max_tokens, args.tracemalloc)
    result["machine"] = machine_info()
    result["bench_wall_s"] = time.time() - started
    result["command"] = " ".join(["bench/server_load.py", *(argv if argv is not None else sys.argv[1:])])
    print_table(["requests done", "server RSS MB"], [[k, v] for k, v in result["rss_mb_at_requests"].items()],
                title=f"policy server under load ({args.sessions} sessions)")
    print(f"{result['requests']} requests, {result['requests_per_s']:.1f} req/s, p50 {result['p50_ms']:.0f} ms, "
          f"p99 {result['p99_ms']:.0f} ms, errors {result['errors']}; RSS {result['rss_first_mark']} -> "
          f"{result['rss_last_mark']} requests: {100 * result['rss_growth_first_to_last']:+.2f}% "
          f"({result['rss_growth_kb_per_request_first_to_last']:.3f} KB per request); load average before "
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
