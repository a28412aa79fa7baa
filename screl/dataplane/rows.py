"""The put and the checked get of rows in one TransferQueue partition, as coroutine factories.

:class:`~screl.dataplane.client.DataPlane` runs each factory on TQ's client loop (its sync methods) or awaits it
on the caller's loop (the ``a*`` twins), so both paths share one validation and one error path. TQ answers a
missing key or field with a bare ``ValueError`` or with a short batch; :func:`get_call` turns both into a
:class:`~screl.dataplane.errors.DataPlaneKeyError` that names the missing keys (never put, or cleared) or fields.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import transfer_queue as tq
from tensordict import TensorDict

from screl.dataplane.columns import Column, check_keys, to_batch
from screl.dataplane.errors import DataPlaneKeyError

__all__ = ["get_call", "put_call"]


def put_call(
    partition_id: str, keys: Sequence[str], rows: Mapping[str, Column], tags: Sequence[Mapping[str, Any]] | None
) -> Callable[[], Awaitable[Any]]:
    """The put of ``rows`` (and ``tags``) under ``keys``, checked and converted to columns now."""
    keys = check_keys(keys)
    if not rows and tags is None:
        raise ValueError("put needs rows or tags.")
    if tags is not None and len(tags) != len(keys):
        raise ValueError(f"{len(tags)} tags for {len(keys)} keys.")
    batch = to_batch(keys, rows) if rows else None
    tag_list = [dict(t) for t in tags] if tags is not None else None
    return lambda: tq.async_kv_batch_put(keys=keys, partition_id=partition_id, fields=batch, tags=tag_list)


def get_call(partition_id: str, keys: list[str], fields: list[str]) -> Callable[[], Awaitable[TensorDict]]:
    """The get of ``fields`` of ``keys``; every key and field must come back (DataPlaneKeyError otherwise)."""

    async def get() -> TensorDict:
        try:
            td = await tq.async_kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)
        except ValueError as e:  # "keys or partition were not found!" / "... not ready ..."
            raise DataPlaneKeyError(await _missing_message(partition_id, keys, fields, str(e))) from None
        if td.batch_size[0] != len(keys) or any(f not in td.keys() for f in fields):
            raise DataPlaneKeyError(
                await _missing_message(partition_id, keys, fields, f"got fields {list(td.keys())}")
            )
        return td

    return get


async def _missing_message(partition_id: str, keys: list[str], fields: list[str], detail: str) -> str:
    listing = await tq.async_kv_list(partition_id)
    present = set(listing.get(partition_id, {}))
    missing = [k for k in keys if k not in present]
    if missing:
        return (
            f"{len(missing)} of {len(keys)} keys are not in partition {partition_id!r}: "
            f"{missing[:8]} (never put, or cleared)."
        )
    return f"fields {fields} are not all written for keys {keys[:8]}... ({detail})."
