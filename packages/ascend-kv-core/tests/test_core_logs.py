# SPDX-License-Identifier: Apache-2.0
"""Our loggers write through vLLM's handlers in a vLLM process (core.logs)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from vllm_ascend.distributed.kv_transfer.core.logs import (
    NAMESPACE,
    ToVllmHandler,
    follow_vllm_logging,
)


class Keep(logging.Handler):
    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def clean() -> Iterator[logging.Logger]:
    """Our namespace logger without handlers or level, vLLM's logger without handlers;
    both restored afterwards."""
    ours, vllm = logging.getLogger(NAMESPACE), logging.getLogger("vllm")
    saved = (ours.handlers[:], ours.level, vllm.handlers[:])
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    vllm.handlers.clear()
    yield ours
    ours.handlers[:], vllm.handlers[:] = saved[0], saved[2]
    ours.setLevel(saved[1])


def test_records_reach_vllms_handlers_at_vllms_level(clean: logging.Logger) -> None:
    assert follow_vllm_logging({"VLLM_LOGGING_LEVEL": "INFO"})
    assert not follow_vllm_logging({})  # once
    keep = Keep(logging.INFO)
    logging.getLogger("vllm").addHandler(keep)  # vLLM configures after the plugin ran
    log = logging.getLogger(NAMESPACE + ".kv_transfer.kv_p2p.pull.reader")
    log.info("handshake ok")
    log.debug("not shown")
    assert [r.getMessage() for r in keep.records] == ["handshake ok"]
    assert clean.level == logging.INFO


def test_debug_level_from_vllms_environment(clean: logging.Logger) -> None:
    assert follow_vllm_logging({"VLLM_LOGGING_LEVEL": "debug"})
    keep = Keep()
    logging.getLogger("vllm").addHandler(keep)
    logging.getLogger(NAMESPACE + ".x").debug("detail")
    assert [r.getMessage() for r in keep.records] == ["detail"]


def test_left_alone_when_configured_or_vllm_logging_is_off(clean: logging.Logger) -> None:
    assert not follow_vllm_logging({"VLLM_CONFIGURE_LOGGING": "0"})
    assert clean.handlers == [] and clean.level == logging.NOTSET
    clean.setLevel(logging.WARNING)  # an application chose a level for us
    assert not follow_vllm_logging({})
    assert clean.handlers == []


def test_warnings_still_printed_when_nobody_handles_them(clean: logging.Logger,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    stream = io.StringIO()
    monkeypatch.setattr(logging, "lastResort", logging.StreamHandler(stream))
    logging.lastResort.setLevel(logging.WARNING)
    handler = ToVllmHandler()
    handler.handle(logging.LogRecord(NAMESPACE, logging.WARNING, __file__, 1, "lease lapsed",
                                     None, None))
    handler.handle(logging.LogRecord(NAMESPACE, logging.INFO, __file__, 1, "quiet", None, None))
    assert stream.getvalue() == "lease lapsed\n"
