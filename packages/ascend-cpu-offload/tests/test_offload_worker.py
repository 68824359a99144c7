# SPDX-License-Identifier: Apache-2.0
"""Worker side: register, save in the background, load layer by layer, report, clean up."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from vllm_ascend.distributed.kv_transfer.core.device import CpuDevice, CpuEvent, CpuStream
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.ranks import RankInfo
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.contract import (
    CPUOffloadingConnectorMetadata,
    HostLoad,
    HostSave,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager import (
    MetadataClient,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.protocol import (
    SaveRequest,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.metrics import OFFLOAD_METRICS
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.worker import CPUOffloadWorker

BS = 4
NUM_BLOCKS = 10
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def cpu_caches(seed: int = 0, heads: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(NUM_BLOCKS, heads, BS, 8, generator=g) for name in LAYERS}


def mla_caches(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(NUM_BLOCKS, BS, 1, 12, generator=g),
                   torch.randn(NUM_BLOCKS, BS, 1, 4, generator=g)) for name in LAYERS}


@pytest.fixture
def make_worker(make_vllm_config: Callable[..., Any], offload_cfg: Callable[..., Any]
                ) -> Iterator[Callable[..., CPUOffloadWorker]]:
    made: list[CPUOffloadWorker] = []

    def make(rank_info: RankInfo | None = None, extra: dict[str, Any] | None = None
             ) -> CPUOffloadWorker:
        vc = make_vllm_config(extra, block_size=BS)
        w = CPUOffloadWorker(vc, offload_cfg(vc), None, MetricsRecorder(OFFLOAD_METRICS),
                             rank_info=rank_info or RankInfo())
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


def plan_save(w: CPUOffloadWorker, req: str, hashes_name: str, device_ids: list[int]
              ) -> HostSave:
    """Ask the server for host blocks the way the scheduler does."""
    import hashlib

    hashes = [hashlib.sha256(f"{hashes_name}{i}".encode()).digest()
              for i in range(len(device_ids))]
    client = MetadataClient(w.endpoint)
    (planned,) = client.plan_step([SaveRequest(key=req, hashes=hashes)], [], owner="test").saves
    client.close()
    return HostSave(req_id=req, job_id=planned.job_id, host_ids=planned.block_ids,
                    device_ids=[device_ids[p] for p in planned.positions])


def stats(w: CPUOffloadWorker) -> Any:
    client = MetadataClient(w.endpoint)
    try:
        return client.stats()
    finally:
        client.close()


@pytest.mark.parametrize("path", ["auto", "kernels", "memmove", "staged", "runs"])
def test_save_then_load_restores_every_layer(make_worker: Callable[..., CPUOffloadWorker],
                                             path: str) -> None:
    w = make_worker()
    w.copy_path = path
    caches = cpu_caches()
    w.register_kv_caches(caches)
    assert w.num_host_blocks > 0
    original = {k: v.clone() for k, v in caches.items()}
    save = plan_save(w, "r1", "a", [3, 4, 7])
    meta = CPUOffloadingConnectorMetadata(saves=[save])
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert w.get_finished(set()) == (None, None)
    assert w.drain(5)
    assert stats(w).cached_blocks == 3, "the rank confirmed the job: committed"
    # the request finished: reported exactly once
    assert w.get_finished({"r1"}) == ({"r1"}, None)
    assert w.get_finished({"r1"}) == (None, None)
    for t in caches.values():
        t.zero_()
    load = HostLoad(req_id="r2", host_ids=save.host_ids, device_ids=[0, 1, 9])
    meta2 = CPUOffloadingConnectorMetadata(loads=[load])
    w.start_load_kv(meta2)
    for name in LAYERS:
        w.wait_for_layer_load(name)
    w.wait_for_save(meta2)
    for name in LAYERS:
        assert torch.equal(caches[name][0], original[name][3])
        assert torch.equal(caches[name][1], original[name][4])
        assert torch.equal(caches[name][9], original[name][7])
        assert not caches[name][2].any()
    assert w.get_block_ids_with_load_errors() == set()
    assert w.recorder.total("offload_loaded_blocks") == 3
    assert w.recorder.total("offload_save_bytes") == w.recorder.total("offload_load_bytes") > 0


def test_finished_request_waits_for_its_saves(make_worker: Callable[..., CPUOffloadWorker]
                                              ) -> None:
    w = make_worker()
    w.register_kv_caches(cpu_caches())
    gate = threading.Event()
    original = w._run_saves

    def slow(batch: Any) -> None:
        gate.wait(5)
        original(batch)

    w._run_saves = slow  # type: ignore[method-assign]
    meta = CPUOffloadingConnectorMetadata(saves=[plan_save(w, "r", "b", [1, 2])])
    w.wait_for_save(meta)
    assert w.get_finished({"r"}) == (None, None), "save still running: blocks stay held"
    gate.set()
    assert w.drain(5)
    assert w.get_finished(set()) == ({"r"}, None)
    assert w.get_finished({"other"}) == (None, None), "requests without saves are not reported"


def test_preemption_waits_for_in_flight_saves(make_worker: Callable[..., CPUOffloadWorker]
                                              ) -> None:
    w = make_worker()
    w.register_kv_caches(cpu_caches())
    done = threading.Event()
    original = w._run_saves

    def slow(batch: Any) -> None:
        done.wait(0.3)
        original(batch)
        done.set()

    w._run_saves = slow  # type: ignore[method-assign]
    w.wait_for_save(CPUOffloadingConnectorMetadata(saves=[plan_save(w, "p", "c", [5])]))
    w.handle_preemptions(CPUOffloadingConnectorMetadata(preempted_req_ids={"p"}))
    assert done.is_set(), "handle_preemptions returned while a save still read the blocks"


def test_bad_load_ids_become_load_errors_not_crashes(make_worker: Callable[..., CPUOffloadWorker]
                                                     ) -> None:
    w = make_worker()
    caches = cpu_caches()
    w.register_kv_caches(caches)
    before = {k: v.clone() for k, v in caches.items()}
    meta = CPUOffloadingConnectorMetadata(loads=[
        HostLoad(req_id="x", host_ids=[w.num_host_blocks + 5], device_ids=[2]),
        HostLoad(req_id="y", host_ids=[0, 1], device_ids=[3, NUM_BLOCKS]),
        HostLoad(req_id="z", host_ids=[0], device_ids=[4, 5]),
    ])
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert w.get_block_ids_with_load_errors() == {2, 3, NUM_BLOCKS, 4, 5}
    assert w.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(caches[k], before[k]) for k in caches), "nothing was written"
    assert w.recorder.total("offload_failures", op="load") == 3


def test_failed_save_frees_host_blocks_and_still_releases_the_request(
        make_worker: Callable[..., CPUOffloadWorker]) -> None:
    w = make_worker()
    w.register_kv_caches(cpu_caches())
    save = plan_save(w, "r", "d", [1, 2])
    bad = HostSave(req_id="r", job_id=save.job_id, host_ids=save.host_ids,
                   device_ids=[1, NUM_BLOCKS + 3])
    w.wait_for_save(CPUOffloadingConnectorMetadata(saves=[bad]))
    assert w.drain(5)
    s = stats(w)
    assert s.cached_blocks == 0 and s.pending_blocks == 0 and s.aborted_blocks == 2
    assert w.get_finished({"r"}) == ({"r"}, None)


class RecordingDevice(CpuDevice):
    """A CPU device that logs stream and event calls, to check the ordering logic."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, Any]] = []
        self.cur = self._stream("compute")

    def _stream(self, name: str) -> CpuStream:
        dev = self

        class S(CpuStream):
            def wait_stream(self, stream: Any) -> None:
                dev.log.append((f"{name}.wait_stream", stream.name))

            def wait_event(self, event: Any) -> None:
                dev.log.append((f"{name}.wait_event", event.name))

        s = S()
        s.name = name  # type: ignore[attr-defined]
        return s

    def new_stream(self) -> CpuStream:
        return self._stream(f"side{sum(1 for e in self.log if e[0] == 'new_stream')}")

    def current_stream(self) -> CpuStream:
        return self.cur

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        prev, self.cur = self.cur, stream
        self.log.append(("enter", stream.name))
        try:
            yield stream
        finally:
            self.cur = prev

    def record_event(self, stream: Any = None) -> Any:
        ev = CpuEvent()
        ev.name = f"ev{len(self.log)}@{(stream or self.cur).name}"  # type: ignore[attr-defined]
        self.log.append(("record", ev.name))
        return ev


