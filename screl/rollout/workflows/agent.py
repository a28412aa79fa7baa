"""The agent workflow: a user's agent code drives each rollout through the OpenAI-compatible server (docs/agents.md,
"Your agent: AgentWorkflow").

``generation.workflow: screl.rollout.AgentWorkflow`` with ``workflow_args: {agent: "package.module:function"}`` and
``generation.expose_http_server: true``. For every sibling the worker calls, on a thread of its own,
``agent(client, prompt, env)``: ``client`` an ``openai.OpenAI`` client bound to the server and to this sibling's
session (``X-Session-Id``; an ``async def`` agent gets an ``openai.AsyncOpenAI`` one on an event loop of its own
thread), ``prompt`` the :class:`~screl.envs.PromptRecord`, ``env`` a fresh environment of the task (an
:class:`~screl.envs.environment.EnvTask`; None for a plain task). It returns the reward, or an :class:`AgentResult`
whose ``mask`` keeps the reward and group but trains nothing (as ``StepResult.mask`` does for the direct workflow).

Invariant: the agent never handles token ids. The server records the session's turns token by token and they
become the row (:func:`screl.rollout.workflows.trajectory.build_row`), so the agent must send the assistant messages back
unchanged for the server to splice the past tokens verbatim.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from screl.envs import Task
from screl.envs.base import load_reward_fn
from screl.envs.environment import EnvTask
from screl.rollout.rows import ROW_SCHEMA, RowSchema
from screl.rollout.workflows.trajectory import TrajectoryError, Turn, build_row
from screl.rollout.workflows.workflow import Generate, RolloutItem, RolloutOutcome

__all__ = ["AgentResult", "AgentWorkflow"]


@dataclass(frozen=True)
class AgentResult:
    """What an agent may return instead of a bare reward: ``mask`` flags the conversation (a malformed tool call,
    a broken protocol): it stays in its group with its reward, but its row trains nothing (``sample_mask`` 0)."""

    reward: float
    mask: bool = False


class AgentWorkflow:
    """Rollouts run by a user's agent against the policy server.

    Args:
        task: The task (an :class:`EnvTask` gives the agent an environment per rollout).
        tokenizer: The policy's tokenizer.
        schema: The row schema (the standard one).
        agent: ``"package.module:function"``, called as ``agent(client, prompt, env) -> reward | AgentResult``
            (``async def``: awaited with an ``AsyncOpenAI`` client).
        max_concurrent: Agents running at once on this worker (each on a thread).
        timeout_s: The client's per-request timeout.
    """

    def __init__(self, task: Task, tokenizer: Any, schema: RowSchema = ROW_SCHEMA, agent: str = "",
                 max_concurrent: int = 64, timeout_s: float = 600.0) -> None:
        if not agent:
            raise ValueError("AgentWorkflow needs generation.workflow_args.agent ('package.module:function')")
        self.agent: Callable[..., Any] = load_reward_fn(agent)
        self.task, self.tokenizer, self.schema, self.timeout_s = task, tokenizer, schema, timeout_s
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="screl-agent")
        self.server: Any = None
        self.url: str | None = None
        self.api_key: str | None = None
        self.running: set[str] = set()

    def attach_server(self, server: Any, url: str, api_key: str | None) -> None:
        """The policy server (its actor handle, for the recorded turns) and its URL."""
        self.server, self.url, self.api_key = server, url, api_key

    async def run(self, items: Sequence[RolloutItem], generate: Generate) -> list[RolloutOutcome]:
        if self.server is None:
            raise RuntimeError("AgentWorkflow runs against the policy server: set generation.expose_http_server: true")
        return list(await asyncio.gather(*(self._rollout(item) for item in items)))

    async def abort(self, attempts: Sequence[str]) -> None:
        """Abort these siblings' conversations: their requests in flight end in the engine, later ones are refused,
        and the siblings report ``abort`` (the worker forwards its aborts here)."""
        mine = [a for a in attempts if a in self.running]
        if mine and self.server is not None:
            await self.server.abort_sessions.remote(mine)

    def _client(self, session: str, asynchronous: bool = False) -> Any:
        import openai

        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=self.url, api_key=self.api_key or "none", timeout=self.timeout_s, max_retries=0,
                   default_headers={"X-Session-Id": session})

    def _call(self, session: str, prompt: Any, env: Any) -> Any:
        """The agent, on a thread of the pool: a plain function with a client; an async one on a loop of its own."""
        if not inspect.iscoroutinefunction(self.agent):
            with self._client(session) as client:
                return self.agent(client, prompt, env)

        async def run() -> Any:
            async with self._client(session, asynchronous=True) as client:
                return await self.agent(client, prompt, env)

        return asyncio.run(run())

    async def _rollout(self, item: RolloutItem) -> RolloutOutcome:
        env = self.task.make_env(item.prompt) if isinstance(self.task, EnvTask) else None
        loop = asyncio.get_running_loop()
        await self.server.open_session.remote(item.attempt, item.sampling.seed)  # the same tokens in every run
        self.running.add(item.attempt)
        failure: str | None = None
        result = AgentResult(0.0)
        try:
            got = await loop.run_in_executor(self.pool, self._call, item.attempt, item.prompt, env)
            result = got if isinstance(got, AgentResult) else AgentResult(float(got))
        except Exception as err:  # noqa: BLE001 - the agent failed on this sample: a data failure, resampled
            failure = f"agent: {err!r}"[:200]
        finally:
            self.running.discard(item.attempt)
        reward = result.reward
        recorded, aborted = await self.server.take_session.remote(item.attempt)
        if aborted:
            return RolloutOutcome(item.attempt, "abort", finish_reason="abort")
        if failure is not None:
            return RolloutOutcome(item.attempt, "data_error", detail=failure)
        turns = [Turn.from_dict(t) for t in recorded]
        if not turns:
            return RolloutOutcome(item.attempt, "data_error", detail="agent: the agent made no request")
        if any(t.finish_reason == "abort" for t in turns):
            return RolloutOutcome(item.attempt, "abort", finish_reason="abort")
        try:
            row = build_row(turns, reward, self.schema, sample_mask=0.0 if result.mask else 1.0)
        except TrajectoryError as err:
            return RolloutOutcome(item.attempt, "data_error", detail=f"agent: {err}"[:200])
        last = turns[-1]
        return RolloutOutcome(item.attempt, "sealed", row=row, reward=reward,
                              end_version=last.weight_versions[-1] if last.weight_versions else 0,
                              response_len=sum(len(t.token_ids) for t in turns), finish_reason=last.finish_reason)
