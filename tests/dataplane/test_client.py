"""DataPlane put/get/clear/list against a real TransferQueue, in the driver and from Ray actors."""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from screl.dataplane import (
    DataPlane,
    DataPlaneError,
    DataPlaneKeyError,
    DataPlaneTimeoutError,
    listening_addresses,
)
from screl.dataplane.cluster import LOOPBACK_IPS
from screl.dataplane.tq_client import current_client

# Ray workers cannot import this test module by name: ship its actors and helpers by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FIELDS = ["input_ids", "prompt_len", "generation_logprobs", "token_versions", "reward", "mask"]


def make_group(
    group_id: str, lengths: list[int], seed: int = 0
) -> tuple[list[str], dict[str, list[torch.Tensor]]]:
    """A GRPO group as the controller writes it: per-sample tensors of different lengths."""
    g = torch.Generator().manual_seed(seed)
    keys = [f"{group_id}_g{i}" for i in range(len(lengths))]
    rows: dict[str, list[torch.Tensor]] = {f: [] for f in FIELDS}
    for n in lengths:
        rows["input_ids"].append(torch.randint(0, 50_000, (4 + n,), generator=g, dtype=torch.int64))
        rows["prompt_len"].append(torch.tensor([4], dtype=torch.int64))
        rows["generation_logprobs"].append(-torch.rand(n, generator=g, dtype=torch.float32) * 7)
        rows["token_versions"].append(torch.randint(0, 5, (n,), generator=g, dtype=torch.int64))
        rows["reward"].append(torch.rand((), generator=g))
        rows["mask"].append(torch.rand(n, generator=g) > 0.5)
    return keys, rows


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so floats compare bit for bit (NaN payloads, -0.0, denormals)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_rows_equal(got: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]]) -> None:
    assert list(got) == list(want)
    for f, samples in want.items():
        assert len(got[f]) == len(samples), f
        for a, b in zip(got[f], samples, strict=True):
            assert not a.is_nested and a.device.type == "cpu", f
            assert a.dtype == b.dtype and a.shape == b.shape, (f, a, b)
            assert torch.equal(bits(a), bits(b)), (f, a, b)


def test_transfer_queue_listens_on_loopback_only(dp: DataPlane) -> None:
    dp.put(["sock_g0"], {"x": [torch.arange(3)]})  # TQ's controller and storage unit are serving
    found = listening_addresses()
    assert len(found) >= 6, found  # Ray's servers plus TQ's controller and storage-unit ZMQ sockets
    assert [(pid, ip, port) for pid, ip, port in found if ip not in LOOPBACK_IPS] == []
    dp.clear(["sock_g0"])


def test_roundtrip_preserves_order_shapes_and_dtypes(dp: DataPlane) -> None:
    keys, rows = make_group("rt", [3, 0, 7, 1], seed=1)
    rows["generation_logprobs"][0] = torch.tensor([-1e-45, -3.4e38, -0.0, float("nan")])
    rows["bf16"] = [torch.randn(n + 1).bfloat16() for n in range(4)]
    rows["hidden"] = [torch.randn(n + 1, 3) for n in range(4)]  # ragged first dim, fixed second
    dp.put(keys, rows)
    order = [3, 1, 0, 2]
    got = dp.get([keys[i] for i in order], list(rows))
    assert_rows_equal(got, {f: [v[i] for i in order] for f, v in rows.items()})
    assert got["reward"][0].shape == () and got["input_ids"][1].shape == (4,)
    dp.clear(keys)


def test_tensor_columns_and_later_fields_mix_with_lists(dp: DataPlane) -> None:
    keys_a, rows_a = make_group("mixa", [5, 5], seed=2)  # equal lengths, as one (B, L) tensor
    dense = {f: torch.stack(v) for f, v in rows_a.items()}
    keys_b, rows_b = make_group("mixb", [2, 6], seed=3)
    dp.put(keys_a, dense)
    dp.put(keys_b, rows_b)
    adv = [torch.tensor(0.5), torch.tensor(-0.5), torch.tensor(1.0), torch.tensor(0.0)]
    dp.put(keys_a + keys_b, {"advantage": adv})  # a field written back later by another stage
    got = dp.get(keys_a + keys_b, ["input_ids", "generation_logprobs", "advantage"])
    want = {f: rows_a[f] + rows_b[f] for f in ["input_ids", "generation_logprobs"]}
    assert_rows_equal({f: got[f] for f in want}, want)
    assert [float(a) for a in got["advantage"]] == [0.5, -0.5, 1.0, 0.0]
    dp.clear(keys_a + keys_b)


