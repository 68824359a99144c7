# SPDX-License-Identifier: Apache-2.0
"""Signed ``kv_transfer_params``: D dials only what a key holder issued, or an allowed host.

``kv_transfer_params`` travel through the client API: whoever sends D a completion writes
them. D dials the host they name (P's side channel, the layerwise metaserver), so params
written by anyone would make D a confused deputy: it would send its signed ``Claim`` or
its metaserver post to a host of the sender's choosing.

* **With a deployment key** (:mod:`~vllm_ascend.distributed.kv_transfer.core.auth`), the
  one who issues params MACs them (:func:`sign`): P the params it returns for D (pull), the
  layerwise proxy what it posts to D, and a layerwise D what it posts to the metaserver
  (P's params: P dials D from them, and checks them as D does). The MAC (``kv_params_mac``) is an HMAC-SHA256, under a
  key derived from the deployment key for :data:`PURPOSE`, over the canonical serialization
  (sorted-key JSON, :func:`canonical`) of **every** key of the params but the MAC itself
  (and the statistics vLLM adds on the way, :data:`VLLM_ADDED_KEYS`):
  the engine id, host, port, request id, block ids (also keys added later, e.g. per-group
  block ids), the capability token and the expiry (``kv_params_expires``, wall time). D
  checks it (:func:`verify`) before it dials anything: params without a MAC, with a MAC
  that matches no active key, or past their expiry are refused, the request's load fails
  as any invalid params do (nothing dialed, nothing held), and the refusal is counted in
  ``vllm:ascend_kv_auth_refused_total{socket="kv-params",reason}``.
* **With or without a key**, when the connector's ``allowed_peer_hosts`` is set, D dials
  only hosts it names (addresses, networks in CIDR notation, host names): every host the
  params name (``remote_host``, each rank's host, the metaserver URL's) must be allowed, or
  the params are refused (``not_allowed``). A layerwise D whose config names
  ``metaserver_urls`` posts only to those (a params URL not among them is refused, as
  ``not_allowed``): its bearer token goes only where its own config says.

The canonical form is Python's ``json.dumps(..., sort_keys=True, separators=(",", ":"))``:
a float is written as its shortest repr, which JSON decoders on the way (the proxy, vLLM's
API server) give back unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from vllm_ascend.distributed.kv_transfer.core import auth

from .errors import KVParamsError
from .rank_hosts import MULTI_NODES_KEY

__all__ = ["EXPIRES_KEY", "FROM_ENV", "MAC_KEY", "PURPOSE", "SOCKET", "VLLM_ADDED_KEYS",
           "ParamsRefused", "canonical", "host_allowed", "hosts_named", "purpose_keys",
           "resolve", "sign", "verify"]

#: The params key of the MAC.
MAC_KEY = "kv_params_mac"
#: Keys vLLM itself adds to the params after the connector returned them, which the MAC
#: therefore cannot cover: P's prefix-cache hit count (``Scheduler`` adds it when the request
#: finishes; D only reports it in its usage statistics, it moves no KV and names no host).
VLLM_ADDED_KEYS = frozenset({"remote_prefill_cached_tokens"})
#: The params key of the expiry (``time.time()`` of the issuer).
EXPIRES_KEY = "kv_params_expires"
#: What the MAC's key is derived for (from each active deployment key).
PURPOSE = "p2p-transfer-params"
#: The ``socket`` label of refusals in ``auth_refused``.
SOCKET = "kv-params"
#: How far the issuer's clock may be behind D's before params look expired.
CLOCK_SKEW_S = 5.0
#: How long D may use the params the layerwise proxy posts it (it checks them when vLLM has
#: allocated the request's blocks, after any wait in its queue).
PROXY_TTL_S = 600.0
#: Refusal reasons.
REASONS = ("unsigned", "bad_mac", "expired", "not_allowed")


class ParamsRefused(KVParamsError):
    """``kv_transfer_params`` refused by the signature or the host allowlist.

    Attributes:
        reason: one of :data:`REASONS`.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


#: The canonical form's encoder (``json.dumps`` with these options builds one a call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                              allow_nan=False)


def canonical(params: Mapping[str, Any]) -> bytes:
    """The bytes the MAC covers: every key but :data:`MAC_KEY` and :data:`VLLM_ADDED_KEYS`,
    as sorted-key JSON.

    Raises:
        ParamsRefused: a value JSON cannot hold (NaN, a non-string key, an object).
    """
    try:
        text = _CANONICAL.encode({k: v for k, v in params.items()
                                  if k != MAC_KEY and k not in VLLM_ADDED_KEYS})
    except (TypeError, ValueError) as exc:
        raise ParamsRefused(f"kv_transfer_params cannot be serialized canonically: {exc}",
                            reason="bad_mac") from exc
    return text.encode()


def _mac(key: bytes, params: Mapping[str, Any]) -> str:
    mac = _keyed(key).copy()
    mac.update(canonical(params))
    return mac.hexdigest()


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


#: Default of the ``authn`` arguments: the process's deployment key, if any.
FROM_ENV: Any = _FromEnv()


def resolve(authn: auth.Authenticator | None) -> auth.Authenticator | None:
    """``authn`` itself, or for :data:`FROM_ENV` the process's authenticator (``None``
    without a key): a caller that MACs or checks many params resolves it once."""
    return auth.from_env() if isinstance(authn, _FromEnv) else authn


@functools.lru_cache(maxsize=32)
def purpose_keys(authn: auth.Authenticator, purpose: str) -> tuple[bytes, ...]:
    """``authn``'s keys of ``purpose`` (:meth:`.auth.Authenticator.purpose_keys`), derived
    once per authenticator, not per params (its keys never change: a new key is a new
    authenticator)."""
    return authn.purpose_keys(purpose)


