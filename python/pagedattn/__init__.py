"""pagedattn: paged-attention decode kernels and a KV block manager for any DLPack array."""

from __future__ import annotations

from . import reference
from ._api import (
    PreparedDecode,
    built_with_cuda,
    decode_plan,
    decode_workspace_size,
    kv_cache_shape,
    paged_attention,
    prepare_decode,
    reshape_and_cache,
    supported,
)
from ._core import __version__

__all__ = [
    "__version__",
    "built_with_cuda",
    "decode_plan",
    "decode_workspace_size",
    "kv_cache_shape",
    "paged_attention",
    "prepare_decode",
    "PreparedDecode",
    "reshape_and_cache",
    "supported",
    "reference",
    "cmake_dir",
    "include_dir",
]

from .block_manager import *  # noqa: E402,F401,F403
from .block_manager import __all__ as _bm_all  # noqa: E402
from .cache_ops import *  # noqa: E402,F401,F403
from .cache_ops import __all__ as _co_all  # noqa: E402

__all__ += list(_bm_all) + list(_co_all)


def cmake_dir() -> str:
    """The folder holding pagedattnConfig.cmake: pass it as ``pagedattn_DIR``."""
    import os

    return os.path.join(os.path.dirname(__file__), "lib", "cmake", "pagedattn")


def include_dir() -> str:
    """The folder holding the C++ headers (``#include <pagedattn/pagedattn.hpp>``)."""
    import os

    return os.path.join(os.path.dirname(__file__), "include")
