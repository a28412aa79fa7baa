"""Seed PPO's critic from another screl run's checkpoint bundle (``ppo.warm_start_value_checkpoint``).

The URL names a run's checkpoint directory (its newest complete bundle is used) or one bundle
(``.../step_<n>``), on a local disk, a shared filesystem or an object store (fsspec). The critic's weights are
read from the bundle's Lightning checkpoint (``critic.*`` of its ``state_dict``), SHA-256 verified.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from screl.models.value import ValueModel, critic_state

log = logging.getLogger(__name__)

KEY = "ppo.warm_start_value_checkpoint"


def _bundle(url: str, storage_options: Mapping[str, Any]) -> tuple[Any, Any]:
    from screl.checkpoint.store import CheckpointStore

    root, _, last = url.rstrip("/").rpartition("/")
    step = re.fullmatch(r"step_(\d+)", last)
    if step is not None and root:
        store = CheckpointStore(root, storage_options)
        return store, store.open(int(step.group(1)))
    store = CheckpointStore(url, storage_options)
    latest = store.latest()
    if latest is None:
        raise FileNotFoundError("no complete checkpoint bundle there")
    return store, latest


def load_critic_weights(critic: ValueModel, url: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Load the critic of the run checkpointed at ``url`` into ``critic``; returns the bundle's step. Every failure
    is a ``ValueError`` naming the key: missing, incomplete, not a PPO run, or a critic of another shape."""
    from screl.checkpoint.resume import LIGHTNING_CKPT
    from screl.checkpoint.store import safe_torch_load

    try:
        store, bundle = _bundle(url, storage_options or {})
        raw = store.read_bytes(bundle, LIGHTNING_CKPT)
    except (OSError, ValueError) as err:
        raise ValueError(f"{KEY}={url!r}: cannot read a checkpoint bundle ({type(err).__name__}: {err})") from err
    ckpt = safe_torch_load(raw, f"{KEY}={url!r}: {LIGHTNING_CKPT} of step {bundle.step}")
    state = critic_state(ckpt.get("state_dict", {}))
    if not state:
        raise ValueError(f"{KEY}={url!r}: the bundle at step {bundle.step} holds no critic (not a PPO run's checkpoint)")
    own = critic.state_dict()
    wrong = sorted(set(own) ^ set(state)) + [k for k in own if k in state and state[k].shape != own[k].shape]
    if wrong:
        raise ValueError(f"{KEY}={url!r}: its critic does not match model.init_args.value (keys or shapes differ: "
                         f"{wrong[:4]}); warm-start from a run with the same value spec")
    critic.load_state_dict(state)
    log.warning("screl: critic warm-started from %s (step %d)", url, bundle.step)
    return int(bundle.step)
