"""A checkpoint bundle as an export reads it: found (a run's checkpoint root: its newest bundle; or one bundle,
``.../step_<n>``, on any fsspec URL the checkpoint store reads), checked against its manifest as a resume checks it,
and its weights taken out of the Lightning checkpoint. Read-only: nothing in the bundle is written."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from screl.checkpoint.layout import CorruptPartError, IncompleteError
from screl.checkpoint.resume import LIGHTNING_CKPT
from screl.checkpoint.store import BundleInfo, CheckpointStore, safe_torch_load
from screl.export.record import RECORD_KEY, ExportError, record_from_config, spec_from_dict
from screl.models.lora import BaseMismatchError, LoRASettings, bundle_adapters, merged_policy_weights
from screl.models.value import critic_state

__all__ = ["BundleWeights", "open_bundle", "read_bundle"]

_STEP = re.compile(r"step_(\d+)")


@dataclass
class BundleWeights:
    """What an export takes out of a bundle: the record (policy spec, critic spec, generation settings), the
    policy's weights in Hugging Face names and the critic's (PPO) in ``ValueModel``'s."""

    url: str
    step: int
    record: dict[str, Any]
    policy: dict[str, Tensor]
    critic: dict[str, Tensor] | None
    layout: str
    """``single`` (one ``lightning.ckpt``: one process or ``DDPStrategy``) or ``megatron`` (sharded)."""
    lora: tuple[LoRASettings, dict[str, Tensor]] | None = None
    """A LoRA run's bundle: its settings and adapters (``policy`` is then the merged model); None otherwise."""


def open_bundle(source: str, storage_options: Mapping[str, Any] | None = None) -> tuple[CheckpointStore, BundleInfo]:
    """The bundle ``source`` names: ``.../step_<n>`` itself, else the newest complete bundle under the root."""
    root, _, last = source.rstrip("/").rpartition("/")
    try:
        if _STEP.fullmatch(last) and root:
            store = CheckpointStore(root, storage_options)
            return store, store.open(int(last.removeprefix("step_")))
        store = CheckpointStore(source, storage_options)
        found = store.scan()
    except IncompleteError as err:
        raise ExportError(f"{source}: not a complete checkpoint bundle: {err}") from err
    except OSError as err:
        raise ExportError(f"{source}: cannot read it ({type(err).__name__}: {err})") from err
    if found.latest is None:
        skipped = "".join(f"\n  {name}: {why}" for name, why in found.skipped)
        raise ExportError(f"{source}: no complete checkpoint bundle (step_<n>/ with its manifest.json) there{skipped}")
    return store, found.latest


def _verify(store: CheckpointStore, bundle: BundleInfo) -> None:
    """Every part's size and SHA-256 against the manifest, before anything loads (as a resume checks them)."""
    try:
        store.verify(bundle)
    except CorruptPartError as err:
        raise ExportError(f"refusing to export {bundle.url}: part {err.part!r} failed its {err.check} check ({err}). "
                          "Export an older bundle (SOURCE/step_<n>) or restore that file from a copy") from err


def read_bundle(source: str, storage_options: Mapping[str, Any] | None = None,
                config: str | None = None) -> BundleWeights:
    """Find, check and read the bundle ``source`` names; ``config``: the run's ``config.yaml`` for a bundle that
    carries no record (a run without the ``HFExport`` callback)."""
    store, bundle = open_bundle(source, storage_options)
    _verify(store, bundle)
    sharded = any(name.startswith(LIGHTNING_CKPT + "/") for name in bundle.parts)
    if LIGHTNING_CKPT not in bundle.parts and not sharded:
        raise ExportError(f"{bundle.url}: no {LIGHTNING_CKPT} in the bundle (not a trainer bundle)")
    if not sharded:
        ckpt = safe_torch_load(store.read_bytes(bundle, LIGHTNING_CKPT), f"{LIGHTNING_CKPT} of {bundle.url}")
        record = _record(ckpt, config, bundle.url)
        state = ckpt.get("state_dict") or {}
        policy, lora = _policy(ckpt, record, bundle.url)
        critic = critic_state(state) or None
        return BundleWeights(bundle.url, bundle.step, record, policy, critic, "single", lora)
    with tempfile.TemporaryDirectory(prefix="screl-export-") as tmp:
        local = os.path.join(tmp, LIGHTNING_CKPT)
        store.download_dir(bundle, LIGHTNING_CKPT, local)
        common = safe_torch_load(_read(os.path.join(local, "common.pt"), bundle.url), f"common.pt of {bundle.url}")
        record = _record(common, config, bundle.url)
        from screl.export.megatron import megatron_policy_weights

        policy, critic = megatron_policy_weights(local, record)
    return BundleWeights(bundle.url, bundle.step, record, policy, critic, "megatron")


def _policy(ckpt: Mapping[str, Any], record: Mapping[str, Any],
            url: str) -> tuple[dict[str, Tensor], tuple[LoRASettings, dict[str, Tensor]] | None]:
    """The policy's weights in Hugging Face names, and a LoRA run's settings and adapters: its ``state_dict`` holds
    the adapters only, so the policy is the base the spec builds (checked against the run's fingerprint) merged."""
    found = bundle_adapters(ckpt)
    if found is None:
        state = ckpt.get("state_dict") or {}
        return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}, None
    spec = spec_from_dict(record.get("policy"), "the run's policy spec (model.init_args.policy)")
    try:
        return merged_policy_weights(ckpt, spec), found
    except BaseMismatchError as err:
        raise ExportError(f"refusing to export {url}: {err}. The export rebuilds the base from the policy spec: make "
                          "the base's files the run trained on available (the same path or hub revision)") from err
    except ValueError as err:
        raise ExportError(f"{url}: a LoRA bundle whose adapters cannot be loaded onto its base: {err}") from err


def _read(path: str, url: str) -> bytes:
    if not os.path.isfile(path):
        raise ExportError(f"{url}: {LIGHTNING_CKPT}/common.pt is missing (not a MegatronStrategy checkpoint?)")
    with open(path, "rb") as f:
        return f.read()


def _record(ckpt: Mapping[str, Any], config: str | None, url: str) -> dict[str, Any]:
    """The record: ``--config``'s when given, else the one ``HFExport`` stored in the checkpoint."""
    if config is not None:
        return record_from_config(config)
    stored = (ckpt.get("callbacks") or {}).get(RECORD_KEY)
    if isinstance(stored, Mapping) and stored.get("policy"):
        return dict(stored)
    raise ExportError(f"{url}: the bundle does not say which policy spec it trained (its run had no "
                      "screl.callbacks.HFExport in trainer.callbacks). Pass the run's config: screl export SOURCE "
                      "--out DIR --config RUN_LOG_DIR/config.yaml")