def test_layerwise_load_and_background_save_ordering(make_worker: Callable[..., CPUOffloadWorker]
                                                     ) -> None:
    w = make_worker()
    w.register_kv_caches(cpu_caches())
    dev = RecordingDevice()
    w.device = dev
    w._load_stream, w._save_stream = dev._stream("load"), dev._stream("save")
    save = plan_save(w, "r", "e", [1, 2, 3])
    w.wait_for_save(CPUOffloadingConnectorMetadata(saves=[save]))
    w.drain(5)
    dev.log.clear()
    load = HostLoad(req_id="q", host_ids=save.host_ids, device_ids=[5, 6, 7], sync_tail=True)
    meta = CPUOffloadingConnectorMetadata(loads=[load])
    w.start_load_kv(meta)
    log = list(dev.log)
    assert log[0] == ("enter", "load") and log[1] == ("load.wait_stream", "compute"), log
    layer_events = [e for e in log if e[0] == "record"]
    assert len(layer_events) == len(LAYERS) and all("@load" in e[1] for e in layer_events)
    dev.log.clear()
    w.wait_for_layer_load(LAYERS[1])
    assert dev.log == [("compute.wait_event", layer_events[1][1])], "only that layer's event"
    w.wait_for_layer_load(LAYERS[1])
    assert len(dev.log) == 1, "a layer is waited for once"
    dev.log.clear()
    save2 = plan_save(w, "r2", "f", [8])
    meta2 = CPUOffloadingConnectorMetadata(loads=[], saves=[save2])
    w.wait_for_save(meta2)
    w.drain(5)
    waited = [e for e in dev.log if e[0] == "compute.wait_event"]
    assert len(waited) == len(LAYERS) - 1, "layers the forward skipped are waited at the end"
    fwd = next(e for e in dev.log if e[0] == "record" and "@compute" in e[1])
    assert ("save.wait_event", fwd[1]) in dev.log, "saves queue behind the end of the forward"
    assert dev.log.index(("save.wait_event", fwd[1])) < dev.log.index(("enter", "save")) + 2


