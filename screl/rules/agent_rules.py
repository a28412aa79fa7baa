"""Rules of the agent path: workflow arguments, the workflow's task, the OpenAI-compatible server's binding."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any

from screl.config_generation import DEFAULT_WORKFLOW, bind_problem
from screl.rules.context import RuleContext, get

GEN = "data.init_args.generation"


def _class(target: str) -> Any:
    module, _, name = target.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def agent_rules(c: RuleContext) -> None:
    """``workflow_args`` against the workflow's signature; multi-turn and agent workflows against the task and
    the server; a non-loopback server without an API key."""
    gen = c.gen_cfg
    workflow = str(gen.workflow or DEFAULT_WORKFLOW)
    cls = _class(workflow)
    args = gen.workflow_args or {}
    if cls is not None and args:
        params = inspect.signature(cls).parameters
        reserved = {"task", "tokenizer", "schema"}
        unknown = sorted(k for k in args if k not in params or k in reserved)
        if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            allowed = sorted(k for k in params if k not in reserved)
            c.bad(f"{GEN}.workflow_args", dict(args), f"{workflow.rpartition('.')[2]} takes no argument(s) {unknown}",
                  f"use only {allowed}")
    name = workflow.rpartition(".")[2]
    if name in ("MultiTurnWorkflow", "AgentWorkflow"):
        _multi_turn_rules(c, name, args)
    serve = gen.expose_http_server
    missing = [m for m, needed in (("fastapi", serve), ("uvicorn", serve), ("openai", name == "AgentWorkflow"))
               if needed and importlib.util.find_spec(m) is None]
    if missing:
        c.bad(f"{GEN}.expose_http_server" if serve else f"{GEN}.workflow", serve or workflow, f"needs {', '.join(missing)}, which is not installed",
              "pip install -e '.[serve]'")
    host = str(gen.http_server.host)
    problem = bind_problem(host, gen.http_server.api_key)
    if serve and problem is not None:
        c.bad(f"{GEN}.http_server.host", host, f"the policy server binds a non-loopback address without an API key "
              f"({problem})", "set http_server.api_key (clients send Authorization: Bearer <key>), or bind 127.0.0.1")


def _multi_turn_rules(c: RuleContext, name: str, args: dict[str, Any]) -> None:
    from screl.envs.environment import EnvTask

    task_path = get(c.cfg, "data.init_args.task.class_path", None)
    task_cls = _class(str(task_path)) if task_path else None
    if name == "MultiTurnWorkflow" and task_cls is not None and not (
            isinstance(task_cls, type) and issubclass(task_cls, EnvTask)):
        c.bad("data.init_args.task", task_path, "MultiTurnWorkflow drives the task's environments, and this task "
              "has none (it is not a screl.envs.environment.EnvTask)", "use an EnvTask (e.g. "
              "screl.envs.calculator.CalculatorTask), or the default SingleTurnWorkflow")
    if name == "AgentWorkflow":
        if not c.gen_cfg.expose_http_server:
            c.bad(f"{GEN}.expose_http_server", c.gen_cfg.expose_http_server, "AgentWorkflow runs the "
                  "agent against the OpenAI-compatible server", "set expose_http_server: true")
        if not args.get("agent"):
            c.bad(f"{GEN}.workflow_args.agent", args.get("agent"), "AgentWorkflow needs the agent function",
                  "set workflow_args.agent: package.module:function (called as agent(client, prompt, env))")
    for knob, low in (("max_turns", 1), ("max_total_tokens", 2)):
        v = args.get(knob)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            c.bad(f"{GEN}.workflow_args.{knob}", v, f"must be an integer >= {low}", f"set e.g. {knob}: {max(low, 4)}")
    for algo in ("grpo", "ppo"):
        block = c.cfg.get(algo)
        if not isinstance(block, dict):
            continue  # not set, or not a block (reported as such)
        on = [k for k in ("val_period", "val_at_start", "val_at_end") if block.get(k)]
        if on:
            c.bad(f"{algo}.{on[0]}", block[on[0]], f"validation runs single-turn generations, not {name}'s "
                  "conversations, so its reward would not measure what trains",
                  "set val_period: 0, val_at_start: false and val_at_end: false")


def server_limit_rules(c: RuleContext) -> None:
    """The policy server's limits are positive; agents running at once fit under the request and session bounds."""
    from screl.config_generation import server_limit_problems

    gen = c.gen_cfg
    if not gen.expose_http_server:
        return
    for key, value, problem in server_limit_problems(gen.http_server):
        c.bad(f"data.init_args.{key}", value, problem, f"set {key.rsplit('.', 1)[-1]} to a positive value")
    workflow = str(gen.workflow or DEFAULT_WORKFLOW)
    cls = _class(workflow)
    if workflow.rpartition(".")[2] != "AgentWorkflow" or cls is None:
        return
    per_worker = (gen.workflow_args or {}).get("max_concurrent", inspect.signature(cls).parameters["max_concurrent"].default)
    workers = gen.num_workers if isinstance(gen.num_workers, int) else 1
    if not isinstance(per_worker, int):
        return
    agents = workers * per_worker
    for key in ("max_concurrent_requests", "max_open_sessions"):
        bound = getattr(gen.http_server, key)
        if isinstance(bound, int) and bound < agents:
            c.bad(f"{GEN}.http_server.{key}", bound, f"is below the agents that run at once ({workers} worker(s) x "
                  f"workflow_args.max_concurrent {per_worker} = {agents}): the excess would get 429s, each a data "
                  "failure", f"raise {key} to >= {agents}, or lower workflow_args.max_concurrent")
