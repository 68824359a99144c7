# SPDX-License-Identifier: Apache-2.0
"""Host memory of the offload pool: shared-memory segments mapped by every rank.

A segment is a file in ``/dev/shm`` (tmpfs) mapped with ``mmap``; rank
processes map the same file, so the pool is shared without copies. Inside a
segment, layer ``L`` is a ``(num_blocks, layer_block_bytes[L])`` byte matrix;
host block ``i`` of a layer is row ``i``. Layers start at 4 KiB-aligned
offsets.

Non-MLA caches get one segment per rank (each rank holds its own KV heads).
MLA caches are identical on every TP rank, so a pipeline stage has one
segment that all its TP ranks map: stored once, saved in stripes, loaded by
all.

The metadata server creates the files and unlinks them once every rank has
mapped them: the memory then lives exactly as long as the processes that map
it, and a crash leaves nothing behind in ``/dev/shm``. Files are reserved with
``posix_fallocate`` so that a too small tmpfs is a clear error at startup, not
a ``SIGBUS`` in the middle of a step.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Sequence

import torch

from vllm_ascend.distributed.kv_transfer.core.config.sizes import format_size

from ..errors import HostCapacityError, HostPoolError

logger = logging.getLogger(__name__)

ALIGN = 4096
SHM_DIR_ENV = "VLLM_ASCEND_KV_SHM_DIR"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def shm_dir() -> str:
    """Directory of the segment files: ``$VLLM_ASCEND_KV_SHM_DIR``, ``/dev/shm``, or the temp dir."""
    forced = os.environ.get(SHM_DIR_ENV, "").strip()
    if forced:
        return forced
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def layer_offsets(num_blocks: int, layer_block_bytes: Sequence[int]) -> list[int]:
    """Byte offset of each layer's block matrix inside a segment."""
    offsets = []
    pos = 0
    for nbytes in layer_block_bytes:
        offsets.append(pos)
        pos = _align(pos + num_blocks * int(nbytes))
    return offsets


def segment_bytes(num_blocks: int, layer_block_bytes: Sequence[int]) -> int:
    """Size of a segment holding ``num_blocks`` blocks of every layer."""
    total = 0
    for nbytes in layer_block_bytes:
        total = _align(total + num_blocks * int(nbytes))
    return total


def plan_num_blocks(budget_bytes: int, segments_block_bytes: Sequence[Sequence[int]]) -> int:
    """How many host blocks fit in ``budget_bytes`` for the given segments.

    Args:
        budget_bytes: host memory of the whole instance.
        segments_block_bytes: for each segment, the bytes of one block of each layer.

    Raises:
        HostCapacityError: not even one block fits.
    """
    per_block = sum(sum(int(b) for b in seg) for seg in segments_block_bytes)
    if per_block <= 0:
        raise HostCapacityError(f"a host block would hold {per_block} bytes; the KV cache "
                                "layout registered no bytes")
    # alignment padding is at most ALIGN per layer per segment
    padding = sum(len(seg) * ALIGN for seg in segments_block_bytes)
    n = (budget_bytes - padding) // per_block
    if n < 1:
        raise HostCapacityError(
            f"cpu_swap_space of {format_size(budget_bytes)} cannot hold one host block of "
            f"{format_size(per_block)} (all ranks and layers); raise cpu_swap_space_gb")
    while n > 1 and sum(segment_bytes(n, seg) for seg in segments_block_bytes) > budget_bytes:
        n -= 1
    return int(n)


class HostSegment:
    """One mapped segment: a byte matrix per layer.

    Use :meth:`create` (metadata server) or :meth:`attach` (ranks).
    """

    def __init__(self, path: str, num_blocks: int, layer_block_bytes: Sequence[int],
                 mm: mmap.mmap) -> None:
        self.path = path
        self.num_blocks = num_blocks
        self.layer_block_bytes = [int(b) for b in layer_block_bytes]
        self.nbytes = segment_bytes(num_blocks, self.layer_block_bytes)
        self._mm = mm
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        self.flat = flat
        self.layers: list[torch.Tensor] = []
        for off, nbytes in zip(layer_offsets(num_blocks, self.layer_block_bytes),
                               self.layer_block_bytes, strict=True):
            self.layers.append(flat[off: off + num_blocks * nbytes].view(num_blocks, nbytes))

    @classmethod
    def create(cls, path: str, num_blocks: int, layer_block_bytes: Sequence[int], *,
               preallocate: bool = True) -> HostSegment:
        """Create and map a new segment file at ``path``.

        Raises:
            HostPoolError: the file exists or cannot be created.
            HostCapacityError: the file system has no room for it.
        """
        size = segment_bytes(num_blocks, layer_block_bytes)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise HostPoolError(f"cannot create the host pool segment {path!r}: {exc}") from exc
        try:
            try:
                if preallocate:
                    os.posix_fallocate(fd, 0, size)
                else:
                    os.ftruncate(fd, size)
            except OSError as exc:
                free = _free_bytes(os.path.dirname(path))
                raise HostCapacityError(
                    f"cannot reserve {format_size(size)} for the host pool segment {path!r} "
                    f"({exc}); {format_size(free)} free there. Lower cpu_swap_space_gb, or enlarge "
                    f"{os.path.dirname(path)} (docker: --shm-size), or point {SHM_DIR_ENV} "
                    "elsewhere") from exc
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        logger.debug("created host segment %s: %d blocks, %s", path, num_blocks, format_size(size))
        return cls(path, num_blocks, layer_block_bytes, mm)

    @classmethod
    def attach(cls, path: str, num_blocks: int, layer_block_bytes: Sequence[int]) -> HostSegment:
        """Map an existing segment file.

        Raises:
            HostPoolError: the file is missing or smaller than the layout needs.
        """
        size = segment_bytes(num_blocks, layer_block_bytes)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise HostPoolError(f"cannot open the host pool segment {path!r}: {exc}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise HostPoolError(f"host pool segment {path!r} holds {actual} bytes, the layout "
                                    f"needs {size}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, num_blocks, layer_block_bytes, mm)

    def unlink(self) -> None:
        """Remove the file name (the mapping stays valid until closed)."""
        _unlink(self.path)

    def close(self) -> None:
        """Drop the tensors and unmap (only when no tensor view is used any more); idempotent."""
        self.layers = []
        if not hasattr(self, "flat"):
            return
        del self.flat
        try:
            self._mm.close()
        except BufferError:
            # a tensor view still exists somewhere; the mapping goes with the process
            logger.debug("host segment %s still has live views; left mapped", self.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return int(st.f_bavail * st.f_frsize)
