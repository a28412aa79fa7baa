"""``screl check`` under hypothesis-driven mutations of every shipped config (issue 40, item 3): wrong types,
out-of-range numbers, unknown and missing keys, blocks from the other algorithm. It never crashes with a traceback:
it accepts the config, or exits 2 listing the problems, naming the key.

Seeded (``derandomize``) and bounded: the same examples on every run, ~30 s on two cores. A seeded sample of the
accepted mutations of the tiny config then trains 2 steps each (slow).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from screl.cli import check

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml"))
LOADED = {str(p.relative_to(ROOT / "configs")): yaml.safe_load(p.read_text()) for p in CONFIGS}
NAMES = sorted(LOADED)
PPO_BLOCK = LOADED["ppo_tiny.yaml"]["ppo"]
GRPO_BLOCK = LOADED["grpo_tiny.yaml"]["grpo"]

WRONG_VALUES: list[Any] = ["not-a-number", -1, 0, 10**12, -(10**12), 1.5, -0.5, math.inf, True, None, [], {},
                          [1, "x"], {"unexpected": 1}]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into ``node`` (dict keys and list indices), parents before children."""
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += _paths(value, (*prefix, key))
    return out


def _parent(cfg: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        cfg = cfg[key]
    return cfg


@st.composite
def mutations(draw: st.DrawFn) -> tuple[str, dict[str, Any], str, str]:
    """(config name, mutated config, kind of mutation, the dotted path it touched)."""
    name = draw(st.sampled_from(NAMES))
    cfg = copy.deepcopy(LOADED[name])
    kind = draw(st.sampled_from(["wrong_value", "unknown_key", "missing_key", "other_algorithm"]))
    paths = _paths(cfg)
    if kind == "other_algorithm":
        if "ppo" in cfg:
            cfg["grpo"] = copy.deepcopy(GRPO_BLOCK)
            touched = "grpo"
        else:
            cfg["ppo"] = copy.deepcopy(PPO_BLOCK)
            touched = "ppo"
        return name, cfg, kind, touched
    if kind == "unknown_key":
        dicts = [()] + [p for p in paths if isinstance(_parent(cfg, (*p, None)), dict)]
        where = draw(st.sampled_from(dicts))
        _parent(cfg, (*where, None))["zz_unknown_knob"] = 1
        return name, cfg, kind, ".".join(map(str, (*where, "zz_unknown_knob")))
    path = draw(st.sampled_from(paths))
    parent = _parent(cfg, path)
    if kind == "missing_key":
        if isinstance(parent, list):
            parent.pop(path[-1])
        else:
            del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(draw(st.sampled_from(WRONG_VALUES)))
    return name, cfg, kind, ".".join(map(str, path))


def run_check(cfg: dict[str, Any], path: Path) -> tuple[int, str]:
    """``screl check`` in-process: (exit code, everything it printed). A parse error (jsonargparse) exits through
    SystemExit(2), as on the command line; any other exception propagates: that is the crash this test looks for."""
    path.write_text(yaml.safe_dump(cfg))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = check(["--config", str(path)])
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else 1
    return rc, out.getvalue() + err.getvalue()


_KEYLIKE = re.compile(r"[A-Za-z_][\w]*\.[A-Za-z_][\w.]*")


@settings(max_examples=40, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutation=mutations())
def test_check_never_crashes_on_a_mutated_shipped_config(mutation: tuple[str, dict[str, Any], str, str],
                                                         tmp_path: Path) -> None:
    name, cfg, kind, touched = mutation
    rc, out = run_check(cfg, tmp_path / "mutated.yaml")
    assert "Traceback" not in out, f"{name}, {kind} at {touched}:\n{out[-3000:]}"
    assert rc in (0, 2), f"{name}, {kind} at {touched}: exit {rc}\n{out[-3000:]}"
    if rc == 0:
        assert "the config is valid" in out
    else:  # the problems are listed, each naming a dotted key
        named = _KEYLIKE.search(out) or re.search(rf"\b{re.escape(touched.split('.')[0])}\b", out)
        assert named, f"{name}, {kind} at {touched}: no key named in\n{out[-3000:]}"


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "ppo_tiny.yaml"])
def test_a_block_of_the_other_algorithm_is_refused_naming_it(name: str, tmp_path: Path) -> None:
    cfg = copy.deepcopy(LOADED[name])
    other = "grpo" if "ppo" in cfg else "ppo"
    cfg[other] = copy.deepcopy(GRPO_BLOCK if other == "grpo" else PPO_BLOCK)
    rc, out = run_check(cfg, tmp_path / "cfg.yaml")
    assert rc == 2 and other in out, out


