# SPDX-License-Identifier: Apache-2.0
"""P's leases kept alive by the proxy while D has a request (pull mode).

D's scheduler renews only the requests it has looked at, and a request queued
behind a full batch on D is not looked at, so P's lease on its blocks could lapse
before D reads them. The proxy waits on D for that request anyway: it renews the
lease over P's side channel (:class:`~..renewer.LeaseRenewer`) until D answers,
or until the proxy's own timeout.
"""

from __future__ import annotations

import time
from typing import Any

from ..params import RemotePrefill
from ..rank_hosts import parse_rank_hosts
from ..renewer import LeaseRenewer
from .model import ProxyConfig


class DecodeLeases:
    """The proxy's lease renewals, one per request D has (none with renewal off or in
    layerwise mode).

    Args:
        cfg: the proxy's config (``mode``, ``lease_renew_interval_s``, ``timeout_s``).
    """

    def __init__(self, cfg: ProxyConfig) -> None:
        self.timeout_s = cfg.timeout_s
        self.renewer: LeaseRenewer | None = None
        self._renewing: dict[str, float] = {}  # proxy request id -> renew until
        if cfg.mode == "pull" and cfg.lease_renew_interval_s > 0:
            self.renewer = LeaseRenewer(cfg.lease_renew_interval_s,
                                        timeout_s=min(2.0, cfg.lease_renew_interval_s))

    def renew_while_decoding(self, request_id: str, kv_params: dict[str, Any]) -> None:
        """Renew P's lease on the request's blocks until :meth:`stop_renewing`. Params
        that do not name P's side channel are left to D."""
        if self.renewer is None:
            return
        try:
            tp = kv_params.get("remote_tp_size", kv_params.get("remote_ptp_size", 1))
            remote = RemotePrefill(
                engine_id=str(kv_params.get("remote_engine_id", "")),
                host=str(kv_params["remote_host"]), port=int(kv_params["remote_port"]),
                request_id=str(kv_params["remote_request_id"]), block_ids=[],
                tp_size=int(tp or 1), pcp_size=1, dcp_size=1,
                rank_hosts=parse_rank_hosts(kv_params, tp_size=int(tp or 1)))
        except (KeyError, TypeError, ValueError):  # KVParamsError is a ValueError
            return
        if not (0 < remote.port < 65536 and 0 < remote.tp_size <= 1024 and remote.host):
            return
        self._renewing[request_id] = time.monotonic() + self.timeout_s
        self.renewer.track(request_id, remote)

    def stop_renewing(self, request_id: str) -> None:
        if self.renewer is not None and self._renewing.pop(request_id, None) is not None:
            self.renewer.untrack(request_id)

    def expire(self) -> None:
        """Stop renewing requests older than the proxy's own timeout (a stream whose
        client went away before it started)."""
        now = time.monotonic()
        for rid in [r for r, until in self._renewing.items() if until < now]:
            self.stop_renewing(rid)

    @property
    def renewing(self) -> list[str]:
        """Proxy request ids renewed now."""
        return list(self._renewing)

    def stop(self) -> None:
        if self.renewer is not None:
            self.renewer.stop()
