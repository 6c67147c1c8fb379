"""Whole-block cache operations.

- :func:`copy_blocks`: copy blocks inside every cache of a list (every layer's key and
  value caches at once: one launch on CUDA).
- :func:`swap_blocks`: move blocks between a GPU cache and a (pinned) host cache,
  asynchronously on the stream.

The same calls work on NumPy (host) arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _core
from ._arrays import as_core, is_cuda, resolve_stream

__all__ = ["copy_blocks", "swap_blocks"]


def _mapping(block_mapping: Any) -> Any:
    """Pairs as an array: lists / tuples become int64 NumPy arrays (host memory)."""
    if hasattr(block_mapping, "__dlpack__") or isinstance(block_mapping, np.ndarray):
        return block_mapping
    arr = np.asarray(block_mapping, dtype=np.int64)
    if arr.size == 0:
        arr = arr.reshape(0, 2)
    return np.ascontiguousarray(arr)


def copy_blocks(
    key_caches: Sequence[Any],
    value_caches: Sequence[Any],
    block_mapping: Any,
    *,
    stream: Any = None,
) -> None:
    """For every (src, dst) pair and every cache: ``cache[dst] = cache[src]``, in place.

    ``key_caches`` / ``value_caches``: lists of cache arrays [num_blocks, ...] on one
    device (any layout; a block is the slice along the first dimension).
    ``block_mapping``: pairs [P, 2] (src, dst) as a list of pairs, or an int64/int32
    array in host memory or on the caches' GPU. Destinations must not be sources of
    other pairs. On CUDA all arrays and pairs are done in one kernel launch on
    ``stream`` (default: the arrays' framework's current stream, see
    :func:`pagedattn.paged_attention`).
    """
    caches = [as_core(c)[0] for c in list(key_caches) + list(value_caches)]
    if not caches:
        return
    mapping = _mapping(block_mapping)
    handle = resolve_stream(stream, caches[0]) if (stream is not None or is_cuda(caches[0])) else 0
    _core.copy_blocks(caches, mapping, stream=handle)


def swap_blocks(src: Any, dst: Any, block_mapping: Any, *, stream: Any = None) -> None:
    """For every (s, d) pair: ``dst[d] = src[s]``: GPU <-> pinned host, or host <-> host.

    ``src`` and ``dst`` share dtype and block shape (all dimensions but the first).
    ``block_mapping``: pairs [P, 2] in host memory (list of pairs or array). With a GPU
    involved the copies are queued on ``stream`` (default: the GPU array's framework's
    current stream) and the call returns at once; use pinned host memory (e.g.
    ``torch.empty(..., pin_memory=True)``) for truly asynchronous copies.
    """
    s, _ = as_core(src)
    d, _ = as_core(dst)
    mapping = _mapping(block_mapping)
    gpu = src if is_cuda(src) else dst
    handle = resolve_stream(stream, gpu) if (stream is not None or is_cuda(gpu)) else 0
    _core.swap_blocks(s, d, mapping, stream=handle)