def test_tags_list_keys_and_clear(dp: DataPlane) -> None:
    keys, rows = make_group("tag", [1, 2, 3], seed=4)
    dp.put(keys, rows, tags=[{"weight_version": i, "group": "tag"} for i in range(3)])
    tags = dp.list_tags()
    assert [tags[k]["weight_version"] for k in keys] == [0, 1, 2]
    assert set(keys) <= set(dp.list_keys())
    dp.clear(keys[:2])
    assert not set(keys[:2]) & set(dp.list_keys()) and keys[2] in dp.list_keys()
    with pytest.raises(DataPlaneKeyError, match=r"2 of 3 keys are not in partition 'train'.*tag_g0"):
        dp.get(keys, ["reward"])
    dp.clear(keys)  # clearing absent keys is fine
    assert not set(keys) & set(dp.list_keys())


def test_missing_keys_and_fields_raise(dp: DataPlane) -> None:
    keys, rows = make_group("miss", [2, 2], seed=5)
    dp.put(keys, {"reward": rows["reward"]})
    with pytest.raises(DataPlaneKeyError, match=r"1 of 1 keys are not in partition"):
        dp.get(["nope_g0"], ["reward"])
    with pytest.raises(DataPlaneKeyError, match=r"1 of 3 keys are not in partition.*nope_g1"):
        dp.get(keys + ["nope_g1"], ["reward"])  # TQ alone would return the 2 rows it has
    with pytest.raises(DataPlaneKeyError, match=r"fields \['input_ids'\] are not all written"):
        dp.get(keys, ["input_ids"])  # TQ alone would return an empty batch
    dp.clear(keys)


def test_put_validates_rows(dp: DataPlane) -> None:
    with pytest.raises(ValueError, match=r"field 'x': 1 values for 2 keys"):
        dp.put(["v_g0", "v_g1"], {"x": [torch.zeros(2)]})
    with pytest.raises(ValueError, match=r"duplicate keys: \['v_g0'\]"):
        dp.put(["v_g0", "v_g0"], {"x": [torch.zeros(2), torch.zeros(2)]})
    with pytest.raises(ValueError, match=r"only the first dim may vary"):
        dp.put(["v_g0", "v_g1"], {"x": [torch.zeros(2, 3), torch.zeros(2, 4)]})
    with pytest.raises(TypeError, match=r"mixed dtypes"):
        dp.put(["v_g0", "v_g1"], {"x": [torch.zeros(2), torch.zeros(2, dtype=torch.int64)]})
    assert "v_g0" not in dp.list_keys()


def test_timeout_raises_a_clear_error(dp: DataPlane) -> None:
    # a stalled TransferQueue client loop (blocked for 1 s), so the 0.2 s wait runs out whatever the load
    dp.list_keys()  # connected first
    loop = current_client()._loop
    stalled = threading.Event()
    loop.call_soon_threadsafe(lambda: (stalled.set(), time.sleep(1.0)))
    assert stalled.wait(10)
    with pytest.raises(DataPlaneTimeoutError, match=r"list did not finish within 0.2s"):
        dp.list_keys(timeout_s=0.2)
    with pytest.raises(DataPlaneTimeoutError, match=r"get of 1 rows did not finish"):
        asyncio.run(dp.aget(["t_g0"], ["x"], timeout_s=1e-6))


def test_torch_thread_count_survives_put_and_get(dp: DataPlane) -> None:
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            keys, rows = make_group(f"thr{n}", [3, 4], seed=6)
            dp.put(keys, rows)
            dp.get(keys, ["input_ids"])
            asyncio.run(dp.aget(keys, ["input_ids"]))
            dp.clear(keys)
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_async_twins_in_the_driver(dp: DataPlane) -> None:
    keys, rows = make_group("async", [2, 9], seed=7)

    async def go() -> dict[str, list[torch.Tensor]]:
        await dp.aput(keys, rows, tags=[{"v": 1}, {"v": 2}])
        assert (await dp.alist_tags())[keys[1]] == {"v": 2}
        got = await dp.aget(keys, FIELDS)
        await dp.aclear(keys)
        assert not set(keys) & set(await dp.alist_keys())
        return got

    assert_rows_equal(asyncio.run(go()), rows)


