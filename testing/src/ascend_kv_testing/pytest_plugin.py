# SPDX-License-Identifier: Apache-2.0
"""Shared pytest fixtures (a plugin of the ascend-kv-testing package)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis without per-example deadlines: the 2-core CI machine is shared and slow."""
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:
        return
    settings.register_profile("vllm-ascend-kv", deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("vllm-ascend-kv")


@pytest.fixture
def fake_torch_npu() -> Iterator[Any]:
    """The fake ``torch_npu`` module, installed for the test and removed afterwards."""
    from . import fake_torch_npu as fake

    mod = fake.install()
    try:
        yield mod
    finally:
        fake.uninstall()


@pytest.fixture
def fake_memcache() -> Iterator[Any]:
    """The fake ``memcache_hybrid`` (real signatures, in-memory data path), installed for the
    test and removed afterwards; yields the fake module's helper namespace."""
    from . import fake_memcache as fake

    fake.install()
    try:
        yield fake
    finally:
        fake.uninstall()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real ``mooncake_master`` on 127.0.0.1 for the whole test session."""
    from .mooncake import MooncakeMaster

    master = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a tiny random-weight float32 Llama (2 layers, block-size friendly)."""
    from .models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
