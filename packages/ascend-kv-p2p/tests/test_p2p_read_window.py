# SPDX-License-Identifier: Apache-2.0
"""The read window (``pull.contract``): D reads a fresh request without claiming it.

Real P and D pull workers (side channels, the real transfer engine on loopback), with and
without a deployment key: P stamps the params with its hold and its engine start and keeps
the blocks for ``read_window_s`` whatever D says; D trusts a read that ends within the
window, claims one that ends after it, and reads unclaimed only from the engine start that
holds the request (a P restarted at the same address is fetched again). A keyed P's blocks
are where its claim's grant says, and D keeps no grant: its requests are claimed before they
are read, window or not.
"""

from __future__ import annotations

import dataclasses
import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq
from p2p_worker_harness import numbered_caches, pd_vllm_config, set_retry

from ascend_kv_testing.keys import set_deployment_key
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import KVParamsError
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
    RemotePrefill,
    engine_instance,
    params_for_decode,
    parse_remote_prefill,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import Claim, GetMeta
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    CLOCK_SKEW_S,
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
    in_window,
    stamp,
    window_end,
    window_tag,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.scheduler import PullScheduler
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker
from vllm_ascend.distributed.kv_transfer.kv_p2p.signed_params import sign

BS, NB, HEADS, HD, LAYERS = 16, 8, 2, 8, 2
KEY = "deployment-key-for-the-read-window-tests-0001"
#: P's read_window_s here: D trusts reads ending WINDOW_S - CLOCK_SKEW_S after the stamp
WINDOW_S = 2.0


def _config(role: str, port: int, instance: str) -> Any:
    vc = pd_vllm_config(role, port, block_size=BS, heads=HEADS)
    vc.instance_id = instance
    return vc


def _p(port: int, instance: str, fill: float) -> tuple[PullWorker, dict[str, Any]]:
    """A P worker on ``port`` (engine id "P", vLLM instance ``instance``) whose cache holds
    ``fill`` plus each element's number."""
    p = PullWorker(_config("kv_producer", port, instance),
                   MooncakeP2PConfig.from_dict({"lease_ttl_s": 30.0,
                                                "read_window_s": WINDOW_S}),
                   "P", MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    cache = numbered_caches(True, layers=LAYERS, blocks=NB, heads=HEADS, block_size=BS,
                            head_size=HD)
    for t in cache.values():
        t += fill
    p.register_kv_caches(cache)
    return p, cache


def _spy(pd: Any, p: PullWorker) -> None:
    """Record every Claim and GetMeta ``p``'s side channel answers."""
    assert p.holder is not None and p.holder.server is not None
    handle = p.holder.handle

    def spy(msg: Any) -> Any:
        if isinstance(msg, Claim):
            pd.claims.append(msg.request_id)
        elif isinstance(msg, GetMeta):
            pd.get_meta += 1
        return handle(msg)

    p.holder.server.handler = spy


@pytest.fixture(params=["unkeyed", "keyed"])
def pd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    set_deployment_key(monkeypatch, KEY if request.param == "keyed" else None)
    p_port = free_port()
    p, cp = _p(p_port, "1001", 0.0)
    d = PullWorker(_config("kv_consumer", free_port(), "2002"),
                   MooncakeP2PConfig.from_dict({"load_timeout_s": 10.0}), "D",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    cd = numbered_caches(False, layers=LAYERS, blocks=NB, heads=HEADS, block_size=BS,
                         head_size=HD)
    d.register_kv_caches(cd)
    ns = SimpleNamespace(p=p, d=d, cp=cp, cd=cd, p_port=p_port, claims=[], get_meta=0,
                         keyed=request.param == "keyed", reads=[],
                         window_base=0.0)
    _spy(ns, p)
    original = d.reader._read

    def read(meta: RecvMeta, *args: Any) -> int:
        ns.reads.append(meta.request_id)
        return int(original(meta, *args))

    d.reader._read = read
    try:
        yield ns
    finally:
        ns.p.shutdown()
        d.shutdown()
        monkeypatch.setattr(auth, "_cached", None)


def hold(pd: Any, rid: str, src: list[int], *, age_s: float = 0.0,
         instance: str | None = None, register: bool = True) -> tuple[RemotePrefill, float]:
    """P's scheduler stamps (and tags) the params ``age_s`` ago and its worker holds
    ``src`` (unless not ``register``: P's next engine step has not come yet); the params D
    gets, and ``time.monotonic()`` at the stamp."""
    token = auth.capability_token()
    stamped = time.monotonic()
    held_at = time.time() - age_s
    if register:
        pd.p.start_load_kv(MooncakeConnectorMetadata(
            requests_to_send={rid: SendMeta(rid, src, token)}))
    instance = pd.p.instance if instance is None else instance
    hold_s = pd.p.cfg.hold_window_s
    remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port, request_id=rid,
                           block_ids=src, tp_size=1, pcp_size=1, dcp_size=1, token=token,
                           instance=instance, held_at=held_at, hold_s=hold_s,
                           window_tag=window_tag(instance=instance, request_id=rid,
                                                 block_ids=src, held_at=held_at,
                                                 hold_s=hold_s, token=token))
    return remote, stamped


def load(pd: Any, rid: str, remote: RemotePrefill, local: list[int], *,
         ok: bool = True) -> None:
    """D loads ``remote``'s blocks into ``local``; checks how it ended (and the bytes)."""
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={rid: RecvMeta(
        rid, local, remote, remote_block_ids=remote.block_ids)}))
    assert pd.d.wait_loads([rid], timeout=20), "the load did not end"
    _s, recving = pd.d.get_finished()
    assert recving == {rid}
    errors = pd.d.get_block_ids_with_load_errors()
    if not ok:
        assert errors == set(local)
        return
    assert errors == set()
    for name, value in pd.cd.items():
        torch.testing.assert_close(value[local], pd.cp[name][remote.block_ids], rtol=0, atol=0)


