# SPDX-License-Identifier: Apache-2.0
"""The deployment key of the process under test (``core.auth``), set through pytest's
``monkeypatch`` so that it is undone after the test."""

from __future__ import annotations

import pytest


def set_deployment_key(monkeypatch: pytest.MonkeyPatch, key: str | None) -> None:
    """Make ``key`` the environment's deployment key (``None``: no key), with no key file,
    and drop the process's cached authenticator so the next socket reads it."""
    from vllm_ascend.distributed.kv_transfer.core import auth

    if key is None:
        monkeypatch.delenv(auth.ENV_KEY, raising=False)
    else:
        monkeypatch.setenv(auth.ENV_KEY, key)
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    monkeypatch.setattr(auth, "_cached", None)