@functools.lru_cache(maxsize=16)
def _keyed(key: bytes) -> hmac.HMAC:
    """An HMAC-SHA256 under ``key`` with nothing fed yet (each MAC copies it)."""
    return hmac.new(key, digestmod=hashlib.sha256)


def sign(params: dict[str, Any], *, ttl_s: float,
         authn: auth.Authenticator | None = FROM_ENV) -> dict[str, Any]:
    """MAC ``params`` in place (and return them) when a deployment key is configured.

    Adds :data:`EXPIRES_KEY` (now plus ``ttl_s``) and :data:`MAC_KEY`; without a key the
    params are returned unchanged (the bytes of before).

    Args:
        params: the params the issuer returns or posts; nothing may change them after.
        ttl_s: how long D may use them (P: its ``max_hold_s``, it holds the blocks no
            longer).
        authn: the authenticator (default: the process's, :func:`.auth.from_env`).
    """
    a = resolve(authn)
    if a is None:
        return params
    params.pop(MAC_KEY, None)
    params[EXPIRES_KEY] = round(time.time() + ttl_s, 3)
    params[MAC_KEY] = _mac(purpose_keys(a, PURPOSE)[0], params)
    return params


def hosts_named(params: Mapping[str, Any]) -> list[str]:
    """Every host ``params`` would make D dial: ``remote_host``, each rank's host
    (``remote_multi_nodes_meta_mapping``) and the ``metaserver`` URL's host."""
    hosts: list[str] = []
    host = params.get("remote_host")
    if isinstance(host, str) and host:
        hosts.append(host)
    mapping = params.get(MULTI_NODES_KEY)
    if isinstance(mapping, Mapping):
        for entry in mapping.values():
            h = entry.get("host") if isinstance(entry, Mapping) else None
            if isinstance(h, str) and h:
                hosts.append(h)
    url = params.get("metaserver")
    if isinstance(url, str) and url:
        try:
            name = urlsplit(url).hostname
        except ValueError:
            name = None
        hosts.append(name or url)
    return hosts


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether ``host`` is one of ``allowed``: an equal address, an address inside a
    network (``10.20.0.0/24``), or an equal host name (case-insensitive)."""
    name = host.strip("[]").lower()
    try:
        addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(name)
    except ValueError:
        addr = None
    for entry in allowed:
        item = entry.strip().strip("[]").lower()
        if not item:
            continue
        if addr is not None and ("/" in item or _is_address(item)):
            try:
                if addr in ipaddress.ip_network(item, strict=False):
                    return True
            except ValueError:
                continue
        elif item == name:
            return True
    return False


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _refuse(message: str, reason: str) -> ParamsRefused:
    auth.count_refusal(SOCKET, reason)
    return ParamsRefused(f"kv_transfer_params refused ({reason}): {message}", reason=reason)


def verify(params: Any, *, allowed_hosts: Iterable[str] | None = None,
           metaserver_urls: Iterable[str] | None = None,
           authn: auth.Authenticator | None = FROM_ENV, now: float | None = None) -> None:
    """Refuse ``params`` D must not dial from (before it dials anything).

    With a deployment key the MAC must match an active key and the expiry be ahead
    (less :data:`CLOCK_SKEW_S`); with ``allowed_hosts`` (any mode) every host the params
    name must be allowed; with ``metaserver_urls`` (layerwise D's own config), the params'
    ``metaserver`` must be one of them. A refusal is counted (``auth_refused{socket="kv-params"}``).

    Raises:
        ParamsRefused: why (``reason``), naming the way out; a :class:`KVParamsError`, so
            the request fails as malformed params do.
    """
    if not isinstance(params, Mapping):
        return  # not params at all: the parser says what is wrong with them
    a = resolve(authn)
    if a is not None:
        mac = params.get(MAC_KEY)
        if not isinstance(mac, str) or not mac:
            raise _refuse(f"they carry no {MAC_KEY!r}, and this instance has a deployment "
                          "key: params are used only as a P (or the layerwise proxy) of this "
                          "deployment issued them, MACed with the key", "unsigned")
        if not any(hmac.compare_digest(_mac(k, params), mac) for k in purpose_keys(a, PURPOSE)):
            raise _refuse("their MAC matches none of the deployment keys: they were changed "
                          "on the way (another request's params, a forged host) or issued "
                          "by an instance with another key", "bad_mac")
        expires = params.get(EXPIRES_KEY)
        clock = time.time() if now is None else now
        if (isinstance(expires, bool) or not isinstance(expires, (int, float))
                or expires + CLOCK_SKEW_S < clock):
            raise _refuse(f"they expired ({EXPIRES_KEY}={expires!r}, now {clock:.3f})",
                          "expired")
    allowed = [h for h in (allowed_hosts or ()) if h]
    if allowed:
        for host in hosts_named(params):
            if not host_allowed(host, allowed):
                raise _refuse(f"host {host!r} is not in allowed_peer_hosts {allowed}: add it "
                              "to the connector's allowed_peer_hosts if it is an instance of "
                              "this deployment", "not_allowed")
    urls = [u.rstrip("/") for u in (metaserver_urls or ()) if u]
    url = params.get("metaserver")
    if urls and isinstance(url, str) and url.rstrip("/") not in urls:
        raise _refuse(f"metaserver {url!r} is not one of metaserver_urls {urls}: D posts "
                      "(with the metaserver's bearer token) only to the metaservers its "
                      "config names", "not_allowed")