def released_at(pd: Any, rid: str, timeout: float = 15.0) -> float:
    """``time.monotonic()`` when P gave ``rid``'s blocks back to vLLM (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sending, _r = pd.p.get_finished()
        if sending and rid in sending:
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"P never released {rid}")


def warm_up(pd: Any) -> None:
    """D's first request: it fetches P's metadata; a keyed P names the blocks' addresses
    only in a claim's grant, so its requests are claimed (an unkeyed P's is read in the
    window)."""
    remote, _t = hold(pd, "warm", [0])
    load(pd, "warm", remote, [0])
    assert pd.claims == (["warm"] if pd.keyed else []) and pd.get_meta == 1
    pd.claims.clear()
    pd.window_base = pd.d.recorder.total("p2p_window_reads")


def window_reads(pd: Any) -> float:
    """D's reads trusted in the window since the warm-up."""
    return pd.d.recorder.total("p2p_window_reads") - pd.window_base


@pytest.mark.parametrize("pd", ["unkeyed"], indirect=True)
def test_a_read_within_the_window_claims_nothing_and_p_keeps_the_blocks(pd: Any) -> None:
    warm_up(pd)
    remote, stamped = hold(pd, "a", [3, 5])
    load(pd, "a", remote, [1, 2])
    assert pd.claims == [] and window_reads(pd) == 1
    # D's Done came at once; P keeps the blocks for the whole window from its hold anyway
    assert released_at(pd, "a") - stamped >= WINDOW_S
    assert pd.p.recorder.gauge("p2p_held_requests") == 0


@pytest.mark.parametrize("pd", ["unkeyed"], indirect=True)
def test_a_second_reader_within_the_window_reads_the_request_then_a_late_one_is_refused(
        pd: Any) -> None:
    """A request read twice (a proxy retrying on another D): within the window the second
    read gets the request's KV although the first reader's Done released it; once P freed
    the blocks, a reader is claimed and refused, never served other data."""
    warm_up(pd)
    remote, _t = hold(pd, "r", [4, 6])
    load(pd, "first", remote, [1, 2])
    load(pd, "second", remote, [3, 5])
    assert pd.claims == [] and window_reads(pd) == 2
    released_at(pd, "r")  # after the window: P's clock passed the stamp + WINDOW_S
    assert time.time() > window_end(remote)
    load(pd, "late", remote, [6, 7], ok=False)
    assert pd.claims == ["r"] and "late" not in pd.reads  # claimed first: nothing read
    assert pd.d.recorder.total("p2p_failures", cause="released") == 1


