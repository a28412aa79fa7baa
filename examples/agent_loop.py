"""An external agent loop against screl's OpenAI-compatible policy server, outside any training run.

It starts a loopback Ray cluster, one generation worker (the tiny model, random weights) and the policy
server, then runs the calculator agent (plain Python with the official ``openai`` client,
``screl.envs.calculator.calculator_agent``) on a few prompts, each in a session of its own. For each it
prints the conversation and the training row the server's token capture gives (``loss_mask`` 1 on the
model's tokens). During training ``screl.rollout.AgentWorkflow`` does exactly this for every sibling
(``configs/grpo_agent_tiny.yaml``).

    python examples/agent_loop.py
"""

from __future__ import annotations

import openai
import ray

from screl.dataplane import start_local_ray, stop_ray_if_started
from screl.envs.calculator import CalculatorTask, calculator_agent
from screl.models import TinyCausalLM
from screl.rollout.server.server import PolicyServer
from screl.rollout.worker import spawn_workers
from screl.rollout.workflows.trajectory import Turn, build_row


def main() -> None:
    started = start_local_ray(num_cpus=2, namespace="screl-agent-loop")
    try:
        policy = TinyCausalLM()
        [worker] = spawn_workers(1, policy, namespace_prefix="agent-loop")
        ray.get(worker.update_weights.remote([policy.build_model().state_dict()], 0))
        server = ray.remote(PolicyServer).options(num_cpus=0, max_concurrency=100).remote([worker], policy)
        url = ray.get(server.start.remote())
        print(f"policy server at {url}")
        tok, task = policy.build_tokenizer(), CalculatorTask()
        for prompt in task.prompts()[:4]:
            session = f"demo-{prompt.prompt_id}"
            client = openai.OpenAI(base_url=url, api_key="none", default_headers={"X-Session-Id": session})
            reward = calculator_agent(client, prompt, task.make_env(prompt))
            turns = [Turn.from_dict(t) for t in ray.get(server.take_session.remote(session))[0]]
            row = build_row(turns, reward)
            ids, p = row["input_ids"].tolist(), int(row["prompt_len"][0])
            print(f"\n{prompt.text!r}: reward {reward}, {len(turns)} turn(s)")
            print("  conversation:", repr(tok.decode(ids, skip_special_tokens=False)))
            print("  model tokens:", repr(tok.decode([t for t, m in zip(ids[p:], row["loss_mask"].tolist(),
                                                                      strict=True) if m], skip_special_tokens=False)))
    finally:
        stop_ray_if_started(started)


if __name__ == "__main__":
    main()