# -- regressions: what the fuzzing found ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [10**12, -1])
def test_a_seed_outside_numpys_range_is_a_problem_not_a_traceback(seed: int, tmp_path: Path) -> None:
    cfg = copy.deepcopy(LOADED["grpo_tiny.yaml"])
    cfg["seed_everything"] = seed
    rc, out = run_check(cfg, tmp_path / "cfg.yaml")
    assert rc == 2 and f"seed_everything = {seed}: numpy's seed range is [0, 4294967295]" in out, out


@pytest.mark.parametrize(("path", "value"), [(("async_rl",), 5), (("checkpointing",), [1]),
                                             (("async_rl", "rollout_failure"), 0),
                                             (("async_rl", "watchdog"), 7), (("trainer",), [1, "x"])])
def test_a_scalar_in_place_of_a_block_is_a_problem_naming_it(path: tuple[str, ...], value: Any,
                                                             tmp_path: Path) -> None:
    cfg = copy.deepcopy(LOADED["grpo_dynamic.yaml"])
    _parent(cfg, path)[path[-1]] = value
    rc, out = run_check(cfg, tmp_path / "cfg.yaml")
    assert rc == 2 and f"{'.'.join(path)} = {value!r}: must be a block of settings" in out, out


# -- a sample of the accepted mutations trains ------------------------------------------------------------------
FIT_OWNED = {("trainer",), ("seed_everything",), ("grpo", "max_num_steps")}
"""Set by the run below (2 steps, its own directories): never mutated, or the run would undo the mutation."""


def accepted_mutations(n: int, seed: int, tmp: Path) -> list[tuple[str, dict[str, Any]]]:
    """The first ``n`` mutations of ``grpo_tiny.yaml`` (a wrong value or a missing key, drawn with ``seed``) that
    ``screl check`` accepts: (what was mutated, the config)."""
    rng = random.Random(seed)
    base = LOADED["grpo_tiny.yaml"]
    paths = [p for p in _paths(base) if p[:1] not in FIT_OWNED and p[:2] not in FIT_OWNED]
    out: list[tuple[str, dict[str, Any]]] = []
    for _ in range(200):
        cfg = copy.deepcopy(base)
        path = rng.choice(paths)
        parent = _parent(cfg, path)
        if rng.random() < 0.5:
            del parent[path[-1]]
            what = f"{'.'.join(map(str, path))} removed"
        else:
            value = copy.deepcopy(rng.choice(WRONG_VALUES))
            parent[path[-1]] = value
            what = f"{'.'.join(map(str, path))} = {value!r}"
        if run_check(cfg, tmp / "candidate.yaml")[0] == 0:
            out.append((what, cfg))
            if len(out) == n:
                return out
    raise AssertionError(f"fewer than {n} accepted mutations in 200 draws: {[w for w, _ in out]}")


@pytest.mark.slow
def test_a_sample_of_the_accepted_mutations_trains_two_steps(tmp_path: Path) -> None:
    """Two accepted mutations of the tiny config (seeded), each ``screl fit`` for 2 steps in this process on one
    shared Ray cluster: every run finishes its 2 steps, and its event log passes the checker."""
    from _ray_session import session_ray

    from screl.cli import ScrelCLI
    from screl.data.event_check import check_events

    sample = accepted_mutations(2, seed=40, tmp=tmp_path)
    print("\n" + "\n".join(what for what, _ in sample))
    with session_ray(num_cpus=8, namespace="screl-tests"):
        for i, (what, cfg) in enumerate(sample):
            cfg["trainer"].update(max_steps=2, default_root_dir=str(tmp_path / f"run_{i}"), enable_progress_bar=False,
                                  enable_model_summary=False)
            cfg["grpo"]["max_num_steps"] = 2
            path = tmp_path / f"run_{i}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            cli = ScrelCLI(args=["--config", str(path)], run=False)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            assert cli.trainer.global_step == 2, f"{what}: stopped at step {cli.trainer.global_step}"
            report = check_events(Path(cli.trainer.log_dir) / "events.jsonl")
            assert report.ok and report.events > 0, f"{what}: {report.violations[:5]}"
