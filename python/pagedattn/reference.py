"""A slow, obviously-right float64 NumPy reference of the pagedattn API.

Used by the tests, by ``python -m pagedattn`` to check its results, and by users who
want to check their own integration. It shares no code with the compiled kernels.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = [
    "fp8_decode",
    "gather_kv",
    "dense_attention",
    "causal_attention",
    "paged_attention_ref",
    "reshape_and_cache_ref",
]


def _fp8_table(kind: str) -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    if kind == "fp8_e4m3":
        mbits, bias = 3, 7
    elif kind == "fp8_e5m2":
        mbits, bias = 2, 15
    else:
        raise ValueError(f"kv_cache_dtype: unknown fp8 kind {kind!r}")
    ebits = 7 - mbits
    e = (codes >> mbits) & ((1 << ebits) - 1)
    m = codes & ((1 << mbits) - 1)
    normal = (1.0 + m / (1 << mbits)) * np.exp2(e.astype(np.float64) - bias)
    sub = (m / (1 << mbits)) * np.exp2(1.0 - bias)
    val = np.where(e == 0, sub, normal)
    if kind == "fp8_e4m3":
        val = np.where((codes & 0x7F) == 0x7F, np.nan, val)
    else:
        val = np.where(e == 31, np.where(m == 0, np.inf, np.nan), val)
    return sign * val


def fp8_decode(codes: Any, kind: str) -> np.ndarray:
    """uint8 fp8 codes -> float64 values."""
    kind = "fp8_e4m3" if kind == "fp8" else kind
    return _fp8_table(kind)[np.asarray(codes, dtype=np.uint8)]


def _to_f64(cache: Any, kv_cache_dtype: str, scale: float) -> np.ndarray:
    if kv_cache_dtype == "auto":
        return np.asarray(cache).astype(np.float64)
    return fp8_decode(cache, kv_cache_dtype) * scale


def gather_kv(
    key_cache: Any,
    value_cache: Any,
    block_table: Any,
    seq_len: int,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    start: int = 0,
    layout: Optional[str] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Dense float64 keys and values [seq_len - start, K, D] of one sequence: positions
    start .. seq_len - 1 (the blocks before ``start``'s block are not read).

    The caches may be views with any block stride (NumPy indexes them as they are).
    ``layout`` None: "vllm" for a rank-5 key cache, "nhd" for a rank-4 one."""
    key_cache = np.asarray(key_cache)
    value_cache = np.asarray(value_cache)
    layout = _layout(key_cache, layout)
    if layout == "vllm":  # key [N, K, D/x, B, x], value [N, K, D, B]
        _, kh, dx, bs, x = key_cache.shape
        d = dx * x
    elif layout == "nhd":  # [N, B, K, D]
        _, bs, kh, d = key_cache.shape
    else:  # hnd: [N, K, B, D]
        _, kh, bs, d = key_cache.shape
    start = max(0, min(start, seq_len))
    first = start // bs
    n_blocks = -(-seq_len // bs) - first
    blocks = np.asarray(block_table)[first : first + n_blocks].astype(np.int64)
    kc = _to_f64(key_cache[blocks], kv_cache_dtype, k_scale)
    vc = _to_f64(value_cache[blocks], kv_cache_dtype, v_scale)
    if layout == "vllm":
        # [n, K, D/x, B, x] -> [n, B, K, D/x, x] -> [n*B, K, D]
        k = kc.transpose(0, 3, 1, 2, 4).reshape(n_blocks * bs, kh, d)
        v = vc.transpose(0, 3, 1, 2).reshape(n_blocks * bs, kh, d)
    elif layout == "hnd":  # [n, K, B, D] -> [n, B, K, D]
        k = kc.transpose(0, 2, 1, 3).reshape(n_blocks * bs, kh, d)
        v = vc.transpose(0, 2, 1, 3).reshape(n_blocks * bs, kh, d)
    else:
        k = kc.reshape(n_blocks * bs, kh, d)
        v = vc.reshape(n_blocks * bs, kh, d)
    skip = start - first * bs
    return k[skip : seq_len - first * bs], v[skip : seq_len - first * bs]


def _layout(key_cache: np.ndarray, layout: Optional[str]) -> str:
    if layout is None:
        return "vllm" if key_cache.ndim == 5 else "nhd"
    if layout not in ("vllm", "nhd", "hnd"):
        raise ValueError(f"layout: got {layout!r}, expected 'vllm', 'nhd' or 'hnd'")
    return layout


def _window_start(sliding_window: int, pos: int) -> int:
    """The first key position a query at ``pos`` sees (0 without a window)."""
    return max(0, pos - sliding_window + 1) if sliding_window > 0 else 0


def _attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    k_start: int,
    scale: float,
    alibi_slopes: Optional[Any],
    sliding_window: int,
    soft_cap: float,
    sinks: Optional[Any],
) -> np.ndarray:
    """q [n, H, D] at positions q_pos [n]; k / v [L, K, D] at positions k_start ..
    k_start + L - 1 -> [n, H, D]: causal, windowed, soft-capped, with ALiBi and sinks."""
    n, h, d = q.shape
    length, kh, _ = k.shape
    if n == 0 or length == 0:
        return np.zeros((n, h, d))
    group = h // kh
    kk = np.repeat(k, group, axis=1)  # [L, H, D]
    vv = np.repeat(v, group, axis=1)
    logits = np.einsum("nhd,lhd->hnl", q, kk) * scale
    if soft_cap:
        soft_cap = float(np.float32(soft_cap))  # the library holds the cap as float32
        logits = soft_cap * np.tanh(logits / soft_cap)
    rel = (k_start + np.arange(length))[None, :] - q_pos[:, None]  # [n, L]: t - p
    if alibi_slopes is not None:
        logits = logits + np.asarray(alibi_slopes, dtype=np.float64)[:, None, None] * rel[None]
    visible = rel <= 0
    if sliding_window > 0:
        visible &= rel > -sliding_window
    logits = np.where(visible[None], logits, -np.inf)
    top = logits.max(axis=2, keepdims=True)  # [H, n, 1]
    sink = None
    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[:, None, None], top.shape)
        with np.errstate(invalid="ignore"):
            # NaN sinks stay out of the max; a row without a finite logit stays NaN
            top = np.where(np.isfinite(top) & (sink > top), sink, top)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(logits - top)
        den = p.sum(axis=2, keepdims=True)
        if sink is not None:
            extra = np.where(sink == -np.inf, 0.0, np.exp(sink - top))
            extra = np.where(np.isposinf(sink), np.inf, extra)  # +inf takes all the weight
            den = den + extra
        out = np.einsum("hnl,lhd->nhd", p / den, vv)
    return out


