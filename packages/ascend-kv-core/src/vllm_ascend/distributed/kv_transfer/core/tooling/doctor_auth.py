# SPDX-License-Identifier: Apache-2.0
"""``doctor``'s security checks: the control plane's mode and where Mooncake listens.

Says in one line which mode the control plane runs in (``core.auth.mode``): keyed (a
deployment key), protected (no key: every server answers peers on its own host only; a
warning when the instance advertises a non-loopback address, whose peers elsewhere would
be refused) or open by opt-out (``VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED=1``: a warning).
Fails on a key or an opt-out value that does not load. Warns when the transfer engine is
not bound to a chosen interface (``MC_TCP_BIND_ADDRESS`` unset or a wildcard): Mooncake's
data plane authenticates no one, so its ports belong on a private interface. See
``docs/security.md``.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from .. import auth
from ..errors import ConfigError
from ..net import HOST_ENV_VARS, get_host_ip

WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")
#: The name of the mode line.
MODE = "control-plane mode"
SET_KEY = (f"set {auth.ENV_KEY_FILE} to a 0600 file holding a shared key "
           "(`openssl rand -hex 32`) on every instance, the proxy and doctor")


def advertised_host(env: dict[str, str]) -> str:
    """The address the instance binds and advertises (as ``core.net.get_host_ip``)."""
    for var in HOST_ENV_VARS:
        if env.get(var, "").strip():
            return env[var].strip()
    return get_host_ip()


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def check_mode(doctor: Any, env: dict[str, str]) -> None:
    """The control plane's mode, one line (ok, or warn where peers may be refused or
    anyone may be served; fail where the key or the opt-out does not load)."""
    try:
        keys = auth.load_keys(env)
        window = auth.load_window(env)
        mode = auth.mode(env)
    except ConfigError as exc:
        doctor.fail(MODE, str(exc), "see docs/security.md")
        return
    if mode == auth.MODE_KEYED:
        doctor.ok(MODE, f"keyed: {len(keys)} active key(s), {window:g} s window; every "
                  "control-plane frame authenticated, peers on any host that hold the key "
                  "are served")
    elif mode == auth.MODE_OPEN:
        doctor.warn(MODE, f"open by opt-out ({auth.ENV_ALLOW_UNAUTHENTICATED}=1): no key, "
                    "the control plane is UNAUTHENTICATED and serves every host (anyone "
                    "who reaches a side channel gets the KV memory map and can hold or free "
                    "blocks)", f"{SET_KEY}, and unset {auth.ENV_ALLOW_UNAUTHENTICATED}; see "
                    "docs/security.md")
    else:
        host = advertised_host(env)
        detail = ("protected (same-host only): no deployment key; side channels, lookup and "
                  "metadata servers and the proxy's metaserver, /status and /metrics serve "
                  "only peers on this host")
        if _loopback(host):
            doctor.ok(MODE, detail)
        else:
            doctor.warn(MODE, f"{detail}: a P, D or proxy on another host reaching {host} is "
                        "refused (protected_mode)",
                        f"for a deployment across hosts {SET_KEY} (or, on a network only the "
                        f"deployment reaches, {auth.ENV_ALLOW_UNAUTHENTICATED}=1); nothing to "
                        "do when every instance and the proxy run on this host; see "
                        "docs/security.md")


def check(doctor: Any, env: dict[str, str] | None = None) -> None:
    """Report through ``doctor.ok`` / ``warn`` / ``fail``."""
    env = dict(os.environ) if env is None else env
    check_mode(doctor, env)
    bind = env.get("MC_TCP_BIND_ADDRESS", "").strip()
    if bind in WILDCARDS:
        doctor.warn("Mooncake bind address",
                    f"MC_TCP_BIND_ADDRESS is {bind or 'unset'}: the transfer engine's ports "
                    "(unauthenticated: anyone who reaches them can read or write registered "
                    "KV memory) may listen on every interface",
                    "set MC_TCP_BIND_ADDRESS and MOONCAKE_REQUESTER_LOCAL_HOSTNAME to an "
                    "address on a private interface, firewall the rest, see docs/security.md")
    else:
        doctor.ok("Mooncake bind address",
                  f"{bind} (the address Mooncake advertises; its ports still listen on every "
                  "interface: the listener probe says where they answer)")
