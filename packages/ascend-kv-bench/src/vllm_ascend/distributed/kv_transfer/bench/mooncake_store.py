# SPDX-License-Identifier: Apache-2.0
"""A real ``mooncake_master`` (and optional ``mooncake_client`` segment holder) on loopback.

The one launcher of the project: the benchmarks, the test fixtures
(``ascend_kv_testing.mooncake``, whose sessions install ascend-kv-bench for it) and the
fault tests all start their Store through it. Every port is given explicitly: the master's defaults (8080, 9003,
50051) collide easily, and some of its sockets bind all interfaces.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.config import parse_size
from vllm_ascend.distributed.kv_transfer.core.net import free_port

from .procs import spawn, stop, wait_port

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
INSTALL_HINT = "pip install 'ascend-kv-core[cpu]' (mooncake-transfer-engine-non-cuda)"


#: :meth:`LoopbackMooncakeStore.touch_segment`'s child: argv host, metadata server, master,
#: segment bytes; puts 16 MiB objects until the segment is written (or a put is refused),
#: removes them, prints ``{"bytes", "seconds", "left"}`` (objects still there) as JSON.
_TOUCH_SCRIPT = """
import json, sys, time
import numpy as np
from mooncake.store import MooncakeDistributedStore
host, metadata, master, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
store = MooncakeDistributedStore()
rc = store.setup(host, metadata, 0, 64 << 20, "tcp", "", master)
if rc != 0:
    sys.exit(f"setup failed: {rc}")
piece = 16 << 20
buf = np.ones(piece, dtype=np.uint8)
if store.register_buffer(buf.ctypes.data, piece) != 0:
    sys.exit("register_buffer failed")
