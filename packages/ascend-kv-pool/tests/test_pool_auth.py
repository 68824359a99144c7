# SPDX-License-Identifier: Apache-2.0
"""With a deployment key configured, the pool's lookup server answers no outsider: a lookup
without the key is refused and counted, and the handler never runs for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.lookup import (
    LOOKUP_CODEC,
    LookupClient,
    LookupServer,
    PoolLookupRequest,
)

KEY = "deployment-key-for-the-pool-tests-0"


def test_outsider_lookups_are_refused_keyed_ones_served(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.ENV_KEY, KEY)
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    monkeypatch.setattr(auth, "_cached", None)
    calls: list[int] = []

    def handler(hashes: list[str], token_end: int) -> int:
        calls.append(token_end)
        return token_end

    server = LookupServer(f"ipc://{tmp_path}/lookup.ipc", handler)
    try:
        before = auth.RECORDER.total("auth_refused", socket="ascend-store-lookup",
                                     reason="unauthenticated")
        outsider = RpcClient(server.endpoint, LOOKUP_CODEC, timeout_s=5, auth=None)
        with pytest.raises(RemoteError) as err:
            outsider.call(PoolLookupRequest(hashes=["a"], token_end=16))
        assert err.value.code == "auth_refused"
        outsider.close()
        assert calls == []
        assert auth.RECORDER.total("auth_refused", socket="ascend-store-lookup",
                                   reason="unauthenticated") == before + 1
        # the key from the environment, over the socket
        client = LookupClient(server.endpoint, timeout_s=5, in_process=False)
        assert client.lookup(["a", "b"], 32) == 32 and calls == [32]
    finally:
        server.close()
        monkeypatch.setattr(auth, "_cached", None)
