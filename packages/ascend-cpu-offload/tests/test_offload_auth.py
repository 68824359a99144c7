# SPDX-License-Identifier: Apache-2.0
"""With a deployment key configured, the offload metadata server answers no outsider: a pin
or a lookup without the key is refused and counted, and pins nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.protocol import (
    GetStats,
    Lookup,
    Pin,
    make_codec,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.server import (
    MetadataServer,
)

KEY = "deployment-key-for-the-offload-tests"


@pytest.fixture
def keyed_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MetadataServer]:
    monkeypatch.setenv(auth.ENV_KEY, KEY)
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    monkeypatch.setattr(auth, "_cached", None)
    seg = tmp_path / "segments"
    seg.mkdir()
    srv = MetadataServer(f"ipc://{tmp_path}/meta.ipc", world_size=1, budget_bytes=64 << 10,
                         segment_dir=str(seg), name="offload-auth-test").start()
    yield srv
    srv.stop()
    monkeypatch.setattr(auth, "_cached", None)


def test_outsider_pins_and_lookups_are_refused_and_counted(keyed_server: MetadataServer) -> None:
    codec = make_codec()
    before = auth.RECORDER.total("auth_refused", socket="offload-auth-test",
                                 reason="unauthenticated")
    outsider = RpcClient(keyed_server.endpoint, codec, timeout_s=5, auth=None)
    for msg in (Pin(key="k", hashes=[b"a" * 32], owner="x"), Lookup(hashes=[b"a" * 32]),
                GetStats()):
        with pytest.raises(RemoteError) as err:
            outsider.call(msg)
        assert err.value.code == "auth_refused"
    outsider.close()
    assert auth.RECORDER.total("auth_refused", socket="offload-auth-test",
                               reason="unauthenticated") == before + 3
    keyed = RpcClient(keyed_server.endpoint, codec, timeout_s=5)  # the key from the env
    assert keyed.auth is not None
    stats = keyed.call(GetStats())
    assert type(stats).__name__ == "StatsReply"
    keyed.close()