@pytest.mark.parametrize("path", ["auto", "staged"])
def test_sync_tail_is_copied_on_the_compute_stream(make_worker: Callable[..., CPUOffloadWorker],
                                                   path: str) -> None:
    # auto on CPU: every layer in one call (per step); staged: the per-layer device path
    w = make_worker()
    w.copy_path = path
    caches = cpu_caches()
    w.register_kv_caches(caches)
    save = plan_save(w, "r", "g", [1, 2])
    w.wait_for_save(CPUOffloadingConnectorMetadata(saves=[save]))
    w.drain(5)
    copies: list[tuple[str, list[int]]] = []
    one_layer, all_layers = w._copy_in, w._copy_in_all

    def spy(layer: Any, host_ids: Any, dev_ids: Any, nb: bool) -> int:
        copies.append((w.device.current_stream().name, list(dev_ids)))
        return one_layer(layer, host_ids, dev_ids, nb)

    def spy_all(host_ids: Any, dev_ids: Any, nb: bool) -> int:
        copies.append((w.device.current_stream().name, list(dev_ids)))
        return all_layers(host_ids, dev_ids, nb)

    dev = RecordingDevice()
    w.device = dev
    w._load_stream = dev._stream("load")
    w._copy_in = spy  # type: ignore[method-assign]
    w._copy_in_all = spy_all  # type: ignore[method-assign]
    for t in caches.values():
        t.zero_()
    w.start_load_kv(CPUOffloadingConnectorMetadata(loads=[
        HostLoad(req_id="q", host_ids=save.host_ids, device_ids=[5, 6], sync_tail=True)]))
    n = len(LAYERS) if path == "staged" else 1
    assert copies[:n] == [("compute", [6])] * n, "the tail block first, on the compute stream"
    assert copies[n:] == [("load", [5])] * n, "the rest on the load stream"
    for t in caches.values():
        assert t[5].any() and t[6].any() and not t[1].any()
    assert len([e for e in dev.log if e[0] == "record"]) == len(LAYERS), "an event per layer"


