"""The decode attention and cache-write API (framework-neutral wrappers of the core).

All validation happens in the compiled core; this layer only picks the output array,
the CUDA stream and the bfloat16 bridge for NumPy. When every array's type offers the
DLPack C exchange API (``__dlpack_c_exchange_api__``, torch 2.11 and later), the compiled
core converts the arrays, allocates the output and finds the current stream itself.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

from . import _core
from ._arrays import (
    as_core,
    check_num_seqs,
    check_writable,
    dtype_name,
    empty_like,
    finish_like,
    is_cuda,
    resolve_stream,
)

__all__ = [
    "paged_attention",
    "prepare_decode",
    "PreparedDecode",
    "reshape_and_cache",
    "kv_cache_shape",
    "supported",
    "built_with_cuda",
]


def paged_attention(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: Optional[float] = None,
    alibi_slopes: Any = None,
    out: Any = None,
    stream: Any = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    version: int = 0,
    partition_size: int = 0,
    workspace: Any = None,
    check_block_tables: bool = False,
) -> Any:
    """Decode attention of one new query token per sequence over its paged KV cache.

    Shapes (S sequences, H query heads, K KV heads, D head size, B block size,
    N blocks, M max blocks per sequence, x = 16 / element size of the cache):

    - ``query`` [S, H, D]; may be strided in its first two dimensions.
    - ``key_cache`` layout "vllm" [N, K, D/x, B, x] or "nhd" [N, B, K, D];
      ``value_cache`` "vllm" [N, K, D, B] or "nhd" [N, B, K, D]; C-contiguous.
    - ``block_tables`` int32 [S, M]; ``seq_lens`` int32 [S].

    Query head h reads KV head h // (H // K). ``scale`` defaults to 1/sqrt(D).
    ``alibi_slopes`` float32 [H] adds slope[h] * (t - seq_len + 1) to token t's logit.
    A sequence of length 0 yields zeros. Returns ``out`` when given, else a new array
    of the query's kind, dtype and device.

    ``stream``: an int handle or an object with ``__cuda_stream__`` (torch / CuPy streams
    too); by default the current stream of the arrays' framework on their device.

    fp8 caches: ``kv_cache_dtype`` "fp8_e4m3" / "fp8_e5m2" with uint8 caches, real
    value = stored value * ``k_scale`` / ``v_scale``. ``version`` (CUDA) forces the
    single-pass (1) or partitioned (2) kernel; 0 chooses.
    """
    if stream is None or type(stream) is int:
        # Fast path: every array's type offers the DLPack C exchange API (torch >= 2.11):
        # converted in C++ with no Python-level call, on the framework's current stream.
        result = _core.paged_attention_exchange(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                alibi_slopes, kv_cache_dtype, k_scale, v_scale, version,
                                                partition_size, workspace, check_block_tables, stream)  # fmt: skip
        if result is not None:
            return result
    if out is None:
        check_num_seqs(query, block_tables, seq_lens)
        result = empty_like(query)
    else:
        check_writable(out, "out")
        result = out
    args, kwargs = _decode_args(result, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                alibi_slopes, stream, kv_cache_dtype, k_scale, v_scale, version,
                                partition_size, workspace, check_block_tables)  # fmt: skip
    _core.paged_attention(*args, **kwargs)
    return result if out is not None else finish_like(result, query)


def _decode_args(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, stream,
                 kv_cache_dtype, k_scale, v_scale, version, partition_size, workspace, check_block_tables):  # fmt: skip
    o, bf_o = as_core(out)
    q, bf_q = as_core(query)
    k, bf_k = as_core(key_cache)
    v, bf_v = as_core(value_cache)
    handle = resolve_stream(stream, query) if (stream is not None or is_cuda(query)) else 0
    kwargs = dict(
        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, version=version,
        partition_size=partition_size, workspace=workspace, check_block_tables=check_block_tables,
        stream=handle, bf16_mask=bf_o | (bf_q << 1) | (bf_k << 2) | (bf_v << 3),
    )  # fmt: skip
    return (o, q, k, v, block_tables, seq_lens, scale, alibi_slopes), kwargs


class PreparedDecode:
    """A decode call validated once and launched many times with :meth:`run`.

    The arrays are held (not copied): change the contents of ``query``,
    ``block_tables``, ``seq_lens`` and the caches in place between runs, never their
    shapes. On the GPU a run launches the kernel with no Python-level conversion (the
    lowest host cost per step, and the form to capture in a CUDA graph); on the CPU the
    index contents are checked again on every run.
    """

    def __init__(self, query, key_cache, value_cache, block_tables, seq_lens, *, scale=None, alibi_slopes=None,
                 out=None, stream=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, version=0,
                 partition_size=0, workspace=None, check_block_tables=False):  # fmt: skip
        if out is None:
            check_num_seqs(query, block_tables, seq_lens)
        else:
            check_writable(out, "out")
        self.out = empty_like(query) if out is None else out
        self._arrays = (query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, workspace)
        args, kwargs = _decode_args(self.out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                    alibi_slopes, stream, kv_cache_dtype, k_scale, v_scale, version,
                                    partition_size, workspace, check_block_tables)  # fmt: skip
        self._core_arrays = args  # the exact objects the views point into (uint16 views of bfloat16 included)
        self._impl = _core.PreparedDecode(*args, **kwargs)
        self._impl.attach(self.out, resolve_stream)
        # The compiled run itself, bound to this instance: a step costs no Python frame.
        self.run = self._impl.run

    def run(self, stream: Any = None) -> Any:  # replaced per instance by the compiled method
        """Runs the decode (on ``stream``, else the stream resolved when prepared) and returns ``out``."""
        return self._impl.run(stream)

    def __call__(self, stream: Any = None) -> Any:
        return self._impl.run(stream)


def prepare_decode(query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
                   **kwargs: Any) -> PreparedDecode:  # fmt: skip
    """Validates a :func:`paged_attention` call once; returns a :class:`PreparedDecode`.

    Takes the same arguments as :func:`paged_attention`.
    """
    return PreparedDecode(query, key_cache, value_cache, block_tables, seq_lens, **kwargs)


def reshape_and_cache(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    *,
    stream: Any = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes ``key`` / ``value`` [T, K, D] into their cache slots, in place.

    ``slot_mapping`` int32 or int64 [T]: slot = block * B + offset; negative slots mark
    padding and are skipped. Works with both cache layouts; with an fp8
    ``kv_cache_dtype`` the values are stored as value / scale, saturated.
    """
    if (stream is None or type(stream) is int) and _core.reshape_and_cache_exchange(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, stream
    ):
        return
    check_writable(key_cache, "key_cache")
    check_writable(value_cache, "value_cache")
    k, bf_k = as_core(key)
    v, bf_v = as_core(value)
    kc, bf_kc = as_core(key_cache)
    vc, bf_vc = as_core(value_cache)
    handle = resolve_stream(stream, key) if (stream is not None or is_cuda(key)) else 0
    _core.reshape_and_cache(
        k, v, kc, vc, slot_mapping, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
        stream=handle, bf16_mask=bf_k | (bf_v << 1) | (bf_kc << 2) | (bf_vc << 3),
    )  # fmt: skip


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: Any, layout: str = "vllm"
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key_shape, value_shape) of a paged KV cache.

    ``dtype`` is the cache element type: a NumPy dtype or scalar type, a torch dtype,
    or a name ("float32", "float16", "bfloat16", "uint8", "fp8_e4m3", "fp8_e5m2").
    ``layout`` is "vllm" or "nhd" (see :func:`paged_attention`).
    """
    sizes = []
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                    ("head_size", head_size)):  # fmt: skip
        try:
            sizes.append(operator.index(v))
        except TypeError:
            raise TypeError(f"{name}: expected an integer, got {type(v).__name__} {v!r}") from None
    return _core.kv_cache_shape(*sizes, dtype_name(dtype), layout)


def supported() -> dict:
    """The supported dtypes, layouts, head sizes and block sizes."""
    return _core.supported()


def built_with_cuda() -> bool:
    """True when this installation contains the CUDA backend."""
    return bool(_core.with_cuda)
