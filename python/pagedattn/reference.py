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
    layout: Optional[str] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Dense float64 keys and values [seq_len, K, D] of one sequence.

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
    n_blocks = -(-seq_len // bs)
    blocks = np.asarray(block_table)[:n_blocks].astype(np.int64)
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
    return k[:seq_len], v[:seq_len]


def _layout(key_cache: np.ndarray, layout: Optional[str]) -> str:
    if layout is None:
        return "vllm" if key_cache.ndim == 5 else "nhd"
    if layout not in ("vllm", "nhd", "hnd"):
        raise ValueError(f"layout: got {layout!r}, expected 'vllm', 'nhd' or 'hnd'")
    return layout


def dense_attention(
    q: Any, k: np.ndarray, v: np.ndarray, scale: float, alibi_slopes: Optional[Any] = None
) -> np.ndarray:
    """Single-token attention: q [H, D], k / v [L, K, D] -> [H, D], float64."""
    q = np.asarray(q).astype(np.float64)
    h, d = q.shape
    length, kh, _ = k.shape
    if length == 0:
        return np.zeros((h, d))
    group = h // kh
    kk = np.repeat(k, group, axis=1)  # [L, H, D]
    vv = np.repeat(v, group, axis=1)
    logits = np.einsum("hd,lhd->hl", q, kk) * scale
    if alibi_slopes is not None:
        pos = np.arange(length) - length + 1
        logits = logits + np.asarray(alibi_slopes, dtype=np.float64)[:, None] * pos[None, :]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hl,lhd->hd", p, vv)


def causal_attention(
    q: Any, k: np.ndarray, v: np.ndarray, scale: float, alibi_slopes: Optional[Any] = None
) -> np.ndarray:
    """The last n tokens of a sequence attending causally: q [n, H, D], k / v [L, K, D]
    (n <= L) -> [n, H, D], float64. Row j sits at position L - n + j and sees keys 0 .. it."""
    q = np.asarray(q).astype(np.float64)
    n, h, d = q.shape
    length, kh, _ = k.shape
    if n == 0:
        return np.zeros((0, h, d))
    group = h // kh
    kk = np.repeat(k, group, axis=1)  # [L, H, D]
    vv = np.repeat(v, group, axis=1)
    logits = np.einsum("nhd,lhd->hnl", q, kk) * scale
    pos = np.arange(length - n, length)  # each row's own position
    rel = np.arange(length)[None, :] - pos[:, None]  # [n, L]: t - p
    if alibi_slopes is not None:
        logits = logits + np.asarray(alibi_slopes, dtype=np.float64)[:, None, None] * rel[None]
    logits = np.where(rel[None] <= 0, logits, -np.inf)
    logits -= logits.max(axis=2, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=2, keepdims=True)
    return np.einsum("hnl,lhd->nhd", p, vv)


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
    layout: Optional[str] = None,
) -> np.ndarray:
    """float64 reference of :func:`pagedattn.paged_attention`: [S, H, D], or [T, H, D]
    with ``query_start_loc`` (each sequence's rows are its last tokens, causal)."""
    kv = {"kv_cache_dtype": kv_cache_dtype, "k_scale": k_scale, "v_scale": v_scale, "layout": layout}
    query = np.asarray(query).astype(np.float64)
    s, h, d = query.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((s, h, d))
    if query_start_loc is not None:
        qsl = np.asarray(query_start_loc).astype(np.int64)
        for i in range(len(qsl) - 1):
            lo, hi, length = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            k, v = gather_kv(key_cache, value_cache, block_tables[i], length, **kv)
            out[lo:hi] = causal_attention(query[lo:hi], k, v, scale, alibi_slopes)
        return out
    for i in range(s):
        length = int(seq_lens[i])
        k, v = gather_kv(key_cache, value_cache, block_tables[i], length, **kv)
        out[i] = dense_attention(query[i], k, v, scale, alibi_slopes)
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
