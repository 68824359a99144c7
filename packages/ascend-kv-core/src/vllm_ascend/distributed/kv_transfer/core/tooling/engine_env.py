# SPDX-License-Identifier: Apache-2.0
"""Environment of every vLLM CPU engine a tool or a test starts: loopback only, a small KV
cache, the engine core in-process, nothing sent out.

This module imports nothing, so ``noxfile.py`` loads it by path (nox runs without the
packages installed).
"""

ENGINE_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ASCEND_KV_HOST": "127.0.0.1",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