def test_start_refuses_a_second_transfer_queue(dp: DataPlane) -> None:
    with pytest.raises(DataPlaneError, match=r"already runs in this Ray cluster"):
        DataPlane.start()


def test_pickled_copy_is_attached_not_owner(dp: DataPlane) -> None:
    copy = pickle.loads(pickle.dumps(dp))
    assert not copy.is_owner and copy.partition_id == "train" and dp.is_owner
    with pytest.raises(DataPlaneError, match=r"Only the DataPlane returned by DataPlane.start\(\)"):
        copy.shutdown()
    assert copy.list_keys() == dp.list_keys()
    copy.close()  # an attached copy in the owner's process leaves the shared client alone
    with pytest.raises(DataPlaneError, match=r"was closed or shut down"):
        copy.list_keys()
    assert dp.list_keys() == []


@ray.remote(num_cpus=0)
class AsyncRolloutWriter:
    """Stands in for the controller: an asyncio actor that must not block its loop."""

    def __init__(self, plane: DataPlane) -> None:
        self.dp = plane

    async def write(self, group_id: str, lengths: list[int], seed: int) -> list[str]:
        keys, rows = make_group(group_id, lengths, seed)
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:  # the loop keeps running while TQ works
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await self.dp.aput(keys, rows, tags=[{"weight_version": seed}] * len(keys))
        done.set()
        await task
        assert ticks > 1
        return keys

    async def read(self, keys: list[str]) -> dict[str, list[torch.Tensor]]:
        return await self.dp.aget(keys, FIELDS)

    async def clear(self, keys: list[str]) -> None:
        await self.dp.aclear(keys)


@ray.remote(num_cpus=0)
class SyncReader:
    """Stands in for a trainer rank: attaches explicitly from a handle and uses the sync API."""

    def __init__(self, handle: Any) -> None:
        self.dp = DataPlane.attach(handle)

    def read(self, keys: list[str]) -> dict[str, list[torch.Tensor]]:
        return self.dp.get(keys, FIELDS)

    def keys(self) -> list[str]:
        return self.dp.list_keys()


def test_put_from_an_async_actor_get_in_the_driver_and_back(dp: DataPlane) -> None:
    # The DataPlane pickles to its handle and attaches lazily in the actor.
    writer = AsyncRolloutWriter.remote(dp)  # type: ignore[attr-defined]
    reader = SyncReader.remote(dp.handle())  # type: ignore[attr-defined]
    try:
        keys = ray.get(writer.write.remote("actor", [3, 1, 4, 1], 11), timeout=60)
        _, want = make_group("actor", [3, 1, 4, 1], 11)
        assert_rows_equal(dp.get(keys, FIELDS), want)
        assert all(dp.list_tags()[k] == {"weight_version": 11} for k in keys)
        assert_rows_equal(ray.get(reader.read.remote(keys), timeout=60), want)

        dkeys, drows = make_group("driver", [2, 5], 12)
        dp.put(dkeys, drows)
        assert_rows_equal(ray.get(writer.read.remote(dkeys), timeout=60), drows)
        ray.get(writer.clear.remote(keys + dkeys), timeout=60)
        assert not set(keys + dkeys) & set(ray.get(reader.keys.remote(), timeout=60))
    finally:
        ray.kill(writer)
        ray.kill(reader)


def test_checkpoint_paths_are_checked_before_tq(dp: DataPlane, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"need a local path"):
        dp.save("s3://bucket/dp")
    with pytest.raises(FileNotFoundError, match=r"is not a TransferQueue checkpoint"):
        dp.load(tmp_path / "missing")


def test_columns_are_regular_when_shapes_agree_and_jagged_otherwise() -> None:
    from screl.dataplane.columns import column_samples as _samples
    from screl.dataplane.columns import to_column as _to_column

    same = [torch.arange(4) + i for i in range(3)]
    col = _to_column("ids", same, 3)
    assert not col.is_nested and col.shape == (3, 4)
    ragged = [torch.arange(n, dtype=torch.float32) for n in (2, 0, 5)]
    col = _to_column("lp", ragged, 3)
    assert col.is_nested and col.layout == torch.jagged
    back = _samples(col)
    assert [t.tolist() for t in back] == [t.tolist() for t in ragged]
    assert [t.tolist() for t in _samples(_to_column("ids", same, 3))] == [t.tolist() for t in same]
    with pytest.raises(ValueError, match="differ beyond the first dim"):
        _to_column("bad", [torch.zeros(2, 3), torch.zeros(2, 4)], 2)