@pytest.mark.parametrize("pd", ["keyed"], indirect=True)
def test_a_keyed_ps_request_within_the_window_is_claimed_before_it_is_read(pd: Any) -> None:
    """D knows where a keyed P's blocks are only from this request's grant: within the
    window too it claims, then reads; P still keeps the blocks for the whole window."""
    warm_up(pd)
    events: list[str] = []
    read, claim = pd.d.reader._read, pd.d.reader.peers.claim
    pd.d.reader._read = lambda *a: events.append("read") or int(read(*a))
    pd.d.reader.peers.claim = lambda *a: events.append("claim") or claim(*a)
    remote, stamped = hold(pd, "a", [3, 5])
    assert in_window(remote, margin_s=0.0)
    load(pd, "a", remote, [1, 2])
    assert events == ["claim", "read"] and pd.claims == ["a"] and window_reads(pd) == 0
    assert released_at(pd, "a") - stamped >= WINDOW_S


@pytest.mark.parametrize("pd", ["unkeyed"], indirect=True)
def test_a_read_ending_after_the_window_is_claimed_after_it(pd: Any) -> None:
    warm_up(pd)
    events: list[str] = []
    read, claim = pd.d.reader._read, pd.d.reader.peers.claim

    def slow_read(meta: RecvMeta, *args: Any) -> int:
        time.sleep(0.5)  # the window ends during the read
        events.append("read")
        return int(read(meta, *args))

    def logged_claim(*args: Any) -> Any:
        events.append("claim")
        return claim(*args)

    pd.d.reader._read, pd.d.reader.peers.claim = slow_read, logged_claim
    # stamped so long ago that 0.2 s of the window are left when D starts
    remote, _t = hold(pd, "old", [2], age_s=WINDOW_S - CLOCK_SKEW_S - 0.2)
    assert in_window(remote, margin_s=0.0)
    load(pd, "old", remote, [4])
    assert events == ["read", "claim"]  # read at once, claimed after it: trusted
    assert pd.claims == ["old"] and window_reads(pd) == 0


def test_a_request_whose_window_is_over_is_claimed_before_it_is_read(pd: Any) -> None:
    warm_up(pd)
    remote, _t = hold(pd, "stale", [2], age_s=WINDOW_S)
    assert not in_window(remote, margin_s=0.0)
    load(pd, "stale", remote, [4])
    assert pd.claims == ["stale"] and window_reads(pd) == 0


