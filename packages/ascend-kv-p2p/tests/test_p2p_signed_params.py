# SPDX-License-Identifier: Apache-2.0
"""Signed ``kv_transfer_params``: with a key D uses only params a key holder MACed, and with
``allowed_peer_hosts`` it dials only the hosts named there.

The MAC itself (every key covered, also keys it does not know; expiry; rotation; a JSON
round trip keeps it), then the connectors' schedulers inside vLLM's real ``Scheduler``: P
returns signed params, D refuses changed ones before it claims anything (the load fails as
with malformed params), the layerwise D posts nothing for a forged metaserver.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_p2p_scheduler_lifecycle import (
    finished,
    free_blocks,
    make_scheduler,
    remote_params,
    request,
    step,
)
from vllm.v1.outputs import KVConnectorOutput

from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.auth import Authenticator
from vllm_ascend.distributed.kv_transfer.kv_p2p import signed_params
from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import KVParamsError
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import params_for_decode
from vllm_ascend.distributed.kv_transfer.kv_p2p.signed_params import (
    EXPIRES_KEY,
    MAC_KEY,
    ParamsRefused,
    host_allowed,
    sign,
    verify,
)

KEY = b"signed-params-deployment-key-0123456789"
A = Authenticator([KEY])


def refused(reason: str) -> float:
    return auth.RECORDER.total("auth_refused", socket=signed_params.SOCKET, reason=reason)


def p_params(**change: Any) -> dict[str, Any]:
    out = params_for_decode(block_ids=[4, 9], engine_id="p0", host="10.0.0.5", port=20000,
                            request_id="req-a", tp_size=2, last_token_id=7,
                            num_prompt_blocks=2, claim_token="tok-a",
                            rank_hosts={0: "10.0.0.5", 1: "10.0.0.6"},
                            window={"remote_held_at": 1.7e9 + 0.125, "remote_hold_s": 1.0})
    out.update(change)
    return out


def test_the_mac_covers_every_key_and_survives_json() -> None:
    params = sign(p_params(), ttl_s=60, authn=A)
    assert isinstance(params[MAC_KEY], str) and params[EXPIRES_KEY] > 1e9
    verify(params, authn=A)
    verify(json.loads(json.dumps(params)), authn=A)  # as the proxy and vLLM hand them on
    # vLLM's scheduler adds P's cache hits after the connector returned the params
    verify({**params, "remote_prefill_cached_tokens": 32}, authn=A)
    before = refused("bad_mac")
    for key, value in [("remote_host", "10.66.6.6"), ("remote_port", 20001),
                       ("remote_engine_id", "p1"), ("remote_request_id", "req-b"),
                       ("remote_block_ids", [4, 10]), ("remote_claim_token", "tok-b"),
                       (EXPIRES_KEY, params[EXPIRES_KEY] + 3600),
                       ("remote_multi_nodes_meta_mapping",
                        {"0": {"host": "10.0.0.5"}, "1": {"host": "10.66.6.6"}}),
                       # a key the signer added that this code does not know (per-group ids)
                       ("remote_group_block_ids", [[1, 2]])]:
        with pytest.raises(ParamsRefused, match="bad_mac") as err:
            verify({**params, key: value}, authn=A)
        assert err.value.reason == "bad_mac" and isinstance(err.value, KVParamsError)
    assert refused("bad_mac") == before + 9
    # signed with a key the signer knows and this side does not: refused too
    with pytest.raises(ParamsRefused, match="bad_mac"):
        verify(sign(p_params(), ttl_s=60, authn=Authenticator([b"x" * 32])), authn=A)
    # a key added on the signer's side is covered like any other
    extra = sign(p_params(remote_group_block_ids=[[1, 2], [3]]), ttl_s=60, authn=A)
    verify(extra, authn=A)
    with pytest.raises(ParamsRefused):
        verify({**extra, "remote_group_block_ids": [[1, 2], [4]]}, authn=A)


def test_the_mac_is_a_plain_hmac_sha256_of_the_canonical_form() -> None:
    """The MAC's keyed state is made once a key and copied (and the purpose keys derived once
    an authenticator): the bytes are HMAC-SHA256's over the canonical JSON, as documented
    (another implementation, or an older P, computes the same)."""
    import hashlib
    import hmac

    params = sign(p_params(), ttl_s=60.0, authn=A)
    key = A.purpose_keys(signed_params.PURPOSE)[0]
    expected = hmac.new(key, signed_params.canonical(params), hashlib.sha256).hexdigest()
    assert params[MAC_KEY] == expected
    assert json.loads(signed_params.canonical(params)) == {
        k: v for k, v in params.items() if k != MAC_KEY}
    assert signed_params.canonical(params) == json.dumps(
        {k: v for k, v in params.items() if k != MAC_KEY}, sort_keys=True,
        separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    # another key, another MAC (the cached states are per key)
    other = Authenticator([b"another-deployment-key-0123456789abcdef"])
    assert sign(p_params(), ttl_s=60.0, authn=other)[MAC_KEY] != expected


def test_unsigned_and_expired_params_are_refused_under_a_key() -> None:
    before = (refused("unsigned"), refused("expired"))
    with pytest.raises(ParamsRefused, match="unsigned"):
        verify(p_params(), authn=A)
    with pytest.raises(ParamsRefused, match="unsigned"):
        verify({**sign(p_params(), ttl_s=60, authn=A), MAC_KEY: ""}, authn=A)
    stale = sign(p_params(), ttl_s=1, authn=A)
    verify(stale, authn=A, now=stale[EXPIRES_KEY] + signed_params.CLOCK_SKEW_S - 0.5)
    with pytest.raises(ParamsRefused, match="expired"):
        verify(stale, authn=A, now=stale[EXPIRES_KEY] + signed_params.CLOCK_SKEW_S + 0.5)
    assert (refused("unsigned"), refused("expired")) == (before[0] + 2, before[1] + 1)


def test_rotation_the_old_key_still_verifies() -> None:
    old, new = b"the-old-deployment-key-000000", b"the-new-deployment-key-111111"
    signed_old = sign(p_params(), ttl_s=60, authn=Authenticator([old]))
    verify(signed_old, authn=Authenticator([new, old]))
    with pytest.raises(ParamsRefused):
        verify(signed_old, authn=Authenticator([new]))


def test_without_a_key_nothing_changes_unless_an_allowlist_is_set() -> None:
    params = p_params()
    assert sign(dict(params), ttl_s=60, authn=None) == params  # the bytes of before
    verify({**params, "remote_host": "203.0.113.9"}, authn=None)
    before = refused("not_allowed")
    allowed = ["10.0.0.0/24"]
    verify(params, authn=None, allowed_hosts=allowed)
    for change in ({"remote_host": "203.0.113.9"},
                   {"remote_multi_nodes_meta_mapping": {"0": {"host": "10.0.0.5"},
                                                        "1": {"host": "203.0.113.9"}}}):
        with pytest.raises(ParamsRefused, match="not_allowed.*203.0.113.9"):
            verify({**params, **change}, authn=None, allowed_hosts=allowed)
    # the allowlist applies under a key too
    with pytest.raises(ParamsRefused, match="not_allowed"):
        verify(sign(p_params(remote_host="203.0.113.9"), ttl_s=60, authn=A), authn=A,
               allowed_hosts=allowed)
    assert refused("not_allowed") == before + 3


def test_host_allowed_matches_addresses_networks_and_names() -> None:
    allowed = ["10.0.0.0/24", "192.0.2.7", "P-Host.example", "fd00::/64"]
    assert host_allowed("10.0.0.200", allowed) and host_allowed("192.0.2.7", allowed)
    assert host_allowed("p-host.example", allowed) and host_allowed("[fd00::5]", allowed)
    assert not host_allowed("10.0.1.1", allowed) and not host_allowed("192.0.2.8", allowed)
    assert not host_allowed("p-host.example.evil", allowed)
    assert not host_allowed("10.0.0.5", ["p-host.example"])  # a name is not resolved


def test_the_metaserver_must_be_one_the_config_names() -> None:
    params = {"do_remote_prefill": True, "metaserver": "http://10.0.0.1:8000/v1/metaserver",
              "request_id": "x"}
    mine = ["http://10.0.0.1:8000/v1/metaserver/"]
    verify(params, authn=None, metaserver_urls=mine)
    before = refused("not_allowed")
    with pytest.raises(ParamsRefused, match="not one of metaserver_urls"):
        verify({**params, "metaserver": "http://203.0.113.9/v1/metaserver"}, authn=None,
               metaserver_urls=mine)
    with pytest.raises(ParamsRefused, match="not_allowed.*203.0.113.9"):
        verify({**params, "metaserver": "https://203.0.113.9/m"}, authn=None,
               allowed_hosts=["10.0.0.1"])
    assert refused("not_allowed") == before + 2


# ------------------------------------------------------------ inside vLLM's Scheduler
@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    monkeypatch.setattr(auth, "_cached", None)
    yield
    monkeypatch.setattr(auth, "_cached", None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ascend_kv_testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("model"))


def test_p_signs_and_d_refuses_changed_params_before_it_claims(model_dir: Path,
                                                               keyed: None) -> None:
    p = make_scheduler(model_dir, "kv_producer")
    req = request("p1", 70, {"do_remote_decode": True, "do_remote_prefill": False},
                  max_tokens=1)
    p.add_request(req)
    _out, eo = step(p, sampled={"p1": 42})
    issued = json.loads(json.dumps(finished(eo)["p1"].kv_transfer_params))
    assert issued[MAC_KEY] and issued[EXPIRES_KEY] > issued["remote_held_at"]
    verify(issued)

    d = make_scheduler(model_dir, "kv_consumer")
    sent: list[str] = []
    assert d.connector is not None
    claims = d.connector.connector_scheduler.claims
    if claims is not None:  # nothing may be claimed for a refused request
        real_start = claims.start

        def start(rid: str, *args: Any) -> bool:
            sent.append(rid)
            return bool(real_start(rid, *args))

        claims.start = start
    before = refused("bad_mac") + refused("unsigned")
    good = request("good", 70, dict(issued))
    forged = request("forged", 70, {**issued, "remote_host": "203.0.113.9"})
    other = request("other", 70, {**issued, "remote_request_id": "someone-elses"})
    unsigned = request("unsigned", 70, remote_params(70))
    for r in (good, forged, other, unsigned):
        d.add_request(r)
    start = free_blocks(d)
    out, _ = step(d)
    metas = out.kv_connector_metadata.requests
    assert metas["good"].error is None and metas["good"].remote is not None
    for rid in ("forged", "other", "unsigned"):
        assert metas[rid].remote is None and "refused" in (metas[rid].error or "")
        assert rid not in sent
    assert refused("bad_mac") + refused("unsigned") >= before + 3
    # the failed loads end as vLLM's policy says and give their blocks back
    bad = {rid for rid in ("forged", "other", "unsigned")}
    _o, eo = step(d, kv=KVConnectorOutput(
        finished_recving=bad, invalid_block_ids={b for rid in bad
                                                 for b in metas[rid].local_block_ids}))
    assert bad <= set(finished(eo))
    assert free_blocks(d) == start - 3  # only "good" holds blocks: the refused ones are free
    d.finish_requests("good", _aborted())
    p.finish_requests("p1", _aborted())


def test_the_scheduler_keeps_the_key_it_was_built_with(model_dir: Path, keyed: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """P's scheduler looks the deployment key up once, when it is built (as the side
    channels do when they start), not a request: params it issues later are MACed with it."""
    p = make_scheduler(model_dir, "kv_producer")
    monkeypatch.delenv(auth.ENV_KEY)
    monkeypatch.setattr(auth, "_cached", None)
    assert auth.from_env() is None
    req = request("p2", 70, {"do_remote_decode": True, "do_remote_prefill": False},
                  max_tokens=1)
    p.add_request(req)
    _out, eo = step(p, sampled={"p2": 42})
    issued = finished(eo)["p2"].kv_transfer_params
    verify(issued, authn=A)  # MACed with the key of when it was built
    p.finish_requests("p2", _aborted())


def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def test_layerwise_d_posts_only_to_the_proxys_signed_metaserver(model_dir: Path,
                                                                keyed: None) -> None:
    from test_p2p_layerwise_scheduler import Metaserver
    from test_p2p_layerwise_scheduler import make_scheduler as make_lw
    from test_p2p_layerwise_scheduler import request as lw_request
    from test_p2p_layerwise_scheduler import step as lw_step

    server = Metaserver()
    try:
        d = make_lw(model_dir, "kv_consumer")
        signed = sign({"do_remote_decode": False, "do_remote_prefill": True,
                       "metaserver": server.url, "request_id": "proxy-1"}, ttl_s=60)
        evil = {**signed, "metaserver": server.url + "/elsewhere"}
        d.add_request(lw_request("ok", 70, dict(signed)))
        d.add_request(lw_request("evil", 70, evil, first=600))
        d.add_request(lw_request("plain", 70, {k: v for k, v in signed.items()
                                               if k != MAC_KEY}, first=900))
        out, _ = lw_step(d)
        metas = out.kv_connector_metadata.requests
        assert metas["ok"].error is None
        assert "bad_mac" in (metas["evil"].error or "")
        assert "unsigned" in (metas["plain"].error or "")
        posts = server.wait_posts(1)
        time.sleep(0.3)  # a post for a refused request would have come by now
        assert [p["remote_request_id"] for p in posts] == ["ok"]
    finally:
        server.close()


def test_layerwise_p_pushes_only_to_what_d_signed(model_dir: Path, keyed: None) -> None:
    """The other direction: D MACs what it posts to the metaserver (P's params), and P checks
    them before it dials D; refused params name a host that is told nothing."""
    from test_p2p_layerwise_scheduler import Metaserver, p_params
    from test_p2p_layerwise_scheduler import make_scheduler as make_lw
    from test_p2p_layerwise_scheduler import request as lw_request
    from test_p2p_layerwise_scheduler import step as lw_step

    server = Metaserver()
    try:
        d = make_lw(model_dir, "kv_consumer")
        d.add_request(lw_request("d1", 70, sign({"do_remote_prefill": True,
                                                "metaserver": server.url,
                                                "request_id": "proxy-1"}, ttl_s=60)))
        lw_step(d)
        (posted,) = server.wait_posts(1)
        verify(posted)  # what P gets through the proxy, signed by D
    finally:
        server.close()
    p = make_lw(model_dir, "kv_producer")
    before = refused("bad_mac") + refused("unsigned")
    p.add_request(lw_request("good", 70, sign(p_params(70), ttl_s=60), max_tokens=1))
    p.add_request(lw_request("forged", 70, {**sign(p_params(70, remote_request_id="d-2"),
                                                   ttl_s=60), "remote_host": "203.0.113.9"},
                             max_tokens=1, first=600))
    p.add_request(lw_request("plain", 70, p_params(70, remote_request_id="d-3"),
                             max_tokens=1, first=900))
    out, _ = lw_step(p)
    pushes = out.kv_connector_metadata.pushes
    assert pushes["good"].target is not None and pushes["good"].target.host == "127.0.0.1"
    for rid in ("forged", "plain"):
        assert pushes[rid].target is None and "refused" in (pushes[rid].abort or "")
        assert pushes[rid].endpoint is None  # the host the params name hears nothing
    assert refused("bad_mac") + refused("unsigned") == before + 2
