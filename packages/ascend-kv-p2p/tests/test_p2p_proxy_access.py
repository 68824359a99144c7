# SPDX-License-Identifier: Apache-2.0
"""Who may read what of the proxy (issue 51).

With a deployment key ``/status`` and ``/metrics`` want the admin bearer token; without one
they and ``/v1/metaserver`` serve clients on the proxy's host only (protected mode,
``core.protected``), unless ``VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED=1``. ``/health`` answers
anyone and says only whether the proxy can serve. ``/v1/completions`` is the front door:
protected mode never applies to it. Clients on other hosts are Starlette's ``TestClient``
with a client address that is not this host's.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

import pytest

from ascend_kv_testing.keys import set_deployment_key
from ascend_kv_testing.serving import local_test_client
from vllm_ascend.distributed.kv_transfer.core import auth, protected
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig, build_app
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.routes import PURPOSE_ADMIN

KEY = "proxy-access-test-deployment-key-0123456789"
#: TEST-NET-2 (RFC 5737): never an address of this host
OUTSIDER = ("198.51.100.7", 40000)
#: instance URLs nobody listens on; /status would list them
P_URL, D_URL = "http://127.0.0.1:1", "http://127.0.0.1:2"
GUARDED = ("/status", "/metrics")


def refused(socket: str, reason: str) -> float:
    return auth.RECORDER.total("auth_refused", socket=socket, reason=reason)


@pytest.fixture(autouse=True)
def no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    set_deployment_key(monkeypatch, None)
    monkeypatch.delenv(auth.ENV_ALLOW_UNAUTHENTICATED, raising=False)


@pytest.fixture
def clients() -> Iterator[Any]:
    opened: list[Any] = []

    def make(client: tuple[str, int] | None = None, mode: str = "pull") -> Any:
        metaserver = "http://127.0.0.1:3/v1/metaserver" if mode == "layerwise" else None
        app = build_app(ProxyConfig(prefill=[P_URL], decode=[D_URL], health_interval_s=60,
                                    mode=mode, metaserver_url=metaserver))
        c = local_test_client(app, client=client) if client else local_test_client(app)
        c.__enter__()
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.__exit__(None, None, None)


def bearer(purpose: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + auth.Authenticator([KEY.encode()]).bearer_token(
        purpose)}


def test_health_says_only_whether_the_proxy_serves(clients: Any) -> None:
    r = clients(OUTSIDER).get("/health")
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}
    assert P_URL not in r.text and D_URL not in r.text


def test_without_a_key_status_and_metrics_serve_this_host_only(clients: Any) -> None:
    outsider = clients(OUTSIDER)
    for path in GUARDED:
        socket = "proxy" + path.replace("/", "-")
        before = refused(socket, protected.REFUSAL)
        r = outsider.get(path)
        assert r.status_code == 403, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "protected_mode"
        assert auth.ENV_KEY_FILE in error["message"]
        assert f"{auth.ENV_ALLOW_UNAUTHENTICATED}=1" in error["message"]
        assert P_URL not in r.text
        assert refused(socket, protected.REFUSAL) == before + 1
    for client in (clients(), clients(("127.0.0.1", 40000)), clients(("::1", 40000))):
        assert client.get("/status").json()["prefill"][0]["url"] == P_URL
        assert client.get("/metrics").status_code == 200


def test_without_a_key_a_client_host_that_is_no_address_is_refused(clients: Any) -> None:
    """Only an address is placed on this host: a name (Starlette's in-process client says
    "testclient"; uvicorn takes X-Forwarded-For from senders FORWARDED_ALLOW_IPS trusts) is
    refused like any peer elsewhere."""
    for name in ("testclient", "localhost"):
        r = clients((name, 40000)).get("/status")
        assert r.status_code == 403 and r.json()["error"]["type"] == "protected_mode", name


def test_without_a_key_this_hosts_own_address_is_served(clients: Any) -> None:
    mine = [a for a in protected.local_addresses() if not ipaddress.ip_address(
        a.split("%")[0]).is_loopback]
    if not mine:
        pytest.skip("this host has no network interface besides loopback")
    for address in mine:
        assert clients((address, 40000)).get("/status").status_code == 200, address


def test_without_a_key_the_metaserver_serves_this_host_only(clients: Any) -> None:
    before = refused("proxy-metaserver", protected.REFUSAL)
    r = clients(OUTSIDER, mode="layerwise").post("/v1/metaserver", json={"request_id": "x"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "protected_mode"
    assert refused("proxy-metaserver", protected.REFUSAL) == before + 1
    # on this host it reaches the metaserver, which finds no such request pending
    r = clients(mode="layerwise").post("/v1/metaserver", json={"request_id": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_request"


def test_protected_mode_leaves_the_front_door_open(clients: Any) -> None:
    r = clients(OUTSIDER).post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503  # no instance reachable: served, not refused


def test_the_opt_out_serves_every_host(clients: Any, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    monkeypatch.setenv(auth.ENV_ALLOW_UNAUTHENTICATED, "1")
    outsider = clients(OUTSIDER)
    assert outsider.get("/status").status_code == 200
    assert outsider.get("/metrics").status_code == 200
    # /admin/instances stays same-host only without a key
    assert outsider.get("/admin/instances").status_code == 403


def test_with_a_key_status_and_metrics_want_the_admin_token(
        clients: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    set_deployment_key(monkeypatch, KEY)
    for client in (clients(), clients(OUTSIDER)):  # the key decides, not the host
        for path in GUARDED:
            socket = "proxy" + path.replace("/", "-")
            before = {r: refused(socket, r) for r in ("unauthenticated", "bad_token")}
            r = client.get(path)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert P_URL not in r.text
            # the metaserver's token is not the admin's
            assert client.get(path, headers=bearer(auth.PURPOSE_METASERVER)).status_code == 401
            assert refused(socket, "unauthenticated") == before["unauthenticated"] + 1
            assert refused(socket, "bad_token") == before["bad_token"] + 1
            assert client.get(path, headers=bearer(PURPOSE_ADMIN)).status_code == 200
        assert client.get("/health").json() == {"status": "unavailable"}
    status = clients(OUTSIDER).get("/status", headers=bearer(PURPOSE_ADMIN)).json()
    assert status["prefill"][0]["url"] == P_URL


def test_with_a_key_the_metaserver_serves_any_host_with_its_token(
        clients: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    set_deployment_key(monkeypatch, KEY)
    outsider = clients(OUTSIDER, mode="layerwise")
    assert outsider.post("/v1/metaserver", json={}).status_code == 401
    r = outsider.post("/v1/metaserver", json={"request_id": "x"},
                      headers=bearer(auth.PURPOSE_METASERVER))
    assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_request"