@pytest.mark.parametrize("change", [
    {"request_id": "a-request-p-never-had"},
    {"block_ids": [6, 7]},  # another request's blocks
    {"token": "a-stale-token"},
    {"held_at": 0.5e9},  # an old stamp made young
    {"window_tag": ""},
])
def test_params_changed_on_the_way_are_claimed_and_refused(
        pd: Any, change: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a claim P cannot check the request id, the blocks or the token: the window
    tag stands for those checks. Params that differ from what P tagged are claimed, and P
    refuses them as before, instead of D reading blocks that are not the request's."""
    set_retry(pd.d, "claim_retry", deadline_s=0.3)  # "unknown request": not retried long
    warm_up(pd)
    hold(pd, "other", [6, 7])
    remote, _t = hold(pd, "r", [2, 3])
    if "held_at" in change:
        change = {"held_at": time.time()}  # a fresh stamp on params P stamped earlier
        time.sleep(0.01)
    bad = dataclasses.replace(remote, **change)
    assert window_end(bad) == -math.inf
    # a changed stamp or a missing tag: still the request's params, served under a claim
    servable = bool({"held_at", "window_tag"} & set(change))
    load(pd, "bad", bad, [4, 5], ok=servable)
    assert set(pd.claims) == {bad.request_id} and window_reads(pd) == 0
    assert servable or "bad" not in pd.reads  # refused: never read


@pytest.mark.parametrize("pd", ["unkeyed"], indirect=True)
def test_a_done_before_p_registered_the_request_is_kept(pd: Any) -> None:
    """D read in the window and was done before P's next engine step registered the
    request: P applies that Done when it does (no lease left to lapse)."""
    warm_up(pd)
    remote, stamped = hold(pd, "early", [3], register=False)
    load(pd, "early", remote, [5])  # vLLM holds P's blocks from the stamp on
    deadline = time.monotonic() + 5
    while pd.p.holder._early_done.get("early") is None:  # D's Done went out after the load
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pd.p.start_load_kv(MooncakeConnectorMetadata(
        requests_to_send={"early": SendMeta("early", [3], remote.token)}))
    assert released_at(pd, "early") - stamped >= WINDOW_S
    assert pd.p.recorder.total("p2p_requests_served") == 2  # the warm-up's and this one
    assert pd.p.recorder.total("p2p_late_completions") == 0


def test_params_of_another_engine_start_are_not_read_unclaimed(pd: Any) -> None:
    """Params naming another start of P than the one D's cached metadata describes: D
    fetches P's metadata again (once for that start) and, as it still differs, claims."""
    warm_up(pd)
    before = pd.get_meta
    for rid in ("x", "y"):
        remote, _t = hold(pd, rid, [1], instance="P/another-start")
        load(pd, rid, remote, [2])
    assert pd.get_meta == before + 1
    assert pd.claims == ["x", "y"] and window_reads(pd) == 0


def test_a_restarted_p_at_the_same_address_is_read_at_its_new_regions(pd: Any) -> None:
    """P restarts on the same port (new memory, new engine start): D's cached metadata is
    of the old one. Its first request's params name the new start, so D fetches the
    metadata again and reads the new P's blocks, not the addresses it knew."""
    warm_up(pd)
    remote, _t = hold(pd, "before", [2])
    load(pd, "before", remote, [1])
    # the Done owed to the old P goes out before it stops: sent to the stopping P it waited
    # out its 10 s timeout on the client the new P's GetMeta shares, past the new window
    pd.d.reader.done_sent()
    pd.p.shutdown()
    deadline = time.monotonic() + 10
    while True:  # the old side channel's port is free once its socket closed
        try:
            pd.p, pd.cp = _p(pd.p_port, "1003", 5000.0)  # other bytes at other addresses
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    _spy(pd, pd.p)
    pd.claims.clear()
    remote, _t = hold(pd, "after", [3])
    assert remote.instance != "P/1001"
    load(pd, "after", remote, [4])  # the bytes checked are the new P's
    # unkeyed: the new metadata has the regions; keyed: they come with a grant
    assert pd.claims == (["after"] if pd.keyed else [])


# ------------------------------------------------------------ D's scheduler


def _request(rid: str, remote: RemotePrefill) -> Any:
    params = params_for_decode(
        block_ids=remote.block_ids, engine_id="P", host=remote.host, port=remote.port,
        request_id=remote.request_id, tp_size=1, last_token_id=None,
        num_prompt_blocks=len(remote.block_ids), claim_token=remote.token,
        window={"remote_instance": remote.instance, "remote_held_at": remote.held_at,
                "remote_hold_s": remote.hold_s, "remote_window_tag": remote.window_tag})
    sign(params, ttl_s=60)  # as a keyed P returns them (D checks the MAC first)
    return SimpleNamespace(request_id=rid, kv_transfer_params=params,
                           prompt_token_ids=list(range(len(remote.block_ids) * BS)),
                           status=None)


def test_the_scheduler_claims_ahead_only_outside_the_window(pd: Any) -> None:
    sched = PullScheduler(_config("kv_consumer", free_port(), "3003"),
                          MooncakeP2PConfig.from_dict({"handshake_timeout_s": 2.0}), "D-sched")
    try:
        assert sched.claims is not None
        fresh, _t = hold(pd, "fresh", [2])
        sched.get_num_new_matched_tokens(_request("fresh", fresh), 0)
        assert "fresh" not in sched.claims._sent  # read unclaimed by the worker
        stale, _t = hold(pd, "stale", [3], age_s=WINDOW_S)
        sched.get_num_new_matched_tokens(_request("stale", stale), 0)
        sched.claims._sent["stale"][1].result(timeout=10)
        assert pd.claims == ["stale"]
    finally:
        sched.shutdown()


def test_the_scheduler_checks_the_tag_once_and_sends_its_verdict(
        pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """P's window tag is checked once a request, however often vLLM asks, and the verdict
    (the window's end) goes to the worker in RecvMeta.window_until; params P did not tag
    send -inf (claimed as without a window)."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import contract as pull_window

    sched = PullScheduler(_config("kv_consumer", free_port(), "3004"),
                          MooncakeP2PConfig.from_dict({"handshake_timeout_s": 2.0}), "D-s2")
    checked: list[str] = []
    real = pull_window.tag_ok
    monkeypatch.setattr(pull_window, "tag_ok",
                        lambda r, *a: checked.append(r.request_id) or real(r, *a))
    try:
        fresh, _t = hold(pd, "v1", [2, 3])
        forged = dataclasses.replace(fresh, request_id="v2", block_ids=[4, 5])
        for rid, remote in (("v1", fresh), ("v2", forged)):
            req = _request(rid, remote)
            for _ in range(3):  # vLLM asks every step while the request waits
                sched.get_num_new_matched_tokens(req, 0)
            blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [6, 7])
            sched.update_state_after_alloc(req, blocks, 2 * BS)  # type: ignore[arg-type]
        meta = sched.build_connector_meta(None)  # type: ignore[arg-type]
        assert checked == ["v1", "v2"]
        assert meta.requests["v1"].window_until == fresh.held_at + fresh.hold_s - CLOCK_SKEW_S
        assert meta.requests["v2"].window_until == -math.inf
    finally:
        sched.shutdown()


def test_the_tag_is_a_plain_hmac_sha256_of_its_fields() -> None:
    """The tag's keyed state is made once a key and copied: the bytes are HMAC-SHA256's over
    the fields joined with '|' (an older P's tag checks, and P's tag checks on D)."""
    import hashlib
    import hmac

    from vllm_ascend.distributed.kv_transfer.core.auth import Authenticator
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import TAG_PURPOSE

    for a in (None, Authenticator([b"read-window-deployment-key-0123456789"])):
        key = a.purpose_keys(TAG_PURPOSE)[0] if a is not None else b""
        tag = window_tag(instance="P/1", request_id="r9", block_ids=[3, 1, 4], held_at=1.5e9,
                         hold_s=2.0, token="tok", authn=a)
        text = "|".join(["P/1", "r9", "3,1,4", repr(1.5e9), repr(2.0), "tok"])
        assert tag == hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


# ------------------------------------------------------------ params and config


def _params(**extra: Any) -> dict[str, Any]:
    out = params_for_decode(block_ids=[1, 2], engine_id="P", host="10.0.0.1", port=7000,
                            request_id="r", tp_size=1, last_token_id=None,
                            num_prompt_blocks=2,
                            window=stamp(instance="P/9", request_id="r", block_ids=[1, 2],
                                         token="", hold_s=1.0))
    out.update(extra)
    return out


def test_params_carry_the_window_and_bad_values_are_clear_errors() -> None:
    before = time.time()
    remote = parse_remote_prefill(_params(), prompt_len=2 * BS, block_size=BS)
    assert (remote.instance, remote.hold_s) == ("P/9", 1.0)
    assert before <= remote.held_at <= time.time()  # stamped when P began holding
    assert window_end(remote) == remote.held_at + 1.0 - CLOCK_SKEW_S
    # a P that promises nothing (read_window_s 0, or no engine start known): no window
    assert stamp(instance="P/9", request_id="r", block_ids=[1], token="", hold_s=0.0) == {}
    assert stamp(instance="", request_id="r", block_ids=[1], token="", hold_s=1.0) == {}
    plain = params_for_decode(block_ids=[1], engine_id="P", host="h", port=1, request_id="r",
                              tp_size=1, last_token_id=None, num_prompt_blocks=1)
    assert "remote_hold_s" not in plain
    assert window_end(parse_remote_prefill(plain, prompt_len=BS, block_size=BS)) == -math.inf
    for key, bad in [("remote_held_at", "yesterday"), ("remote_held_at", -1.0),
                     ("remote_hold_s", float("nan")), ("remote_hold_s", 1e9),
                     ("remote_hold_s", True), ("remote_instance", 7),
                     ("remote_instance", "x" * 300), ("remote_window_tag", 1)]:
        with pytest.raises(KVParamsError, match=key):
            parse_remote_prefill(_params(**{key: bad}), prompt_len=2 * BS, block_size=BS)


def test_the_window_is_at_most_half_the_lease_and_zero_turns_it_off() -> None:
    cfg = MooncakeP2PConfig.from_dict
    assert cfg({}).hold_window_s == 1.0
    assert cfg({"lease_ttl_s": 1.0}).hold_window_s == 0.5
    assert cfg({"read_window_s": 0}).hold_window_s == 0.0
    assert engine_instance(SimpleNamespace(instance_id="123"), "P") == "P/123"
    assert engine_instance(SimpleNamespace(), "P") == ""  # not told: never matches
