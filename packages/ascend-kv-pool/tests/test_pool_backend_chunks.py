# SPDX-License-Identifier: Apache-2.0
"""The chunked batch loop Mooncake Store and memcache share (``backend.base.ChunkedBackend``).

Both backends run against one recording stand-in for their store client (it answers to
Mooncake's and memcache's batch calls alike), so each call's keys are seen: a batch goes
out in chunks of ``max_batch_keys``, in order; a chunk that fails ends the batch; the
per-key codes come back in the keys' order.
"""

from __future__ import annotations

import socket
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.base import (
    RC_ERROR,
    ChunkedBackend,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.memcache_store import (
    MemcacheBackend,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.mooncake_store import (
    MooncakeBackend,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import (
    AscendStoreConfig,
    MooncakeStoreConfig,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.errors import (
    BackendError,
    BackendUnavailableError,
)


class RecordingStore:
    """Mooncake's ``MooncakeDistributedStore`` and memcache's ``DistributedObjectStore``
    batch calls in one: each call is recorded as ``(op, keys)``.

    ``fail_at``: the call (1-based) that raises; ``answers``: call (1-based) -> what it
    answers instead of success (per-key codes, or memcache's one code for the batch);
    ``short``: keys a Mooncake get reads one byte short of.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.fail_at = 0
        self.answers: dict[int, Any] = {}
        self.short: set[str] = set()

    def _call(self, op: str, keys: list[str], codes: list[int]) -> Any:
        self.calls.append((op, list(keys)))
        if len(self.calls) == self.fail_at:
            raise RuntimeError(f"store failed on call {self.fail_at}")
        return self.answers.get(len(self.calls), codes)

    # lifecycle of either store
    def setup(self, *_args: Any) -> int:
        return 0

    def init(self, _device_id: int) -> int:
        return 0

    def close(self) -> int:
        return 0

    # Mooncake Store
    def batch_is_exist(self, keys: list[str]) -> Any:
        return self._call("exists", keys, [1] * len(keys))

    def batch_put_from_multi_buffers(self, keys: list[str], _addrs: Any, _sizes: Any) -> Any:
        return self._call("put", keys, [0] * len(keys))

    def batch_get_into_multi_buffers(self, keys: list[str], _addrs: Any,
                                     sizes: list[list[int]]) -> Any:
        # Mooncake answers the bytes read
        return self._call("get", keys, [sum(s) - (k in self.short) for k, s in
                                        zip(keys, sizes, strict=True)])

    # memcache
    def batch_put_from_layers(self, keys: list[str], _addrs: Any, _sizes: Any,
                              _direct: int) -> Any:
        return self._call("put", keys, [0] * len(keys))

    def batch_get_into_layers(self, keys: list[str], _addrs: Any, _sizes: Any,
                              _direct: int) -> Any:
        return self._call("get", keys, [0] * len(keys))


@pytest.fixture
def listening_port() -> Iterator[int]:
    """Something listening where the Mooncake master would (the backend probes it first)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


@pytest.fixture(params=["mooncake", "memcache"])
def chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ChunkedBackend:
    module = types.ModuleType("store_client")
    module.MooncakeDistributedStore = RecordingStore  # type: ignore[attr-defined]
    module.DistributedObjectStore = RecordingStore  # type: ignore[attr-defined]
    if request.param == "mooncake":
        monkeypatch.setitem(sys.modules, "mooncake.store", module)
        port = request.getfixturevalue("listening_port")
        store = MooncakeStoreConfig.from_dict({
            "master_server_address": f"127.0.0.1:{port}", "protocol": "tcp",
            "metadata_server": "http://127.0.0.1:1/metadata"})  # its own engine: none here
        return MooncakeBackend(store_config=store, hostname="127.0.0.1", max_batch_keys=3)
    monkeypatch.setitem(sys.modules, "memcache_hybrid", module)
    return MemcacheBackend(config=AscendStoreConfig.from_dict({"memcache_device_type": "a3",
                                                              "max_batch_keys": 3}))


def _batch(n: int) -> tuple[list[str], list[list[int]], list[list[int]]]:
    keys = [f"k{i}" for i in range(n)]
    # sizes differ per key, so a chunk handed another chunk's sizes would show
    return keys, [[0x1000 * i, 0x2000 * i] for i in range(n)], [[i + 1, 2] for i in range(n)]


@pytest.mark.parametrize("op", ["exists", "put", "get"])
def test_batches_go_out_in_chunks_in_order(chunked: ChunkedBackend, op: str) -> None:
    store: RecordingStore = chunked.store
    keys, addrs, sizes = _batch(7)
    codes = chunked.exists(keys) if op == "exists" else getattr(chunked, op)(keys, addrs, sizes)
    assert codes == ([1] * 7 if op == "exists" else [0] * 7)
    assert store.calls == [(op, keys[0:3]), (op, keys[3:6]), (op, keys[6:7])]


def test_an_empty_batch_calls_nothing(chunked: ChunkedBackend) -> None:
    assert chunked.exists([]) == [] and chunked.put([], [], []) == [] and \
        chunked.get([], [], []) == []
    assert chunked.store.calls == []


@pytest.mark.parametrize("op", ["exists", "put", "get"])
def test_a_failing_chunk_ends_the_batch(chunked: ChunkedBackend, op: str) -> None:
    store: RecordingStore = chunked.store
    store.fail_at = 2
    keys, addrs, sizes = _batch(7)
    with pytest.raises(RuntimeError, match="store failed on call 2"):
        chunked.exists(keys) if op == "exists" else getattr(chunked, op)(keys, addrs, sizes)
    assert [len(k) for _op, k in store.calls] == [3, 3]  # the third chunk was not sent


def test_a_chunk_answering_for_other_keys_is_an_error(chunked: ChunkedBackend) -> None:
    chunked.store.answers[2] = [0, 0]
    keys, addrs, sizes = _batch(6)
    with pytest.raises(BackendError, match="returned 2 results for 3 keys") as err:
        chunked.put(keys, addrs, sizes)
    assert (err.value.backend, err.value.op) == (chunked.name, "put")


def test_mismatched_lists_are_refused_before_any_call(chunked: ChunkedBackend) -> None:
    keys, addrs, sizes = _batch(4)
    with pytest.raises(ValueError, match="4 keys but 3 address lists"):
        chunked.put(keys, addrs[:3], sizes)
    assert chunked.store.calls == []


def test_mooncake_short_reads_fail_the_right_keys(listening_port: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("mooncake.store")
    module.MooncakeDistributedStore = RecordingStore  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake.store", module)
    b = MooncakeBackend(store_config=MooncakeStoreConfig.from_dict({
        "master_server_address": f"127.0.0.1:{listening_port}", "protocol": "tcp",
        "metadata_server": "http://127.0.0.1:1/metadata"}), hostname="127.0.0.1",
        max_batch_keys=3)
    b.store.short = {"k1", "k4"}  # one in the first chunk, one in the second
    keys, addrs, sizes = _batch(6)
    assert b.get(keys, addrs, sizes) == [0, RC_ERROR, 0, 0, RC_ERROR, 0]
    b.store.answers[4] = [1, 1, -900]  # the master went away during the next batch's 2nd chunk
    with pytest.raises(BackendUnavailableError, match="RPC_FAIL") as err:
        b.exists(keys + ["k6"])
    assert err.value.op == "exists" and len(b.store.calls) == 4  # the 3rd chunk was not sent


def test_memcache_one_code_for_a_chunk_is_every_keys_code(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    module = types.ModuleType("memcache_hybrid")
    module.DistributedObjectStore = RecordingStore  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "memcache_hybrid", module)
    b = MemcacheBackend(config=AscendStoreConfig.from_dict({"memcache_device_type": "a3",
                                                           "max_batch_keys": 3}))
    b.store.answers[2] = -5  # memcache may answer one code for the whole batch
    keys, addrs, sizes = _batch(4)
    assert b.get(keys, addrs, sizes) == [0, 0, 0, -5]