def _register_all(workers: list[CPUOffloadWorker], caches: list[Any]) -> None:
    errors: list[BaseException] = []

    def run(w: CPUOffloadWorker, c: Any) -> None:
        try:
            w.register_kv_caches(c)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w, c)) for w, c in zip(workers, caches,
                                                                         strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors


def test_mla_ranks_save_stripes_of_one_shared_copy(make_worker: Callable[..., CPUOffloadWorker]
                                                   ) -> None:
    workers = [make_worker(RankInfo(tp_rank=r, tp_size=2)) for r in (0, 1)]
    caches = [mla_caches(seed=7), mla_caches(seed=7)]  # MLA: identical on every TP rank
    _register_all(workers, caches)
    assert workers[0].segment.path == workers[1].segment.path
    save = plan_save(workers[0], "m", "h", [0, 1, 2, 3, 4])
    meta = CPUOffloadingConnectorMetadata(saves=[save])
    workers[0].wait_for_save(meta)
    workers[0].drain(5)
    assert stats(workers[0]).cached_blocks == 0, "rank 1 has not saved its stripe yet"
    assert workers[0].recorder.total("offload_saved_blocks") in (2, 3)
    workers[1].wait_for_save(meta)
    workers[1].drain(5)
    assert stats(workers[0]).cached_blocks == 5
    saved_total = sum(w.recorder.total("offload_saved_blocks") for w in workers)
    assert saved_total == 5, "every block saved exactly once across the TP ranks"
    # every rank loads the whole prefix from the shared copy
    for w, c in zip(workers, caches, strict=True):
        want = {k: (v[0][0:5].clone(), v[1][0:5].clone()) for k, v in c.items()}
        for nope, rope in c.values():
            nope.zero_()
            rope.zero_()
        load = HostLoad(req_id="l", host_ids=save.host_ids, device_ids=[5, 6, 7, 8, 9])
        w.start_load_kv(CPUOffloadingConnectorMetadata(loads=[load]))
        for name in LAYERS:
            for part in (0, 1):
                assert torch.equal(c[name][part][5:10], want[name][part])


def test_non_mla_ranks_keep_their_own_heads(make_worker: Callable[..., CPUOffloadWorker]) -> None:
    workers = [make_worker(RankInfo(tp_rank=r, tp_size=2)) for r in (0, 1)]
    caches = [cpu_caches(seed=1), cpu_caches(seed=2)]
    _register_all(workers, caches)
    assert workers[0].segment.path != workers[1].segment.path
    save = plan_save(workers[0], "n", "i", [2, 3])
    for w in workers:
        w.wait_for_save(CPUOffloadingConnectorMetadata(saves=[save]))
        w.drain(5)
    assert stats(workers[0]).cached_blocks == 2
    for w, c in zip(workers, caches, strict=True):
        want = {k: v[2:4].clone() for k, v in c.items()}
        w.start_load_kv(CPUOffloadingConnectorMetadata(loads=[
            HostLoad(req_id="l", host_ids=save.host_ids, device_ids=[0, 1])]))
        assert all(torch.equal(c[k][0:2], want[k]) for k in c)


def test_shutdown_of_rank_0_removes_everything(make_worker: Callable[..., CPUOffloadWorker],
                                               _segments_in_tmp: Any) -> None:
    w = make_worker()
    w.register_kv_caches(cpu_caches())
    w.wait_for_save(CPUOffloadingConnectorMetadata(saves=[plan_save(w, "r", "j", [1])]))
    w.shutdown()
    assert w.server is None and w.segment is None
    assert not list(_segments_in_tmp.iterdir())
    w.shutdown()  # idempotent


def test_runs_on_the_npu_device_layer_with_fake_torch_npu(
        make_worker: Callable[..., CPUOffloadWorker], fake_torch_npu: Any) -> None:
    from vllm_ascend.distributed.kv_transfer.core.device import NpuDevice

    w = make_worker()
    caches = cpu_caches(seed=3)
    w.register_kv_caches(caches)
    dev = NpuDevice(0)
    w.device = dev
    w._load_stream, w._save_stream = dev.new_stream(), dev.new_stream()
    want = {k: v[4:6].clone() for k, v in caches.items()}
    save = plan_save(w, "r", "k", [4, 5])
    w.wait_for_save(CPUOffloadingConnectorMetadata(saves=[save]))
    assert w.drain(5)
    for v in caches.values():
        v.zero_()
    meta = CPUOffloadingConnectorMetadata(loads=[
        HostLoad(req_id="q", host_ids=save.host_ids, device_ids=[0, 1])])
    w.start_load_kv(meta)
    for name in LAYERS:
        w.wait_for_layer_load(name)
    w.wait_for_save(meta)
    assert w.drain(5)
    assert all(torch.equal(caches[k][0:2], want[k]) for k in caches)
    hist = w.recorder.take()["histograms"]
    assert hist.get("offload_load_seconds"), "the load time is measured off the step (thread)"


def test_a_pool_that_cannot_fit_fails_registration_clearly_and_cleans_up(
        make_worker: Callable[..., CPUOffloadWorker], _segments_in_tmp: Any) -> None:
    from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError

    w = make_worker(extra={"cpu_swap_space": "1KB"})
    with pytest.raises(RemoteError, match="cpu_swap_space of 1KB cannot hold one host block"):
        w.register_kv_caches(cpu_caches())
    assert w.server is None and w.client is None and w.segment is None
    assert not list(_segments_in_tmp.iterdir())


def test_failed_ids_of_a_load_plan_are_reported(make_worker: Callable[..., CPUOffloadWorker]
                                                ) -> None:
    w = make_worker()
    w.register_kv_caches(cpu_caches())
    w.start_load_kv(CPUOffloadingConnectorMetadata(loads=[
        HostLoad(req_id="x", host_ids=[], device_ids=[], failed_ids=[3, 4])]))
    assert w.get_block_ids_with_load_errors() == {3, 4}


def test_async_loads_of_shared_tensors_report_by_request(
        make_worker: Callable[..., CPUOffloadWorker]) -> None:
    """The hybrid KV cache manager: a layer of each group shares one tensor (moved once), a
    load vLLM waits for between steps is reported by ``get_finished`` once its blocks are in,
    and one that cannot be loaded is reported by request, never by block."""
    w = make_worker()
    shared = cpu_caches()
    caches = {LAYERS[0]: shared[LAYERS[0]], LAYERS[1]: shared[LAYERS[0]],
              LAYERS[2]: shared[LAYERS[2]]}
    w.register_kv_caches(caches)
    assert w.layout is not None and w.layout.aliases == {LAYERS[1]: LAYERS[0]}
    original = {k: v.clone() for k, v in caches.items()}
    save = plan_save(w, "r1", "a", [3, 4, 7])
    meta = CPUOffloadingConnectorMetadata(saves=[save])
    w.wait_for_save(meta)
    assert w.drain(10)
    for t in caches.values():
        t[3:8].zero_()
    load = HostLoad(req_id="r2", host_ids=save.host_ids, device_ids=[5, 6, 8], is_async=True)
    bad = HostLoad(req_id="r3", host_ids=[], device_ids=[], failed_ids=[9], is_async=True)
    w.start_load_kv(CPUOffloadingConnectorMetadata(loads=[load, bad]))
    assert w.get_finished(set()) == (None, {"r2", "r3"})
    assert w.take_failed_loads() == {"r3"} and w.take_failed_loads() == set()
    assert w.get_block_ids_with_load_errors() == set()
    for name, t in caches.items():
        for src, dst in zip([3, 4, 7], [5, 6, 8], strict=True):
            assert torch.equal(t[dst], original[name][src]), (name, dst)
