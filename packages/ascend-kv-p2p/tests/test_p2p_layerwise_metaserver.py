# SPDX-License-Identifier: Apache-2.0
"""D's metaserver client: TLS from ``tls_config`` (server and mutual TLS), retries, errors.

Certificates are made for the test by the ``openssl`` command line (a CA, a server
certificate for 127.0.0.1, a client certificate with a password-protected key).
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig, TLSConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.metaserver import (
    MetaserverClient,
    MetaserverError,
    build_ssl_context,
)

PASSWORD = "s3cret"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=layerwise-test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext",
                 cwd=d)
    _openssl("pkey", "-in", "client.key", "-aes256", "-passout", f"pass:{PASSWORD}", "-out",
             "client.enc.key", cwd=d)
    return {k: str(d / v) for k, v in {"ca": "ca.pem", "server_cert": "server.pem",
                                        "server_key": "server.key", "client_cert": "client.pem",
                                        "client_key": "client.enc.key"}.items()}


class Server:
    """An HTTP(S) metaserver answering ``statuses`` in turn (then 200)."""

    def __init__(self, *, tls: ssl.SSLContext | None = None,
                 statuses: list[int] | None = None) -> None:
        self.posts: list[dict[str, Any]] = []
        self.statuses = list(statuses or [])
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.posts.append(json.loads(self.rfile.read(
                    int(self.headers["Content-Length"]))))
                code = outer.statuses.pop(0) if outer.statuses else 200
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.scheme = "https" if tls is not None else "http"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.httpd.server_address[1]}/v1/metaserver"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def server_tls(certs: dict[str, str], *, require_client: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs["server_cert"], certs["server_key"])
    if require_client:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(certs["ca"])
    return ctx


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for s in started:
        s.close()


def client(tls: dict[str, Any] | None = None, retries: int = 0) -> MetaserverClient:
    cfg = MooncakeLayerwiseConfig.from_dict({"tls_config": tls or {}, "metaserver_retries":
                                             retries, "metaserver_timeout_s": 3})
    return MetaserverClient(cfg.tls_config, timeout_s=cfg.metaserver_timeout_s,
                            retry=cfg.metaserver_policy)


def test_tls_with_the_configured_ca(certs: dict[str, str], servers: list[Server]) -> None:
    srv = Server(tls=server_tls(certs))
    servers.append(srv)
    c = client({"ssl_enable": True, "ssl_ca_certs": certs["ca"]})
    c.post(srv.url, {"request_id": "r1"})
    assert srv.posts == [{"request_id": "r1"}]
    c.close()


def test_tls_refuses_a_server_it_cannot_verify(certs: dict[str, str],
                                               servers: list[Server]) -> None:
    srv = Server(tls=server_tls(certs))
    servers.append(srv)
    c = client({"ssl_enable": True}, retries=1)  # system CAs only: the test CA is unknown
    with pytest.raises(MetaserverError, match="CERTIFICATE_VERIFY_FAILED|certificate verify"):
        c.post(srv.url, {"request_id": "r1"})
    assert srv.posts == []
    c.close()


def test_mutual_tls_with_a_password_protected_client_key(certs: dict[str, str],
                                                         servers: list[Server]) -> None:
    srv = Server(tls=server_tls(certs, require_client=True))
    servers.append(srv)
    good = client({"ssl_enable": True, "ssl_ca_certs": certs["ca"],
                   "ssl_certfile": certs["client_cert"], "ssl_keyfile": certs["client_key"],
                   "ssl_keyfile_password": PASSWORD})
    good.post(srv.url, {"request_id": "r2"})
    assert srv.posts == [{"request_id": "r2"}]
    anonymous = client({"ssl_enable": True, "ssl_ca_certs": certs["ca"]})
    with pytest.raises(MetaserverError):
        anonymous.post(srv.url, {"request_id": "r3"})
    assert len(srv.posts) == 1
    with pytest.raises(ssl.SSLError):  # a wrong password is a clear error at start
        build_ssl_context(TLSConfig(ssl_enable=True, ssl_ca_certs=certs["ca"],
                                    ssl_certfile=certs["client_cert"],
                                    ssl_keyfile=certs["client_key"],
                                    ssl_keyfile_password="wrong"))
    good.close()
    anonymous.close()


def test_tls_off_means_no_context() -> None:
    assert build_ssl_context(TLSConfig()) is None


@pytest.mark.parametrize(("statuses", "retries", "posts", "ok"), [
    ([503, 503], 2, 3, True),     # two failures, then success on the third attempt
    ([503, 503], 1, 2, False),    # out of retries
    ([404], 3, 1, False),         # the proxy does not know the request: no retry
    ([500, 200], 1, 2, True),
])
def test_retries(servers: list[Server], statuses: list[int], retries: int, posts: int,
                 ok: bool) -> None:
    srv = Server(statuses=statuses)
    servers.append(srv)
    c = client(retries=retries)
    if ok:
        c.post(srv.url, {"request_id": "r"})
    else:
        with pytest.raises(MetaserverError, match=rf"{posts} attempt\(s\): HTTP"):
            c.post(srv.url, {"request_id": "r"})
    assert len(srv.posts) == posts
    c.close()


def test_unreachable_metaserver_fails_after_retries_in_bounded_time() -> None:
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    c = client(retries=2)
    start = time.monotonic()
    with pytest.raises(MetaserverError, match="3 attempt"):
        c.post(f"http://127.0.0.1:{free_port()}/v1/metaserver", {"request_id": "r"})
    assert time.monotonic() - start < 5
    failures: list[str] = []
    done = threading.Event()
    c.submit(f"http://127.0.0.1:{free_port()}/v1/metaserver", {},
             lambda reason: (failures.append(reason), done.set()))
    assert done.wait(10) and "ConnectError" in failures[0]
    c.close()


def test_metaserver_retry_sets_the_tries_and_the_deadline(servers: list[Server]) -> None:
    """``metaserver_retry``: its attempts bound the POSTs; with a deadline and no count the
    retries stop once the deadline passed."""
    srv = Server(statuses=[503] * 10)
    servers.append(srv)
    cfg = MooncakeLayerwiseConfig.from_dict({"metaserver_retry": {"attempts": 2}})
    c = MetaserverClient(cfg.tls_config, timeout_s=3, retry=cfg.metaserver_policy)
    with pytest.raises(MetaserverError, match=r"2 attempt\(s\): HTTP 503"):
        c.post(srv.url, {"request_id": "r"})
    assert len(srv.posts) == 2
    c.close()
    cfg = MooncakeLayerwiseConfig.from_dict({"metaserver_retry": {
        "attempts": None, "deadline_s": 0.3, "delay_s": 0.1, "backoff": 1.0}})
    c = MetaserverClient(cfg.tls_config, timeout_s=3, retry=cfg.metaserver_policy)
    start = time.monotonic()
    with pytest.raises(MetaserverError, match="HTTP 503"):
        c.post(srv.url, {"request_id": "s"})
    assert time.monotonic() - start < 2.0
    assert 2 <= len(srv.posts) - 2 <= 5  # tries 0.1 s apart for 0.3 s
    c.close()
