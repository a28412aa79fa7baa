"""Model specs by hub id: resolved from a Hugging Face cache laid out on disk as the hub lays it out, offline."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from screl.models import HFCausalLM, TinyCausalLM
from screl.models.hub import is_hub_id, model_source_problem

REPO, SHA = "tiny-org/tiny-lm", "0123456789abcdef0123456789abcdef01234567"


def _lay_out_cache(cache: Path, repo: str = REPO, sha: str = SHA) -> TinyCausalLM:
    """The hub's cache layout: ``models--org--name/refs/main`` naming a snapshot folder holding the files."""
    spec = TinyCausalLM(hidden_size=32, num_heads=2, num_kv_heads=1, seed=3)
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / sha
    spec.build_model().save_pretrained(snapshot)
    spec.build_tokenizer().save_pretrained(snapshot)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    return spec


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, TinyCausalLM]:
    cache = tmp_path / "hub"
    spec = _lay_out_cache(cache)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, spec


def _weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_hub_id_resolves_from_the_cache_once_and_travels_resolved(offline_cache: tuple[Path, TinyCausalLM],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cache, tiny = offline_cache
    spec = HFCausalLM(REPO)
    assert spec.model_dir() == str(cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA)
    assert _weights_equal(spec.build_model(), tiny.build_model())
    assert spec.build_tokenizer()("3+4=", add_special_tokens=False)["input_ids"] == [32, 40, 33, 41]
    # the spec's identity is the id, not this machine's cache folder
    assert str(cache) not in repr(spec) and spec == HFCausalLM(REPO)
    # a worker gets the folder the driver resolved: it reads no cache of its own
    worker = pickle.loads(pickle.dumps(spec))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache.parent / "elsewhere"))
    assert worker.model_dir() == spec.model_dir()
    assert _weights_equal(worker.build_model(), tiny.build_model())


def test_a_pinned_revision_resolves_and_a_missing_one_is_named(offline_cache: tuple[Path, TinyCausalLM]) -> None:
    cache, _ = offline_cache
    assert HFCausalLM(REPO, revision=SHA).model_dir() == HFCausalLM(REPO).model_dir()
    other = "f" * 40
    with pytest.raises(FileNotFoundError, match=rf"HFCausalLM: path='{REPO}' \(revision '{other}'\) is no local "
                                                rf"directory, and as a hub id it is not in the Hugging Face cache "
                                                rf"{cache} and HF_HUB_OFFLINE=1 forbids a download"):
        HFCausalLM(REPO, revision=other)
    assert model_source_problem(REPO, revision=other) == (
        f"'{REPO}' (revision '{other}') is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids a "
        "download")


def test_a_cache_miss_offline_names_the_id_and_the_cache(offline_cache: tuple[Path, TinyCausalLM]) -> None:
    cache, _ = offline_cache
    with pytest.raises(FileNotFoundError, match=rf"tokenizer_path='org/absent' is no local directory.*{cache}"):
        HFCausalLM(REPO, tokenizer_path="org/absent")
    assert model_source_problem(REPO) is None
    assert model_source_problem("org/absent") == (
        f"'org/absent' is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids a download")


def test_a_worker_never_downloads(offline_cache: tuple[Path, TinyCausalLM], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = HFCausalLM(REPO)
    state = {k: v for k, v in vars(spec).items() if not k.startswith("_local")}  # a spec the driver did not resolve
    stray = HFCausalLM.__new__(HFCausalLM)
    stray.__dict__.update(state)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online: still, a worker reads its cache only
    assert stray.model_dir() is None and stray.local_dir() == spec.model_dir()
    stray.__dict__["path"] = "org/not-cached"
    with pytest.raises(FileNotFoundError, match="a worker never downloads: the driver resolves hub ids"):
        stray.local_dir()


def test_paths_and_ids_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/name.v2")
    assert not is_hub_id(str(tmp_path)) and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # a folder that exists is always a path
    assert not is_hub_id("org/name")
    with pytest.raises(FileNotFoundError, match=r"path='/abs/nope' is neither a local directory nor a hub id"):
        HFCausalLM("/abs/nope").build_model()


def test_hf_hub_offline_in_the_environment_loads_from_the_cache(tmp_path: Path) -> None:
    """The real variables, in a fresh process: ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` as a user sets them."""
    _lay_out_cache(tmp_path / "hub")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code = (f"from screl.models import HFCausalLM; s = HFCausalLM({REPO!r}); "
            "print(s.build_model().config.hidden_size, s.model_dir())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["32", str(tmp_path / "hub" / "models--tiny-org--tiny-lm" / "snapshots" / SHA)]
    miss = subprocess.run([sys.executable, "-c", "from screl.models import HFCausalLM; HFCausalLM('org/absent')"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert miss.returncode == 1 and "HF_HUB_OFFLINE=1 forbids a download" in miss.stderr


def test_screl_check_names_every_model_it_cannot_load_and_downloads_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The suite runs with ``HF_HUB_OFFLINE=1`` (tests/conftest.py): an id not in the cache is refused, each under
    its own key, beside a cached one that passes, and ``screl check`` builds no spec that would download."""
    from _check_helpers import load_config, run_check

    cfg = load_config("recipes/grpo_1b_megatron_colocated.yaml")  # the policy by hub id at a pinned commit, cached
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 0 and "trainer memory" in out.lower(), out  # its config.json read from the cache
    cfg["model"]["init_args"]["policy"]["init_args"]["path"] = "org/absent-policy"
    cfg["model"]["init_args"]["policy"]["init_args"]["tokenizer_path"] = "org/absent-tokenizer"
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 2 and "2 problem(s)" in out, out
    for key, repo in (("model.init_args.policy.init_args.path", "org/absent-policy"),
                      ("model.init_args.policy.init_args.tokenizer_path", "org/absent-tokenizer")):
        assert (f"{key} = '{repo}': cannot be loaded: '{repo}' (revision '9213176726f574b556790deb65791e0c5aa438b6') "
                f"is not in the Hugging Face cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE=1 forbids a download"
                ) in out, out
    assert f"hf download {repo}" in out
