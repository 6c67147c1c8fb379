"""Whole-block cache operations and the CUDA decode workspace size.

- :func:`copy_blocks`: copy blocks inside every cache of a list (every layer's key and
  value caches at once: one launch on CUDA).
- :func:`swap_blocks`: move blocks between a GPU cache and a (pinned) host cache,
  asynchronously on the stream.
- :func:`decode_workspace_size`: bytes of CUDA scratch that ``paged_attention`` needs
  for given shapes; allocate it once (a uint8 device array) and pass it as
  ``workspace=`` so that calls never allocate (needed inside CUDA graph capture when
  the internal per-stream pool has not yet seen those shapes).

The same calls work on NumPy (host) arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _core
from ._arrays import as_core, dtype_name, is_cuda, resolve_stream

__all__ = ["copy_blocks", "swap_blocks", "decode_workspace_size", "decode_plan"]


def _mapping(block_mapping: Any, like: Any) -> Any:
    """Pairs as an array: lists / tuples become int64 NumPy arrays (host memory)."""
    if hasattr(block_mapping, "__dlpack__") or isinstance(block_mapping, np.ndarray):
        return block_mapping
    arr = np.asarray(block_mapping, dtype=np.int64)
    if arr.size == 0:
        arr = arr.reshape(0, 2)
    return np.ascontiguousarray(arr)


def _is_array(a: Any) -> bool:
    return hasattr(a, "__dlpack__") or isinstance(a, np.ndarray)


def _layers(caches: Any, name: str) -> list:
    """A sequence of cache arrays as a list; a single cache array is one layer."""
    if _is_array(caches):
        return [caches]
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence):
        raise TypeError(f"{name}: expected a cache array or a sequence of them, got {type(caches).__name__}")
    return list(caches)


def _one_array(a: Any, name: str) -> Any:
    if not _is_array(a):
        raise TypeError(
            f"{name}: expected one cache array (any DLPack producer), got {type(a).__name__}; "
            "swap_blocks moves the blocks of one cache: call it once per layer and per key / value cache"
        )
    return a


def copy_blocks(
    key_caches: Sequence[Any] | Any,
    value_caches: Sequence[Any] | Any,
    block_mapping: Any,
    *,
    stream: Any = None,
) -> None:
    """For every (src, dst) pair and every cache: ``cache[dst] = cache[src]``, in place.

    ``key_caches`` / ``value_caches``: lists of cache arrays [num_blocks, ...] on one
    device (any layout; a block is the slice along the first dimension), one per
    layer; a single array (not in a list) is one layer's cache, never a list of rows.
    ``block_mapping``: pairs [P, 2] (src, dst) as a list of pairs, or an int64/int32
    array in host memory or on the caches' GPU, never inside a cache. A destination
    must not appear twice nor be the source of another pair (a host mapping breaking
    this raises ValueError naming the pair). On CUDA all arrays and pairs are done in one kernel launch on
    ``stream`` (default: the arrays' framework's current stream, see
    :func:`pagedattn.paged_attention`).
    """
    caches = [as_core(c)[0] for c in _layers(key_caches, "key_caches") + _layers(value_caches, "value_caches")]
    if not caches:
        return
    mapping = _mapping(block_mapping, caches[0])
    handle = resolve_stream(stream, caches[0]) if (stream is not None or is_cuda(caches[0])) else 0
    _core.copy_blocks(caches, mapping, stream=handle)


def swap_blocks(src: Any, dst: Any, block_mapping: Any, *, stream: Any = None) -> None:
    """For every (s, d) pair: ``dst[d] = src[s]``: GPU <-> pinned host, or host <-> host.

    ``src`` and ``dst`` share dtype and block shape (all dimensions but the first).
    ``block_mapping``: pairs [P, 2] in host memory (list of pairs or array), never
    inside ``src`` or ``dst``; a destination must not appear twice (nor, when ``src``
    and ``dst`` share memory, be the source of another pair). With a GPU
    involved the copies are queued on ``stream`` (default: the GPU array's framework's
    current stream) and the call returns at once; use pinned host memory (e.g.
    ``torch.empty(..., pin_memory=True)``) for truly asynchronous copies.
    """
    s, _ = as_core(_one_array(src, "src"))
    d, _ = as_core(_one_array(dst, "dst"))
    mapping = _mapping(block_mapping, src)
    gpu = src if is_cuda(src) else dst
    handle = resolve_stream(stream, gpu) if (stream is not None or is_cuda(gpu)) else 0
    _core.swap_blocks(s, d, mapping, stream=handle)


def decode_workspace_size(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_blocks_per_seq: int,
    dtype: Any,
    *,
    kv_cache_dtype: str = "auto",
    layout: str = "vllm",
    version: int = 0,
    partition_size: int = 0,
    device: int = 0,
) -> int:
    """Bytes of CUDA scratch ``paged_attention`` needs for these shapes and options.

    0 means the single-pass kernel runs and no workspace is used. The size depends only
    on these host-known sizes (never on ``seq_lens``), so one buffer of this size serves
    every later call with the same shapes, including graph replays.
    """
    return int(_decode_query(_core.decode_workspace_size, locals()))


def decode_plan(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_blocks_per_seq: int,
    dtype: Any,
    *,
    kv_cache_dtype: str = "auto",
    layout: str = "vllm",
    version: int = 0,
    partition_size: int = 0,
    device: int = 0,
) -> dict:
    """How ``paged_attention`` runs on CUDA for these shapes and options.

    Same arguments and errors as :func:`decode_workspace_size`. Returns a dict:
    ``num_partitions`` and ``partition_size`` (tokens) along the context,
    ``reduce_kernel`` (True: partial results go to scratch and a second kernel merges
    them), ``head_tiles`` (CTAs per KV head along its query heads), ``ctas`` (the decode
    grid) and ``workspace_bytes``.
    Like the workspace size it depends only on host-known sizes, never on ``seq_lens``.
    """
    return dict(_decode_query(_core.decode_plan, locals()))


def _decode_query(fn: Any, a: dict) -> Any:
    """Calls a C++ workspace / plan query with the arguments of decode_workspace_size."""
    sizes = [int(a[k]) for k in ("num_seqs", "num_heads", "num_kv_heads", "head_size", "block_size",
                                 "max_blocks_per_seq")]  # fmt: skip
    return fn(*sizes, dtype_name(a["dtype"]), a["kv_cache_dtype"], a["layout"], int(a["version"]),
              int(a["partition_size"]), int(a["device"]))  # fmt: skip
