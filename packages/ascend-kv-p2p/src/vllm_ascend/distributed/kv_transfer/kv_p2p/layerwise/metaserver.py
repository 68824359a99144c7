# SPDX-License-Identifier: Apache-2.0
"""D's posts to the proxy's metaserver (the layerwise connector's scheduler side).

Once vLLM allocated a request's blocks, D's scheduler POSTs their ids and its
address to the ``metaserver`` URL of the request's params, so that the proxy can
hand them to P. The posts run on a small thread pool, with optional TLS
(``tls_config``) and retries; one that fails for good is reported back, and the
request fails at once instead of at its deadline.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.retry import RetryPolicy
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import TLSConfig

if TYPE_CHECKING:
    import httpx

__all__ = ["MetaserverClient", "MetaserverError", "build_ssl_context"]

logger = logging.getLogger(__name__)


def build_ssl_context(tls: TLSConfig) -> ssl.SSLContext | None:
    """The client TLS context of ``tls_config`` (``None`` when TLS is off)."""
    if not tls.ssl_enable:
        return None
    ctx = ssl.create_default_context(cafile=tls.ssl_ca_certs)
    if tls.ssl_certfile:
        ctx.load_cert_chain(tls.ssl_certfile, tls.ssl_keyfile, tls.ssl_keyfile_password)
    return ctx


class MetaserverError(RuntimeError):
    """A metaserver POST failed after every retry; the message names URL and cause."""


class MetaserverClient:
    """POSTs D's block ids to the proxy's metaserver on a small thread pool.

    Args:
        tls: ``tls_config`` of the connector.
        timeout_s: timeout of one POST.
        retry: how a failed POST is tried again (connection errors and 5xx answers; a 4xx
            answer is final): ``metaserver_retry``.
        workers: threads posting concurrently.
    """

    def __init__(self, tls: TLSConfig, *, timeout_s: float, retry: RetryPolicy,
                 workers: int = 4) -> None:
        self.tls = tls
        self.timeout_s = timeout_s
        self.retry = retry
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="metaserver")
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self.posts = 0

    def _http(self) -> httpx.Client:
        import httpx

        with self._lock:
            if self._client is None:
                ctx = build_ssl_context(self.tls)
                self._client = httpx.Client(timeout=self.timeout_s,
                                            verify=ctx if ctx is not None else True)
            return self._client

    def _headers(self) -> dict[str, str]:
        """The bearer token of the deployment key, when one is configured."""
        authn = auth.from_env()
        if authn is None:
            return {}
        return {"Authorization": f"Bearer {authn.bearer_token(auth.PURPOSE_METASERVER)}"}

    def post(self, url: str, payload: dict[str, Any]) -> None:
        """POST ``payload`` to ``url``, retrying; raises :class:`MetaserverError` at the end."""
        import httpx

        started = time.monotonic()
        attempt = 0
        while True:
            try:
                resp = self._http().post(url, json=payload, headers=self._headers())
            except (httpx.HTTPError, ssl.SSLError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                with self._lock:
                    self.posts += 1
                if resp.status_code < 300:
                    return
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code < 500:
                    break  # the proxy refused this request: retrying cannot help
            delay = self.retry.next_delay(attempt, started=started)
            if delay is None:
                break
            time.sleep(delay)
            attempt += 1
        raise MetaserverError(f"POST {url} failed after {attempt + 1} attempt(s): {last}")

    def submit(self, url: str, payload: dict[str, Any],
               on_failure: Any) -> None:
        """Post in the background; ``on_failure(reason)`` is called if it fails for good."""
        def run() -> None:
            try:
                self.post(url, payload)
            except MetaserverError as exc:
                on_failure(str(exc))
            except Exception as exc:  # never lose a failure: the request would wait forever
                logger.exception("metaserver post to %s failed unexpectedly", url)
                on_failure(f"{type(exc).__name__}: {exc}")

        self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