def dense_attention(
    q: Any,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    alibi_slopes: Optional[Any] = None,
    *,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: Optional[Any] = None,
    k_start: int = 0,
) -> np.ndarray:
    """Single-token attention: q [H, D], k / v [L, K, D] -> [H, D], float64. The keys sit
    at positions k_start .. k_start + L - 1 and the query at the last of them."""
    q = np.asarray(q).astype(np.float64)
    length = k_start + k.shape[0]
    return _attend(
        q[None], k, v, np.array([length - 1]), k_start, scale, alibi_slopes, sliding_window, soft_cap, sinks
    )[0]


def causal_attention(
    q: Any,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    alibi_slopes: Optional[Any] = None,
    *,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: Optional[Any] = None,
    k_start: int = 0,
) -> np.ndarray:
    """The last n tokens of a sequence attending causally: q [n, H, D], k / v [L, K, D]
    (n <= L) -> [n, H, D], float64. The keys sit at positions k_start .. k_start + L - 1;
    row j at position k_start + L - n + j sees keys max(0, p - sliding_window + 1) .. p."""
    q = np.asarray(q).astype(np.float64)
    n = q.shape[0]
    length = k_start + k.shape[0]
    q_pos = np.arange(length - n, length)
    return _attend(q, k, v, q_pos, k_start, scale, alibi_slopes, sliding_window, soft_cap, sinks)


def paged_attention_ref(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: Optional[float] = None,
    alibi_slopes: Optional[Any] = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    query_start_loc: Optional[Any] = None,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: Optional[Any] = None,
    layout: Optional[str] = None,
) -> np.ndarray:
    """float64 reference of :func:`pagedattn.paged_attention`: [S, H, D], or [T, H, D]
    with ``query_start_loc`` (each sequence's rows are its last tokens, causal).

    Variants: ``sliding_window`` (tokens, 0 = off), ``soft_cap`` (0 = off), ``sinks``
    (float [H]). Keys before a sequence's window are never read (their blocks may hold
    anything, or be released: -1 in the table). ``layout`` as in :func:`gather_kv`."""
    query = np.asarray(query).astype(np.float64)
    s, h, d = query.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((s, h, d))
    variants = dict(sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    rows = (
        [(int(a), int(b)) for a, b in zip(np.asarray(query_start_loc)[:-1], np.asarray(query_start_loc)[1:])]
        if query_start_loc is not None
        else [(i, i + 1) for i in range(s)]
    )
    for i, (lo, hi) in enumerate(rows):
        length = int(seq_lens[i])
        start = _window_start(sliding_window, length - (hi - lo))
        k, v = gather_kv(
            key_cache, value_cache, block_tables[i], length,
            kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, start=start, layout=layout,
        )  # fmt: skip
        out[lo:hi] = causal_attention(query[lo:hi], k, v, scale, alibi_slopes, k_start=start, **variants)
    return out


def reshape_and_cache_ref(key: Any, value: Any, key_cache: np.ndarray, value_cache: np.ndarray, slot_mapping: Any,
                          layout: Optional[str] = None):  # fmt: skip
    """In-place NumPy version of :func:`pagedattn.reshape_and_cache` (kv_cache_dtype "auto");
    the caches may be strided views."""
    key = np.asarray(key)
    value = np.asarray(value)
    layout = _layout(key_cache, layout)
    for t, slot in enumerate(np.asarray(slot_mapping).tolist()):
        if slot < 0:
            continue
        if layout == "hnd":
            b, off = divmod(slot, key_cache.shape[2])
            key_cache[b, :, off] = key[t]
            value_cache[b, :, off] = value[t]
        elif layout == "vllm":
            _, _, dx, bs, x = key_cache.shape
            b, off = divmod(slot, bs)
            key_cache[b, :, :, off, :] = key[t].reshape(key.shape[1], dx, x)
            value_cache[b, :, :, off] = value[t]
        else:
            bs = key_cache.shape[1]
            b, off = divmod(slot, bs)
            key_cache[b, off] = key[t]
            value_cache[b, off] = value[t]
