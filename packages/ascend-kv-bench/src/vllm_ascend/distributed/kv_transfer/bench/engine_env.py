# SPDX-License-Identifier: Apache-2.0
"""Environment of every vLLM CPU engine a tool or a test starts.

Loopback only, a small KV cache, the engine core in-process, nothing sent out.

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

#: glibc's malloc in ``bench serve``'s engines: freed memory stays in the process (no
#: ``mmap`` of its own for a large block, no trimming of the heap), so an engine that served
#: a request once serves the next ones from memory it has touched. With glibc's defaults a
#: large tensor's memory goes back to the kernel when freed and is faulted in again by the
#: next request; on a virtual machine whose kernel reports free memory to its host
#: (Firecracker with ``page_reporting``, as here), memory another process freed and the
#: kernel reported took seconds per GB to fault in, and an engine idle while a new one
#: started served its next requests up to 3x slower (measured, 2026-12-04). The same for
#: every engine of a run, the baseline too; a variable already in the environment wins.
STEADY_MALLOC_ENV: dict[str, str] = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}
