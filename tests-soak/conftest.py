# SPDX-License-Identifier: Apache-2.0
"""Soak tests: long runs on real engines (``nox -s soak``; not in the default sessions)."""

from __future__ import annotations

import os

for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_HOST_IP": "127.0.0.1", "VLLM_ASCEND_KV_HOST": "127.0.0.1",
               "MC_TCP_BIND_ADDRESS": "127.0.0.1",
               "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}.items():
    os.environ.setdefault(_k, _v)
