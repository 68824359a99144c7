# SPDX-License-Identifier: Apache-2.0
"""The transfer-engine wrapper around a fake ``mooncake.engine`` (no Mooncake needed): lazy
thread-safe creation, the protocol it is created with, and engine failures as
``TransferError``. Transfers with the real engine are in test_core_transfer_engine.py."""

from __future__ import annotations

import logging
import threading
import time
import types
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core import transfer_engine as te_mod
from vllm_ascend.distributed.kv_transfer.core.device import get_device
from vllm_ascend.distributed.kv_transfer.core.errors import TransferError
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import (
    PROTOCOL_ENV,
    MooncakeTransferEngine,
    default_protocol,
    get_transfer_engine,
)


class FakeEngine:
    """``mooncake.engine.TransferEngine`` as far as the wrapper uses it."""

    instances: list[FakeEngine] = []
    init_delay_s = 0.0
    init_rc = 0
    #: register_memory returns this for the n-th call (0-based), 0 otherwise
    register_rc: dict[int, int] = {}

    def __init__(self) -> None:
        FakeEngine.instances.append(self)
        self.init_args: tuple[Any, ...] = ()
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self._register_calls = 0

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
        time.sleep(self.init_delay_s)  # widen the window for a racing second creation
        self.init_args = (hostname, metadata, protocol, device)
        return self.init_rc

    def get_rpc_port(self) -> int:
        return 15000 + len(FakeEngine.instances)

    def register_memory(self, addr: int, length: int) -> int:
        rc = self.register_rc.get(self._register_calls, 0)
        self._register_calls += 1
        if rc == 0:
            self.registered.append((addr, length))
        return rc

    def unregister_memory(self, addr: int) -> int:
        self.unregistered.append(addr)
        return 0


@pytest.fixture
def fake_mooncake(monkeypatch: pytest.MonkeyPatch) -> type[FakeEngine]:
    """The fake engine module, no process engine yet (the real one, if any, is restored)."""
    monkeypatch.setattr(FakeEngine, "instances", [])
    monkeypatch.setattr(FakeEngine, "register_rc", {})
    module = types.SimpleNamespace(TransferEngine=FakeEngine)
    monkeypatch.setattr(te_mod, "optional_dependency", lambda *a, **k: module)
    monkeypatch.setattr(te_mod, "_engine", None)
    # the wrapper sets these defaults in os.environ; monkeypatch puts them back afterwards
    monkeypatch.setenv(te_mod.TCP_PROGRESS_TIMEOUT_ENV, "5")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    monkeypatch.delenv(te_mod.WAIT_ENV, raising=False)
    return FakeEngine


def test_concurrent_first_use_creates_one_engine(fake_mooncake: type[FakeEngine],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeEngine, "init_delay_s", 0.05)
    n = 16
    barrier = threading.Barrier(n)
    got: list[MooncakeTransferEngine] = []
    errors: list[BaseException] = []

    def first_use() -> None:
        try:
            barrier.wait(5)
            got.append(get_transfer_engine("127.0.0.1", "tcp"))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert len(got) == n and len({id(e) for e in got}) == 1
    assert len(FakeEngine.instances) == 1
    assert te_mod.peek_transfer_engine() is got[0]


