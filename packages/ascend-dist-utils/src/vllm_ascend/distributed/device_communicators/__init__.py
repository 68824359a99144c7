# SPDX-License-Identifier: Apache-2.0
"""Device communicators of vLLM on Ascend (``ascend-dist-utils``).

:mod:`.npu_communicator` holds ``NPUCommunicator``, the class vLLM's platform
resolves by qualified name, and ``all_to_all``, its collective as a plain
function of a process group. :mod:`.pyhccl` holds ``PyHcclCommunicator``
(HCCL all-reduce and broadcast over a non-HCCL group) on the ctypes bindings of
:mod:`.pyhccl_wrapper` (``libhccl.so`` from ``HCCL_SO_PATH``). Importing this
package imports neither vLLM nor ``torch_npu``.
"""

from __future__ import annotations

from .__about__ import __version__

__all__ = ["__version__"]
