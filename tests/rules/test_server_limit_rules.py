"""The policy server's limits in ``screl check``: each must be positive, and agents that run at once fit under them."""

from __future__ import annotations

from pathlib import Path

import pytest
from _check_helpers import load_config, run_check


def test_server_limits_are_checked_against_the_agents_that_run_at_once(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config("grpo_agent_tiny.yaml")  # AgentWorkflow, 1 worker, max_concurrent 64 (its default)
    assert run_check(cfg, tmp_path, capsys)[0] == 0
    server = cfg["data"]["init_args"]["generation"]["http_server"]
    server.update(max_concurrent_requests=16, max_body_bytes=0)
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 2 and "2 problem(s)" in out, out
    assert "data.init_args.generation.http_server.max_body_bytes = 0: must be an integer > 0" in out
    assert ("data.init_args.generation.http_server.max_concurrent_requests = 16: is below the agents that run at "
            "once (1 worker(s) x workflow_args.max_concurrent 64 = 64)") in out
    cfg["data"]["init_args"]["generation"]["workflow_args"]["max_concurrent"] = 8
    server["max_body_bytes"] = 1 << 20
    assert run_check(cfg, tmp_path, capsys)[0] == 0