def test_protocol_env_override(fake_mooncake: type[FakeEngine],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_protocol() == get_device().default_protocol  # no override: the device's
    monkeypatch.setenv(PROTOCOL_ENV, "  RDMA ")
    assert default_protocol() == "rdma"
    engine = get_transfer_engine("127.0.0.1")
    assert engine.protocol == "rdma"
    assert FakeEngine.instances[0].init_args == ("127.0.0.1", "P2PHANDSHAKE", "rdma", "")
    monkeypatch.setenv(PROTOCOL_ENV, "")
    assert default_protocol() == get_device().default_protocol


def test_explicit_protocol_beats_the_env_and_later_requests_are_ignored(
        fake_mooncake: type[FakeEngine], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(PROTOCOL_ENV, "rdma")
    engine = get_transfer_engine("127.0.0.1", "ascend", device_name="hccn0",
                                 metadata_server="http://127.0.0.1:1/metadata")
    assert engine.protocol == "ascend"
    assert FakeEngine.instances[0].init_args == (
        "127.0.0.1", "http://127.0.0.1:1/metadata", "ascend", "hccn0")
    with caplog.at_level(logging.WARNING, logger=te_mod.__name__):
        assert get_transfer_engine("127.0.0.2", "tcp") is engine
    assert engine.protocol == "ascend" and len(FakeEngine.instances) == 1
    assert "'ascend'; request for 'tcp' ignored" in caplog.text
    assert "127.0.0.2 ignored" in caplog.text


def test_failed_start_names_host_protocol_and_rc(fake_mooncake: type[FakeEngine],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeEngine, "init_rc", -1)
    with pytest.raises(TransferError, match=r"127\.0\.0\.1 with protocol 'rdma'.*rc=-1") as info:
        get_transfer_engine("127.0.0.1", "rdma")
    assert info.value.op == "initialize" and info.value.rc == -1
    assert te_mod.peek_transfer_engine() is None  # a later call may try again


def test_failed_register_memory_names_what_failed_and_rolls_back(
        fake_mooncake: type[FakeEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = get_transfer_engine("127.0.0.1", "tcp")
    raw = FakeEngine.instances[0]
    base = 0x10000
    assert engine.register_memory(base + 0x1000, 0x1000)  # the middle of what comes next
    # [base, base + 0x3000) has two gaps around it; the second one's registration fails
    monkeypatch.setattr(FakeEngine, "register_rc", {2: -7})
    with pytest.raises(TransferError) as info:
        engine.register_memory(base, 0x3000)
    err = info.value
    assert err.op == "register" and err.rc == -7
    assert str(err).startswith("registering 4096 bytes at 0x12000 (part of 12288 bytes at "
                               f"0x10000) with the Mooncake engine {engine.session_id} (tcp) "
                               "failed: rc=-7")
    # the first gap, registered before the failure, was given back; nothing is left half-done
    assert raw.unregistered == [base]
    assert engine.registered_bytes == 0x1000 and engine.registrations == 1
    monkeypatch.setattr(FakeEngine, "register_rc", {})
    assert engine.register_memory(base, 0x3000)  # a retry registers both gaps
    assert engine.registered_bytes == 0x3000


class _PolledEngine(FakeEngine):
    """Asynchronous batches that end after a set number of polls, in any order; a batch
    asked for after it ended (freed by the real engine) fails the test."""

    #: polls each submitted range takes to end, by its remote address
    polls_for: dict[int, int] = {}
    #: remote addresses whose submission the engine refuses (rc -1), and that fail (-1)
    refuse: set[int] = set()
    fail: set[int] = set()

    def __init__(self) -> None:
        super().__init__()
        self.left: dict[int, int] = {}
        self.addr: dict[int, int] = {}
        self.ended: set[int] = set()
        self.submitted: list[int] = []
        self.sync_calls = 0

    def _submit(self, peer: str, loc: list[int], rem: list[int], lens: list[int]) -> int:
        assert len(loc) == 1, "yield submits every range as a batch of its own"
        if rem[0] in self.refuse:
            return -1
        batch = len(self.submitted) + 1
        self.submitted.append(rem[0])
        self.left[batch], self.addr[batch] = self.polls_for.get(rem[0], 0), rem[0]
        return batch

    batch_transfer_async_read = _submit
    batch_transfer_async_write = _submit

    def transfer_check_status(self, batch: int) -> int:
        assert batch not in self.ended, f"batch {batch} asked for after it ended"
        if self.left[batch] > 0:
            self.left[batch] -= 1
            return 0
        self.ended.add(batch)
        return -1 if self.addr[batch] in self.fail else 1

    def batch_transfer_sync_read(self, *args: Any) -> int:
        self.sync_calls += 1
        return 0


def test_yield_waits_for_every_range_yielding_between_polls(
        fake_mooncake: type[FakeEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.SimpleNamespace(TransferEngine=_PolledEngine)
    monkeypatch.setattr(te_mod, "optional_dependency", lambda *a, **k: module)
    monkeypatch.setattr(_PolledEngine, "polls_for", {0x1000: 0, 0x3000: 5, 0x5000: 2})
    monkeypatch.setattr(_PolledEngine, "refuse", set())
    monkeypatch.setattr(_PolledEngine, "fail", set())
    yields: list[int] = []
    monkeypatch.setattr(te_mod.os, "sched_yield", lambda: yields.append(1))
    engine = get_transfer_engine("127.0.0.1", "tcp")
    fake = engine.raw
    assert engine.wait == "yield"
    # three ranges, none adjacent: three batches; the read returns once all of them ended
    # (the first ends at once, the second after 5 polls, the third after 2)
    assert engine.read("p:1", [0x10, 0x30, 0x50], [0x1000, 0x3000, 0x5000],
                       [16, 16, 16]) == 48
    assert fake.submitted == [0x1000, 0x3000, 0x5000] and fake.ended == {1, 2, 3}
    assert len(yields) >= 5 and fake.sync_calls == 0
    assert engine.stats.reads == 1 and engine.stats.bytes_read == 48
    # a range that fails: the error comes once every range ended, never before
    monkeypatch.setattr(_PolledEngine, "fail", {0x3000})
    with pytest.raises(TransferError, match="read of 3 ranges") as info:
        engine.read("p:1", [0x10, 0x30, 0x50], [0x1000, 0x3000, 0x5000], [16, 16, 16])
    assert info.value.rc == -1 and fake.ended == {1, 2, 3, 4, 5, 6}
    # a range the engine refuses: those submitted before it end first, later ones never go
    monkeypatch.setattr(_PolledEngine, "fail", set())
    monkeypatch.setattr(_PolledEngine, "refuse", {0x5000})
    with pytest.raises(TransferError, match="write of 3 ranges"):
        engine.write("p:1", [0x10, 0x30, 0x50], [0x1000, 0x3000, 0x5000], [16, 16, 16])
    assert fake.submitted[6:] == [0x1000, 0x3000] and fake.ended == set(range(1, 9))
    assert engine.stats.failures == 2
    # spin, asked for by the call: Mooncake's synchronous call
    assert engine.read("p:1", [0x10], [0x1000], [16], wait="spin") == 16
    assert fake.sync_calls == 1 and len(fake.submitted) == 8


@pytest.mark.parametrize(("protocol", "env", "wait"), [
    ("tcp", None, "yield"), ("rdma", None, "spin"), ("ascend", None, "spin"),
    ("tcp", "spin", "spin"), ("ascend", "yield", "yield"), ("tcp", " Sleep ", "sleep")])
def test_the_wait_defaults_to_yield_over_tcp_only(
        fake_mooncake: type[FakeEngine], monkeypatch: pytest.MonkeyPatch, protocol: str,
        env: str | None, wait: str) -> None:
    if env is not None:
        monkeypatch.setenv(te_mod.WAIT_ENV, env)
    assert get_transfer_engine("127.0.0.1", protocol).wait == wait
