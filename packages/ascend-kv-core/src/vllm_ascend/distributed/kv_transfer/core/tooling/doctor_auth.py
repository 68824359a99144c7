# SPDX-License-Identifier: Apache-2.0
"""``doctor``'s security checks: the deployment key and where Mooncake listens.

Warns when no deployment key is configured (the control plane is then
unauthenticated, see ``docs/security.md``), fails on a key that does not load,
and warns when the transfer engine is not bound to a chosen interface
(``MC_TCP_BIND_ADDRESS`` unset or a wildcard): Mooncake's data plane
authenticates no one, so its ports belong on a private interface.
"""

from __future__ import annotations

import os
from typing import Any

from .. import auth
from ..errors import ConfigError

WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")


def check(doctor: Any, env: dict[str, str] | None = None) -> None:
    """Report through ``doctor.ok`` / ``warn`` / ``fail``."""
    env = dict(os.environ) if env is None else env
    try:
        keys = auth.load_keys(env)
        window = auth.load_window(env)
    except ConfigError as exc:
        doctor.fail("control-plane key", str(exc), "see docs/security.md")
    else:
        if keys:
            doctor.ok("control-plane key", f"{len(keys)} active key(s), {window:g} s window")
        else:
            doctor.warn("control-plane key",
                        "none configured: the control plane is UNAUTHENTICATED (anyone who "
                        "reaches a side channel gets the KV memory map and can hold or free "
                        "blocks)",
                        f"set {auth.ENV_KEY_FILE} to a 0600 file holding a shared key "
                        "(`openssl rand -hex 32`) on every instance, the proxy and doctor; "
                        "see docs/security.md")
    bind = env.get("MC_TCP_BIND_ADDRESS", "").strip()
    if bind in WILDCARDS:
        doctor.warn("Mooncake bind address",
                    f"MC_TCP_BIND_ADDRESS is {bind or 'unset'}: the transfer engine's ports "
                    "(unauthenticated: anyone who reaches them can read or write registered "
                    "KV memory) may listen on every interface",
                    "set MC_TCP_BIND_ADDRESS and MOONCAKE_REQUESTER_LOCAL_HOSTNAME to an "
                    "address on a private interface, firewall the rest, see docs/security.md")
    else:
        doctor.ok("Mooncake bind address", bind)
