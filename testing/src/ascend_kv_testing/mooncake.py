# SPDX-License-Identifier: Apache-2.0
"""A real ``mooncake_master`` (and optional ``mooncake_client`` segment holder) on loopback.

Every port is given explicitly: the master's defaults (8080, 9003, 50051)
collide easily, and some of its sockets bind all interfaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .procs import free_port, spawn, stop, wait_port

HOST = "127.0.0.1"


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found; install mooncake-transfer-engine-non-cuda")
    return found


@dataclass
class MooncakeMaster:
    """A running ``mooncake_master`` with HTTP metadata server, all on 127.0.0.1."""

    workdir: Path
    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"

    def start(self) -> MooncakeMaster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [_binary("mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}",
               "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
               f"--http_metadata_server_port={self.http_port}", f"--metrics_port={self.metrics_port}"]
        self.proc = spawn(cmd, log=self.workdir / f"master-{self.rpc_port}.log")
        wait_port(HOST, self.rpc_port, proc=self.proc)
        wait_port(HOST, self.http_port, proc=self.proc)
        return self

    def stop(self) -> None:
        stop(self.proc)

    def kill(self) -> None:
        """SIGKILL (fault tests)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def config(self, **overrides: object) -> dict[str, object]:
        """A Mooncake Store client config (the MOONCAKE_CONFIG_PATH JSON) for this master."""
        cfg: dict[str, object] = {
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
        path.write_text(json.dumps(self.config(**overrides)))
        return path


@dataclass
class MooncakeSegmentHolder:
    """A ``mooncake_client`` process that mounts a segment and outlives the engines."""

    master: MooncakeMaster
    segment_size: str = "256MB"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MooncakeSegmentHolder:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=HOST)
        cmd = [_binary("mooncake_client"), f"--host={HOST}", f"--port={self.port}",
               f"--global_segment_size={self.segment_size}", "--local_buffer_size=16MB",
               f"--master_server_address={self.master.master_address}",
               f"--metadata_server={self.master.metadata_server}", "--protocol=tcp"]
        self.proc = spawn(cmd, log=self.master.workdir / f"client-{self.port}.log", env=env)
        wait_port(HOST, self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        stop(self.proc)