t, written = time.perf_counter(), 0
for i in range(total // piece):
    if store.put_from(f"vakv-touch-{i}", buf.ctypes.data, piece) != 0:
        break
    written += piece
store.remove_all(True)
keys = [f"vakv-touch-{i}" for i in range(written // piece)]
left = sum(1 for r in (store.batch_is_exist(keys) if keys else []) if r == 1)
print(json.dumps({"bytes": written, "seconds": time.perf_counter() - t, "left": left}))
store.close()
"""


def find_binary(name: str) -> str | None:
    """``name`` beside this interpreter (a virtual environment's ``bin``), else on ``PATH``."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _binary(name: str) -> str:
    found = find_binary(name)
    if not found:
        raise FileNotFoundError(f"{name} not found; {INSTALL_HINT}")
    return found


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` with its HTTP metadata server, every port on 127.0.0.1."""

    workdir: Path
    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service."""
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """URL of the master's HTTP metadata server."""
        return f"http://{HOST}:{self.http_port}/metadata"

    @property
    def log(self) -> Path:
        """The master's output."""
        return self.workdir / f"master-{self.rpc_port}.log"

    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        """Start the master; returns once both its RPC and HTTP ports answer.

        Raises:
            FileNotFoundError: ``mooncake_master`` is not installed.
            RuntimeError: the master exited (its log is named).
            TimeoutError: it did not listen within ``timeout``.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [_binary("mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}",
               "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
               f"--http_metadata_server_port={self.http_port}", f"--metrics_host={HOST}",
               f"--metrics_port={self.metrics_port}"]
        self.proc = spawn(cmd, log=self.log)
        try:
            wait_port(HOST, self.rpc_port, timeout, proc=self.proc)
            wait_port(HOST, self.http_port, timeout, proc=self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"mooncake_master did not start ({exc}; log: {self.log})") \
                from exc
        return self

    def stop(self) -> None:
        """SIGTERM the master (SIGKILL when it does not stop)."""
        stop(self.proc)

    def kill(self) -> None:
        """SIGKILL the master at once (fault tests)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def config(self, **overrides: object) -> dict[str, Any]:
        """A Mooncake Store client config (the ``MOONCAKE_CONFIG_PATH`` JSON) for this master."""
        cfg: dict[str, Any] = {
            "metadata_server": self.metadata_server,
            "master_server_address": self.master_address,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": "64MB",
            "local_buffer_size": "64MB",
        }
        cfg.update(overrides)
        return cfg

    def write_config(self, path: Path, **overrides: object) -> Path:
        """Write :meth:`config` as JSON to ``path``; returns ``path``."""
        path.write_text(json.dumps(self.config(**overrides)))
        return path


@dataclass
class MooncakeSegmentHolder:
    """A ``mooncake_client`` process that mounts a segment and outlives the engines."""

    master: MooncakeMaster
    segment_size: str = "256MB"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> MooncakeSegmentHolder:
        """Start the holder; returns once it listens.

        Raises:
            FileNotFoundError: ``mooncake_client`` is not installed.
            RuntimeError: it did not start (its log is named).
        """
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=HOST)
        cmd = [_binary("mooncake_client"), f"--host={HOST}", f"--port={self.port}",
               f"--global_segment_size={self.segment_size}", "--local_buffer_size=16MB",
               f"--master_server_address={self.master.master_address}",
               f"--metadata_server={self.master.metadata_server}", "--protocol=tcp"]
        log = self.master.workdir / f"client-{self.port}.log"
        self.proc = spawn(cmd, log=log, env=env)
        try:
            wait_port(HOST, self.port, timeout, proc=self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"mooncake_client did not start ({exc}; log: {log})") from exc
        return self

    def stop(self) -> None:
        """SIGTERM the holder (SIGKILL when it does not stop)."""
        stop(self.proc)


class LoopbackMooncakeStore:
    """A :class:`MooncakeMaster` and, optionally, a :class:`MooncakeSegmentHolder` that
    holds the pool's memory, so the pool outlives the engines that fill it. For
    benchmarks; stop it with :meth:`stop` (or ``with``).

    Args:
        segment_size: bytes of the holder's segment (e.g. ``"1GB"``); empty for no holder.
        workdir: where the logs go (a temporary directory by default).
    """

    def __init__(self, segment_size: str = "1GB", workdir: str | os.PathLike[str] | None = None
                 ) -> None:
        self.segment_size = segment_size
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="bench-mooncake-"))
        self.master = MooncakeMaster(self.workdir)
        self.holder: MooncakeSegmentHolder | None = None

    @property
    def rpc_port(self) -> int:
        """The master's RPC port."""
        return self.master.rpc_port

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service."""
        return self.master.master_address

    @property
    def metadata_server(self) -> str:
        """URL of the master's HTTP metadata server."""
        return self.master.metadata_server

    def start(self) -> LoopbackMooncakeStore:
        """Start the master and the holder; raises when either does not come up.

        Raises:
            FileNotFoundError: ``mooncake_master`` / ``mooncake_client`` not installed.
            RuntimeError: a server did not start (its log is named).
        """
        self.master.start(timeout=20)
        if self.segment_size:
            try:
                self.holder = MooncakeSegmentHolder(self.master, self.segment_size).start()
            except BaseException:
                self.stop()
                raise
        return self

    def touch_segment(self, timeout: float = 300.0) -> dict[str, Any]:
        """Fill the holder's segment once with throwaway objects and remove them, so the
        pool's memory has been written before a measurement, as a long-running Store's
        has (a fresh segment's first writes fault its pages in, in the holder's process,
        beside the engines). Runs in a child process (a Store client of its own).

        Returns:
            ``{"bytes": written, "seconds": took, "left": objects not removed}``.

        Raises:
            RuntimeError: no holder, or the child failed (its output is named).
        """
        if self.holder is None:
            raise RuntimeError("touch_segment: this Store has no segment holder")
        nbytes = parse_size(self.segment_size, key="segment_size", source="touch_segment")
        cfg = self.config()
        proc = subprocess.run(
            [sys.executable, "-c", _TOUCH_SCRIPT, HOST, cfg["metadata_server"],
             cfg["master_server_address"], str(nbytes)],
            capture_output=True, text=True, timeout=timeout,
            env=dict(os.environ, MC_TCP_BIND_ADDRESS=HOST), check=False)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
            raise RuntimeError(f"touch_segment failed (rc {proc.returncode}): "
                               f"{(proc.stdout + proc.stderr)[-2000:]}")
        result: dict[str, Any] = json.loads(lines[-1])
        logger.info("Mooncake Store: wrote %d MiB into the holder's segment and removed it "
                    "in %.1f s", result["bytes"] >> 20, result["seconds"])
        return result

    def config(self, **overrides: Any) -> dict[str, Any]:
        """A Store client config for clients that mount no segment of their own (the
        holder's segment is the pool)."""
        return self.master.config(**{"global_segment_size": 0, "local_buffer_size": "128MB",
                                     **overrides})

    def stop(self) -> None:
        """Stop the holder, then the master."""
        if self.holder is not None:
            self.holder.stop()
            self.holder = None
        self.master.stop()

    def __enter__(self) -> LoopbackMooncakeStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
