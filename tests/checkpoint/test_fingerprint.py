"""The bootstrap fingerprint: fail-closed identity, glob exclusions, anchor validation messages."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from _ckpt_helpers import tree

from screl.checkpoint import (
    DEFAULT_EXCLUDED_PATHS,
    CheckpointStore,
    FingerprintMismatchError,
    bootstrap_fingerprint,
    compatibility_identity,
    read_bootstrap_anchor,
    validate_bootstrap_anchor,
    validate_excluded_paths,
    write_bootstrap_anchor,
)
from screl.checkpoint.fingerprint import path_matches


def _run_blocks() -> dict[str, Any]:
    return {
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4, "max_num_epochs": 10},
        "async_rl": {
            "sampler": {"name": "in_order", "max_lookahead_versions": 1},
            "max_buffered_rollouts": 16,
            "event_log": True,
            "rollout_failure": {"max_infra_attempts": 5, "backoff_base_s": 1.0},
        },
        "data_plane": {"enabled": True, "backend": "simple", "num_storage_units": 1},
        "checkpointing": {"enabled": True, "checkpoint_dir": "runs/a/ckpt", "save_period": 1},
        "rollout_checkpointing": {"snapshot_attempt_interval_s": 120.0, "keep_latest_k": 2},
        "rollout_recovery": {"default_granularity": "sibling"},
        "token_capture": {"enabled": True},
        "ray": {"address": None, "num_cpus": 6},
    }


def make_config() -> dict[str, Any]:
    """A config shaped like ``ScrelCLI.config_dict()`` (top-level blocks also linked into the DataModule)."""
    return {
        "config": [Path("configs/grpo_tiny.yaml")],
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 60,
            "logger": None,
            "callbacks": None,
            "default_root_dir": "runs/a",
            "log_every_n_steps": 1,
            "enable_progress_bar": None,
        },
        "model": {
            "class_path": "screl.GRPO",
            "init_args": {
                "policy": {
                    "class_path": "screl.models.TinyCausalLM",
                    "init_args": {"scale": "tiny", "seed": 0},
                },
                "loss_fn": {"class_path": "screl.algos.ClippedPGLoss", "init_args": {"ratio_clip_max": 0.28}},
                "learning_rate": 0.003,
                "weight_decay": 0.0,
                "max_grad_norm": 1.0,
                "temperature": 1.0,
            },
        },
        "data": {
            "class_path": "screl.RolloutDataModule",
            "init_args": {
                "task": {"class_path": "screl.envs.CountLetter", "init_args": {"letter": "a"}},
                "generation": {
                    "backend": "torch",
                    "num_workers": 1,
                    "max_new_tokens": 16,
                    "temperature": 1.0,
                    "num_threads": 1,
                    "max_batch_size": 64,
                    "device": "cpu",
                    "injected_latency_s": 0.0,
                    "bad_words": ["x", "y"],
                },
                "run": _run_blocks(),
                "step_timeout_s": 600.0,
                "run_dir": "runs/a",
            },
        },
        **_run_blocks(),
    }


def _set(config: dict[str, Any], dotpath: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(config)
    node: Any = out
    *parents, leaf = dotpath.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value
    return out


BASE = make_config()


def test_fingerprint_is_a_stable_sha256_independent_of_key_order() -> None:
    fp = bootstrap_fingerprint(BASE)
    assert len(fp) == 64 and int(fp, 16) >= 0
    reordered = dict(reversed(list(copy.deepcopy(BASE).items())))
    assert bootstrap_fingerprint(reordered) == fp


@pytest.mark.parametrize(
    ("dotpath", "value"),
    [
        ("trainer.logger", {"class_path": "lightning.pytorch.loggers.WandbLogger"}),
        ("trainer.default_root_dir", "runs/elsewhere"),
        ("trainer.devices", 8),
        ("checkpointing.checkpoint_dir", "s3://bucket/run"),
        ("data.init_args.run.checkpointing.checkpoint_dir", "s3://bucket/run"),
        ("rollout_checkpointing.snapshot_attempt_interval_s", 30.0),
        ("ray.address", "10.0.0.1:6379"),
        ("data.init_args.run.ray.num_cpus", 64),
        ("data.init_args.generation.num_workers", 4),
        ("data.init_args.generation.device", "cuda"),
        ("data.init_args.step_timeout_s", 60.0),
        ("model.init_args.learning_rate", 1e-5),
        ("model.init_args.weight_decay", 0.1),
        ("async_rl.event_log", False),
        ("data.init_args.task.init_args.judge.api_key", "k1"),
        ("data.init_args.task.init_args.judge.port", 8000),
        ("data.init_args.task.init_args.openai_api_key", "sk-123"),
        ("data.init_args.task.init_args.hf_token", "hf_123"),
        ("data.init_args.task.init_args.db.password", "p"),
        ("data.init_args.task.init_args.db.aws_secret_access_key", "s"),
        ("data.init_args.task.init_args.server_port", 9000),
        ("config", [Path("other.yaml")]),
    ],
)
def test_operational_changes_keep_the_fingerprint(dotpath: str, value: Any) -> None:
    # credential/port keys are added to both sides with different values
    base = _set(BASE, dotpath, "original") if "task.init_args" in dotpath else BASE
    assert bootstrap_fingerprint(_set(base, dotpath, value)) == bootstrap_fingerprint(base)


@pytest.mark.parametrize(
    ("dotpath", "value"),
    [
        ("model.init_args.policy.init_args.scale", "small"),
        ("model.class_path", "screl.PPO"),
        ("data.init_args.task.init_args.letter", "b"),
        ("grpo.num_generations_per_prompt", 8),
        ("data.init_args.run.grpo.num_generations_per_prompt", 8),
        ("async_rl.sampler.max_lookahead_versions", 2),
        ("async_rl.sampler.name", "windowed"),
        ("data.init_args.generation.temperature", 0.7),
        ("data.init_args.generation.bad_words.1", "z"),
        ("data.init_args.generation.max_new_tokens", 32),
        ("rollout_recovery.default_granularity", "prompt_group"),
        ("seed_everything", 1),
        ("custom_algo.semantic_setting", 3),
        ("data.init_args.task.init_args.pad_token", "<pad>"),
    ],
)
def test_semantic_changes_reject_the_anchor_and_are_named(tmp_path: Path, dotpath: str, value: Any) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    write_bootstrap_anchor(store, BASE)
    changed = _set(BASE, dotpath, value)
    assert bootstrap_fingerprint(changed) != bootstrap_fingerprint(BASE)
    with pytest.raises(
        FingerprintMismatchError, match=rf"(?m)^  {dotpath.replace('.', '[.]')}: .* -> "
    ) as err:
        validate_bootstrap_anchor(store, changed)
    assert "Existing checkpoint state was not modified" in str(err.value)
    assert "extra_fingerprint_excluded_paths" in str(err.value)


def test_extra_exclusions_with_one_and_any_level_wildcards() -> None:
    config = _set(BASE, "custom_algo", {"runtime": {"poll_s": 1}, "deep": {"a": {"observability": "x"}}})
    config = _set(config, "env", {"workers": [{"log_dir": "/a", "seed": 1}, {"log_dir": "/b", "seed": 2}]})
    extras = ["custom_algo.runtime", "env.workers.*.log_dir", "**.observability"]
    fp = bootstrap_fingerprint(config, extras)
    for dotpath, value in [
        ("custom_algo.runtime.poll_s", 9),
        ("env.workers.1.log_dir", "/c"),
        ("custom_algo.deep.a.observability", "y"),
    ]:
        assert bootstrap_fingerprint(_set(config, dotpath, value), extras) == fp, dotpath
    assert bootstrap_fingerprint(_set(config, "env.workers.1.seed", 3), extras) != fp
    identity = compatibility_identity(config, extras)
    assert identity["env"]["workers"] == [{"seed": 1}, {"seed": 2}]
    # the exclusion list is hashed: the same extras must be set on the original run and the restart
    assert bootstrap_fingerprint(config) != fp


def test_excluded_list_elements_keep_their_indices() -> None:
    config = _set(BASE, "env", {"servers": ["a", "b", "c"]})
    identity = compatibility_identity(config, ["env.servers.1"])
    assert identity["env"]["servers"] == ["a", "<excluded>", "c"]


@pytest.mark.parametrize(
    ("pattern", "dotpath", "expected"),
    [
        ("**.token", "token", True),
        ("**.token", "a.b.token", True),
        ("**.token", "a.token.x", False),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.x.c", False),
        ("a.**.c", "a.c", True),
        ("a.**.c", "a.b.x.c", True),
        ("**.*_api_key", "x.openai_api_key", True),
        ("**.*_api_key", "x.API_KEY", False),
        ("a.[bc]", "a.c", True),
        ("a.?", "a.bc", False),
        ("workers.*.log_dir", "workers.3.log_dir", True),
    ],
)
def test_glob_semantics(pattern: str, dotpath: str, expected: bool) -> None:
    assert path_matches(pattern, dotpath) is expected


@pytest.mark.parametrize(
    ("paths", "match"),
    [
        ([""], "empty path"),
        ([" a.b"], "leading or trailing whitespace"),
        (["a.b "], "leading or trailing whitespace"),
        (["a..b"], "empty segment"),
        ([".a"], "empty segment"),
        (["a."], "empty segment"),
        (["a. b"], "whitespace around a segment"),
        (["*"], "matches everything"),
        (["**"], "matches everything"),
        (["**.*"], "matches everything"),
        ("a.b", "must be a list"),
        ([3], "not a string"),
    ],
)
def test_extra_paths_are_validated(paths: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_excluded_paths(paths)


def test_builtin_denylist_is_valid_and_wildcards_are_allowed_in_extras() -> None:
    assert validate_excluded_paths(DEFAULT_EXCLUDED_PATHS) == DEFAULT_EXCLUDED_PATHS
    assert validate_excluded_paths(["a.*", "**.b", "x.*_log"]) == ("a.*", "**.b", "x.*_log")


def test_mismatch_lists_20_paths_and_never_shows_credentials(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    base = _set(BASE, "data.init_args.task.init_args.api_key", "hunter2-old")
    base = _set(base, "custom", {f"k{i:02d}": i for i in range(25)} | {"long": "a"})
    write_bootstrap_anchor(store, base)
    changed = _set(base, "data.init_args.task.init_args.api_key", "hunter2-new")
    changed = _set(changed, "custom", {f"k{i:02d}": i + 100 for i in range(25)} | {"long": "b" * 500})
    with pytest.raises(FingerprintMismatchError, match="Changed paths") as err:
        validate_bootstrap_anchor(store, changed)
    message = str(err.value)
    listed = [line for line in message.splitlines() if line.startswith("  custom.")]
    assert len(listed) == 20 and "  and 6 more" in message
    assert listed[0] == "  custom.k00: 0 -> 100"
    assert "hunter2" not in message and "api_key" not in message


def test_changed_extras_are_reported(tmp_path: Path) -> None:
    store = str(tmp_path / "ck")  # a plain local directory works too
    config = _set(BASE, "custom_algo", {"runtime": "secret-ish-endpoint"})
    write_bootstrap_anchor(store, config, ["custom_algo.runtime"])
    with pytest.raises(
        FingerprintMismatchError,
        match=r"Excluded paths differ: added \[\], removed \['custom_algo"
        r"\.runtime'\]",
    ) as err:
        validate_bootstrap_anchor(store, config)
    assert "secret-ish-endpoint" not in str(err.value)


def test_long_values_are_truncated_to_160_chars(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    write_bootstrap_anchor(store, _set(BASE, "custom.long", "a"))
    with pytest.raises(FingerprintMismatchError, match="custom.long") as err:
        validate_bootstrap_anchor(store, _set(BASE, "custom.long", "b" * 500))
    line = next(line for line in str(err.value).splitlines() if "custom.long" in line)
    assert len(line.split(" -> ")[1]) == 160 and line.endswith("…")


def test_anchor_write_is_idempotent_and_validation_read_only(store: CheckpointStore) -> None:
    assert validate_bootstrap_anchor(store, BASE) is None and read_bootstrap_anchor(store) is None
    anchor = write_bootstrap_anchor(store, _set(BASE, "data.init_args.task.init_args.token", "tok-123"))
    stored = read_bootstrap_anchor(store)
    assert stored is not None and stored.fingerprint == anchor.fingerprint
    raw = store.fs.cat_file(store.path("bootstrap/manifest.json")).decode()
    assert "tok-123" not in raw and '"trainer_version": 0' in raw
    assert store.children("bootstrap") == ["manifest.json"]  # no temporary file left behind
    before = tree(store)
    assert write_bootstrap_anchor(store, BASE).fingerprint == anchor.fingerprint  # validated, not rewritten
    with pytest.raises(FingerprintMismatchError, match="data.init_args.generation.temperature: 1.0 -> 0.5"):
        write_bootstrap_anchor(store, _set(BASE, "data.init_args.generation.temperature", 0.5))
    assert tree(store) == before


def test_values_without_a_stable_json_form_are_rejected_unless_excluded() -> None:
    class Mode(Enum):
        A = "a"

    assert compatibility_identity(_set(BASE, "custom.mode", Mode.A))["custom"]["mode"] == "a"
    with pytest.raises(TypeError, match=r"config value at custom\.obj is a object"):
        bootstrap_fingerprint(_set(BASE, "custom.obj", object()))
    bootstrap_fingerprint(_set(BASE, "checkpointing.hook", object()))  # excluded: never converted


@pytest.fixture(scope="module")
def cli_configs() -> Iterator[dict[str, dict[str, Any]]]:
    """Real ``ScrelCLI`` dumps of the shipped tiny config with operational and semantic overrides."""
    from screl.cli import ScrelCLI

    repo = Path(__file__).resolve().parents[2]
    base = ["--config", str(repo / "configs" / "grpo_tiny.yaml")]
    variants = {
        "base": [],
        "operational": [
            "--checkpointing.checkpoint_dir=s3://b/run",
            "--ray.address=10.0.0.1:6379",
            "--trainer.default_root_dir=/elsewhere",
            "--model.init_args.learning_rate=0.1",
            "--data.init_args.generation.num_workers=3",
            "--rollout_checkpointing.keep_latest_k=5",
        ],
        "semantic": ["--grpo.num_generations_per_prompt=8"],
    }
    yield {
        name: ScrelCLI(args=base + extra, run=False, check_only=True).config_dict()
        for name, extra in variants.items()
    }


def test_real_cli_config_layout(cli_configs: dict[str, dict[str, Any]]) -> None:
    base = bootstrap_fingerprint(cli_configs["base"])
    assert bootstrap_fingerprint(cli_configs["operational"]) == base
    assert bootstrap_fingerprint(cli_configs["semantic"]) != base
    identity = compatibility_identity(cli_configs["base"])
    assert "checkpointing" not in identity and "checkpointing" not in identity["data"]["init_args"]["run"]
    assert "config" not in identity and "learning_rate" not in identity["model"]["init_args"]
