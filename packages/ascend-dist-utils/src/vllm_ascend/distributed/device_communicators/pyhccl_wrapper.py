# SPDX-License-Identifier: Apache-2.0
"""ctypes bindings to HCCL (``libhccl.so``), upstream's ``pyhccl_wrapper``.

:class:`HCCLLibrary` loads the library named by ``HCCL_SO_PATH`` (default
``libhccl.so``, found by the dynamic loader, as upstream's
``find_hccl_library``), declares the argument and result types of every HCCL
function it binds, and checks each call's ``HcclResult``. One ``CDLL`` and
one set of bound functions exist per library path in a process.

Bound C functions (``hccl.h``)::

    const char *HcclGetErrorString(HcclResult code);
    HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo);
    HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo,
                                    uint32_t rank, HcclComm *comm);
    HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                             HcclReduceOp op, HcclComm comm, aclrtStream stream);
    HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount,
                             HcclDataType dataType, HcclComm comm, aclrtStream stream);
    HcclResult HcclSend(void *buf, uint64_t count, HcclDataType dataType, uint32_t destRank,
                        HcclComm comm, aclrtStream stream);
    HcclResult HcclRecv(void *buf, uint64_t count, HcclDataType dataType, uint32_t srcRank,
                        HcclComm comm, aclrtStream stream);
    HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root,
                             HcclComm comm, aclrtStream stream);
    HcclResult HcclCommDestroy(HcclComm comm);

Importing this module needs ``torch`` only; the library is loaded when an
:class:`HCCLLibrary` is created.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ReduceOp

from .errors import HcclError, HcclLibraryError

logger = logging.getLogger(__name__)

__all__ = [
    "HCCL_SO_PATH_ENV",
    "HCCLLibrary",
    "aclrtStream_t",
    "buffer_type",
    "find_hccl_library",
    "hcclComm_t",
    "hcclDataTypeEnum",
    "hcclRedOpTypeEnum",
    "hcclUniqueId",
]

#: Environment variable naming the HCCL shared library (upstream's ``envs.HCCL_SO_PATH``).
HCCL_SO_PATH_ENV = "HCCL_SO_PATH"
DEFAULT_HCCL_LIBRARY = "libhccl.so"
#: Size of ``HcclRootInfo`` (``HCCL_ROOT_INFO_BYTES`` in ``hccl_types.h``).
HCCL_ROOT_INFO_BYTES = 4108

hcclResult_t = ctypes.c_int
hcclComm_t = ctypes.c_void_p
aclrtStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p
hcclDataType_t = ctypes.c_int
hcclRedOp_t = ctypes.c_int


class hcclUniqueId(ctypes.Structure):
    """``HcclRootInfo``: the opaque bytes rank 0 creates and every rank needs."""

    _fields_ = [("internal", ctypes.c_byte * HCCL_ROOT_INFO_BYTES)]


class hcclDataTypeEnum:
    """``HcclDataType`` values."""

    hcclInt8 = 0
    hcclInt16 = 1
    hcclInt32 = 2
    hcclFloat16 = 3
    hcclFloat32 = 4
    hcclInt64 = 5
    hcclUint64 = 6
    hcclUint8 = 7
    hcclUint16 = 8
    hcclUint32 = 9
    hcclFloat64 = 10
    hcclBfloat16 = 11
    hcclInt128 = 12

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> int:
        """The HCCL type of a torch dtype.

        Raises:
            ValueError: a dtype HCCL has no type for.
        """
        table = {
            torch.int8: cls.hcclInt8,
            torch.uint8: cls.hcclUint8,
            torch.int16: cls.hcclInt16,
            torch.int32: cls.hcclInt32,
            torch.int64: cls.hcclInt64,
            torch.float16: cls.hcclFloat16,
            torch.float32: cls.hcclFloat32,
            torch.float64: cls.hcclFloat64,
            torch.bfloat16: cls.hcclBfloat16,
        }
        try:
            return table[dtype]
        except KeyError:
            raise ValueError(f"Unsupported dtype: {dtype} (HCCL has no data type for it)") from None


class hcclRedOpTypeEnum:
    """``HcclReduceOp`` values."""

    hcclSum = 0
    hcclProd = 1
    hcclMax = 2
    hcclMin = 3

    @classmethod
    def from_torch(cls, op: Any) -> int:
        """The HCCL reduce op of a ``torch.distributed.ReduceOp``.

        Raises:
            ValueError: an op HCCL does not implement (e.g. ``AVG``).
        """
        for torch_op, value in ((ReduceOp.SUM, cls.hcclSum), (ReduceOp.PRODUCT, cls.hcclProd),
                                (ReduceOp.MAX, cls.hcclMax), (ReduceOp.MIN, cls.hcclMin)):
            if op == torch_op:
                return value
        raise ValueError(f"Unsupported op: {op} (HCCL implements SUM, PRODUCT, MAX, MIN)")


@dataclass(frozen=True)
class Function:
    """One C function: its name, result type and argument types."""

    name: str
    restype: Any
    argtypes: list[Any]


def find_hccl_library() -> str:
    """``$HCCL_SO_PATH`` if set, else ``libhccl.so`` (left to the dynamic loader)."""
    path = os.environ.get(HCCL_SO_PATH_ENV, "").strip()
    if path:
        logger.info("Found HCCL library from environment variable %s=%s", HCCL_SO_PATH_ENV,
                    path)
        return path
    return DEFAULT_HCCL_LIBRARY


_lock = threading.Lock()


class HCCLLibrary:
    """The HCCL functions of one shared library, typed and checked.

    Args:
        so_file: Library path; default :func:`find_hccl_library`.

    Raises:
        HcclLibraryError: the library does not load, or lacks one of the
            functions (the message names ``HCCL_SO_PATH``).
    """

    exported_functions = [
        Function("HcclGetErrorString", ctypes.c_char_p, [hcclResult_t]),
        Function("HcclGetRootInfo", hcclResult_t, [ctypes.POINTER(hcclUniqueId)]),
        Function("HcclCommInitRootInfo", hcclResult_t,
                 [ctypes.c_int, ctypes.POINTER(hcclUniqueId), ctypes.c_int,
                  ctypes.POINTER(hcclComm_t)]),
        Function("HcclAllReduce", hcclResult_t,
                 [buffer_type, buffer_type, ctypes.c_size_t, hcclDataType_t, hcclRedOp_t,
                  hcclComm_t, aclrtStream_t]),
        Function("HcclAllGather", hcclResult_t,
                 [buffer_type, buffer_type, ctypes.c_size_t, hcclDataType_t, hcclComm_t,
                  aclrtStream_t]),
        Function("HcclSend", hcclResult_t,
                 [buffer_type, ctypes.c_size_t, hcclDataType_t, ctypes.c_int, hcclComm_t,
                  aclrtStream_t]),
        Function("HcclRecv", hcclResult_t,
                 [buffer_type, ctypes.c_size_t, hcclDataType_t, ctypes.c_int, hcclComm_t,
                  aclrtStream_t]),
        Function("HcclBroadcast", hcclResult_t,
                 [buffer_type, ctypes.c_size_t, hcclDataType_t, ctypes.c_int, hcclComm_t,
                  aclrtStream_t]),
        Function("HcclCommDestroy", hcclResult_t, [hcclComm_t]),
    ]

    #: library path -> loaded ``CDLL`` (one load a path and process).
    path_to_library_cache: dict[str, Any] = {}
    #: library path -> {function name: typed ctypes function}.
    path_to_dict_mapping: dict[str, dict[str, Any]] = {}

    def __init__(self, so_file: str | None = None) -> None:
        so_file = so_file or find_hccl_library()
        self.so_file = so_file
        with _lock:
            if so_file not in HCCLLibrary.path_to_dict_mapping:
                HCCLLibrary.path_to_dict_mapping[so_file] = self._bind(so_file)
        self.lib = HCCLLibrary.path_to_library_cache[so_file]
        self._funcs = HCCLLibrary.path_to_dict_mapping[so_file]

    @staticmethod
    def _bind(so_file: str) -> dict[str, Any]:
        try:
            lib = ctypes.CDLL(so_file)
        except OSError as exc:
            raise HcclLibraryError(
                f"Failed to load the HCCL library {so_file!r} ({exc}) on {platform.platform()}. "
                f"Install the CANN toolkit, or set the environment variable {HCCL_SO_PATH_ENV} "
                f"to the path of libhccl.so (currently "
                f"{HCCL_SO_PATH_ENV}={os.environ.get(HCCL_SO_PATH_ENV, '<unset>')!s}).") from exc
        funcs: dict[str, Any] = {}
        for func in HCCLLibrary.exported_functions:
            try:
                f = getattr(lib, func.name)
            except AttributeError as exc:
                raise HcclLibraryError(
                    f"The library {so_file!r} has no symbol {func.name}: it is not HCCL; point "
                    f"{HCCL_SO_PATH_ENV} at CANN's libhccl.so") from exc
            f.restype = func.restype
            f.argtypes = func.argtypes
            funcs[func.name] = f
        HCCLLibrary.path_to_library_cache[so_file] = lib
        return funcs

    # ----------------------------------------------------------------- results
    def hcclGetErrorString(self, result: int) -> str:
        """HCCL's text for a result code."""
        raw = self._funcs["HcclGetErrorString"](result)
        return raw.decode("utf-8", "replace") if raw else f"HcclResult {result}"

    def HCCL_CHECK(self, result: int, call: str = "HCCL call") -> None:
        """Raise :class:`HcclError` (a ``RuntimeError``) when ``result`` is not 0."""
        if result != 0:
            raise HcclError(f"HCCL error: {call} returned {result}: "
                            f"{self.hcclGetErrorString(result)}", code=int(result), call=call)

    # ----------------------------------------------------------------- calls
    def hcclGetUniqueId(self) -> hcclUniqueId:
        """A new root info (rank 0 creates it; every rank needs its bytes)."""
        unique_id = hcclUniqueId()
        self.HCCL_CHECK(self._funcs["HcclGetRootInfo"](ctypes.byref(unique_id)),
                        "HcclGetRootInfo")
        return unique_id

    def hcclCommInitRank(self, world_size: int, unique_id: hcclUniqueId,
                         rank: int) -> hcclComm_t:
        """Create this rank's communicator (``HcclCommInitRootInfo``)."""
        comm = hcclComm_t()
        self.HCCL_CHECK(self._funcs["HcclCommInitRootInfo"](
            world_size, ctypes.byref(unique_id), rank, ctypes.byref(comm)),
            "HcclCommInitRootInfo")
        return comm

    def hcclAllReduce(self, sendbuff: Any, recvbuff: Any, count: int, datatype: int, op: int,
                      comm: Any, stream: Any) -> None:
        """``HcclAllReduce`` of ``count`` elements."""
        self.HCCL_CHECK(self._funcs["HcclAllReduce"](sendbuff, recvbuff, count, datatype, op,
                                                     comm, stream), "HcclAllReduce")

    def hcclAllGather(self, sendbuff: Any, recvbuff: Any, sendcount: int, datatype: int,
                      comm: Any, stream: Any) -> None:
        """``HcclAllGather`` of ``sendcount`` elements a rank."""
        self.HCCL_CHECK(self._funcs["HcclAllGather"](sendbuff, recvbuff, sendcount, datatype,
                                                     comm, stream), "HcclAllGather")

    def hcclSend(self, sendbuff: Any, count: int, datatype: int, dest: int, comm: Any,
                 stream: Any) -> None:
        """``HcclSend`` to rank ``dest``."""
        self.HCCL_CHECK(self._funcs["HcclSend"](sendbuff, count, datatype, dest, comm, stream),
                        "HcclSend")

    def hcclRecv(self, recvbuff: Any, count: int, datatype: int, src: int, comm: Any,
                 stream: Any) -> None:
        """``HcclRecv`` from rank ``src``."""
        self.HCCL_CHECK(self._funcs["HcclRecv"](recvbuff, count, datatype, src, comm, stream),
                        "HcclRecv")

    def hcclBroadcast(self, buf: Any, count: int, datatype: int, root: int, comm: Any,
                      stream: Any) -> None:
        """``HcclBroadcast`` of ``count`` elements from rank ``root``."""
        self.HCCL_CHECK(self._funcs["HcclBroadcast"](buf, count, datatype, root, comm, stream),
                        "HcclBroadcast")

    def hcclCommDestroy(self, comm: Any) -> None:
        """``HcclCommDestroy``."""
        self.HCCL_CHECK(self._funcs["HcclCommDestroy"](comm), "HcclCommDestroy")
