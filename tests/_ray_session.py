"""One Ray cluster per test process (``-n 2``: per xdist worker), and a way for a file that needs a cluster of
its own (logical GPUs, a multi-node cluster) to set the shared one aside for its duration.

The e2e and data-plane files share a session cluster; with ``--dist loadfile`` a worker may run the placement
files after them, in the same process, where ``ray.init`` can only join one cluster at a time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from screl.dataplane import start_local_ray, stop_ray_if_started

_shared: dict[str, Any] = {}  # the arguments of the session cluster this process started, while it runs


@contextmanager
def session_ray(**kwargs: Any) -> Iterator[None]:
    """Start the session's shared local cluster with ``kwargs`` (or keep the one already started)."""
    started = start_local_ray(**kwargs)
    if started:
        _shared.clear()
        _shared.update(kwargs)
    try:
        yield
    finally:
        stop_ray_if_started(started)
        if started:
            _shared.clear()


@contextmanager
def ray_set_aside() -> Iterator[None]:
    """Shut the shared cluster down (if it runs) for the block, then start it again as it was."""
    import ray

    restore = dict(_shared) if ray.is_initialized() and _shared else None
    if ray.is_initialized():
        ray.shutdown()
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if restore is not None:
            start_local_ray(**restore)
