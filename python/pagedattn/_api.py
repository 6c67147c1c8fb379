"""The attention and cache-write API: the compiled functions themselves.

Each call crosses from Python into C++ once: the arrays (any DLPack array, NumPy's
bfloat16 included), the output, the CUDA stream and every option are converted and
validated in the compiled core, so there is no Python frame between a caller and the
kernel. The options of a call are the keyword table of ``python/src/call_options.cpp``;
``help(pagedattn.paged_attention)`` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from . import _core
from ._core import (
    PreparedDecode,
    decode_plan,
    decode_workspace_size,
    kv_cache_shape,
    paged_attention,
    reshape_and_cache,
    supported,
)

__all__ = [
    "paged_attention",
    "prepare_decode",
    "PreparedDecode",
    "reshape_and_cache",
    "kv_cache_shape",
    "decode_workspace_size",
    "decode_plan",
    "supported",
    "built_with_cuda",
]


if TYPE_CHECKING:
    from ._core import SupportsDLPack  # a typing-only protocol of the stubs

_Query = TypeVar("_Query", bound="SupportsDLPack")


def prepare_decode(query: _Query, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
                   **options: Any) -> PreparedDecode[_Query]:  # fmt: skip
    """Validates a :func:`paged_attention` call once; returns a :class:`PreparedDecode`.

    Takes the same arguments as :func:`paged_attention`. The prepared call holds every
    array it reads for as long as it lives; ``run()`` / ``()`` launches it and returns
    the output.
    """
    return PreparedDecode(query, key_cache, value_cache, block_tables, seq_lens, **options)


def built_with_cuda() -> bool:
    """True when this installation contains the CUDA backend."""
    return bool(_core.with_cuda)
