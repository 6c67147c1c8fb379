"""Attention variants on the CPU: sliding_window, soft_cap and sinks, against the float64
reference, in the decode and varlen (chunked prefill) forms.

Each variant alone, every pair and all three together (with ALiBi), both layouts, every
dtype, fp8 caches, MHA and GQA. With a window, every cache slot before a sequence's window
holds NaN and the block-table entries of the blocks wholly before it are -1 (as the block
manager's release leaves them), so a kernel that reads outside the window shows. Then the
edges (W = 1, W past the context, INT_MAX; tiny and huge caps; -inf / +inf / NaN sinks),
the errors, the prepared call and the plan queries, and the block manager's
sliding-window release driving the kernels.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import pagedattn
from conftest import DTYPES, FP8_KV_CACHE_DTYPES, LAYOUTS, SUPPORTED, assert_close, dtype_id, make_problem
from pagedattn.reference import causal_attention, paged_attention_ref

INT_MAX = 2**31 - 1
NAN_FP8 = 0x7F  # NaN in both fp8 formats


# ---- problems ----------------------------------------------------------------------------


def poison_outside_window(p, window, q_lens=None):
    """NaN in every slot before each sequence's window (of its first query row) and -1 in
    the block-table entries of the blocks wholly before it. Returns the number of slots
    poisoned (so a test can tell the window did exclude something)."""
    if window <= 0:
        return 0
    kc, vc, bt = p.key_cache, p.value_cache, p.block_tables
    nhd = kc.ndim == 4
    bs = kc.shape[1] if nhd else kc.shape[3]
    nan = NAN_FP8 if kc.dtype == np.uint8 else np.nan
    poisoned = 0
    for i, length in enumerate(np.asarray(p.seq_lens).tolist()):
        q = 1 if q_lens is None else int(q_lens[i])
        start = max(0, length - q - window + 1)
        for t in range(start):
            b, off = int(bt[i, t // bs]), t % bs
            if nhd:
                kc[b, off] = nan
                vc[b, off] = nan
            else:
                kc[b, :, :, off, :] = nan
                vc[b, :, :, off] = nan
            poisoned += 1
        bt[i, : start // bs] = -1
    return poisoned


def make_varlen(rng, seq_lens, q_lens, *, dtype=np.float32, **kw):
    p = make_problem(rng, seq_lens, dtype=dtype, **kw)
    qsl = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)
    h, d = p.query.shape[1:]
    p.query = rng.standard_normal((int(qsl[-1]), h, d)).astype(dtype)
    return p, qsl


def make_fp8(rng, seq_lens, kind, *, dtype=np.float32, layout="vllm", k_scale=0.05, v_scale=0.03, **kw):
    """make_problem whose caches are fp8 (uint8) written by reshape_and_cache; other slots NaN."""
    p = make_problem(rng, seq_lens, dtype=dtype, layout=layout, **kw)
    bs, kh, d = kw.get("block_size", 16), kw.get("num_kv_heads", 2), kw.get("head_size", 64)
    kshape, vshape = pagedattn.kv_cache_shape(p.key_cache.shape[0], bs, kh, d, "uint8", layout)
    kc = np.full(kshape, NAN_FP8, np.uint8)
    vc = np.full(vshape, NAN_FP8, np.uint8)
    slots = (
        np.concatenate(
            [
                p.block_tables[i, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
                for i, n in enumerate(p.seq_lens)
            ]
        )
        if len(p.seq_lens)
        else np.zeros(0, np.int64)
    )
    k = (rng.standard_normal((len(slots), kh, d)) * 40 * k_scale).astype(dtype)
    v = (rng.standard_normal((len(slots), kh, d)) * 40 * v_scale).astype(dtype)
    pagedattn.reshape_and_cache(k, v, kc, vc, slots, kv_cache_dtype=kind, k_scale=k_scale, v_scale=v_scale)
    p.key_cache, p.value_cache = kc, vc
    return p, dict(kv_cache_dtype=kind, k_scale=k_scale, v_scale=v_scale)


def sinks_for(rng, num_heads):
    # around the logits' scale, one head far below (no effect) and one far above (most weight)
    s = rng.standard_normal(num_heads).astype(np.float32) * 2
    s[0] = -30.0
    s[-1] = 8.0
    return s


def run(p, qsl=None, *, alibi=True, **kw):
    """The CPU output and the float64 reference of one call."""
    if qsl is not None:
        kw["query_start_loc"] = qsl
    slopes = p.alibi_slopes if alibi else None
    out = pagedattn.paged_attention(*p.args(), alibi_slopes=slopes, **kw)
    ref = paged_attention_ref(*p.args(), alibi_slopes=slopes, **kw)
    return out, ref


VARIANTS = ["sliding_window", "soft_cap", "sinks"]


def variant_kw(rng, names, num_heads, window):
    kw = {}
    if "sliding_window" in names:
        kw["sliding_window"] = window
    if "soft_cap" in names:
        kw["soft_cap"] = 1.5
    if "sinks" in names:
        kw["sinks"] = sinks_for(rng, num_heads)
    return kw


# Every variant alone, every pair, all three.
COMBOS = [c for r in (1, 2, 3) for c in itertools.combinations(VARIANTS, r)]
DECODE_LENS = [0, 1, 15, 16, 17, 35, 300, 700]  # around blocks of 16; past a window of 37
# (seq_len, q_len): whole prompts, chunks, decode rows, q = 0, rows across a window's edge
VARLEN = [(0, 0), (1, 1), (17, 0), (16, 16), (33, 1), (65, 65), (130, 64), (257, 129), (300, 3), (520, 2)]


def test_supported_lists_the_variants():
    assert set(SUPPORTED["variants"]) == set(VARIANTS)
    doc = pagedattn.paged_attention.__doc__
    for name in SUPPORTED["variants"]:
        assert name in doc, name


@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_combinations(rng, combo, layout):
    p = make_problem(rng, DECODE_LENS, num_heads=8, num_kv_heads=2, head_size=64, layout=layout, alibi=True)
    kw = variant_kw(rng, combo, 8, window=37)
    if "sliding_window" in combo:
        assert poison_outside_window(p, 37) > 0
    out, ref = run(p, **kw)
    assert_close(out, ref, np.float32, f"{combo}")
    assert np.all(out[0] == 0), "a sequence of length 0 yields zeros"
    # each variant changes the answer (the test would not see a variant that is ignored)
    plain = paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes) if "sliding_window" not in combo else None
    if plain is not None:
        assert np.abs(plain[-1] - ref[-1]).max() > 1e-3


@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_combinations(rng, combo, layout):
    lens, qs = zip(*VARLEN)
    p, qsl = make_varlen(rng, lens, qs, num_heads=8, num_kv_heads=2, head_size=64, layout=layout, alibi=True)
    kw = variant_kw(rng, combo, 8, window=45)
    if "sliding_window" in combo:
        assert poison_outside_window(p, 45, qs) > 0
    out, ref = run(p, qsl, **kw)
    assert_close(out, ref, np.float32, f"{combo}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ["decode", "varlen"])
def test_all_three_every_dtype(rng, dtype, layout, form):
    kw = dict(sliding_window=21, soft_cap=3.0, sinks=sinks_for(rng, 8))
    if form == "decode":
        p = make_problem(rng, DECODE_LENS, num_heads=8, num_kv_heads=2, dtype=dtype, layout=layout, alibi=True)
        poison_outside_window(p, 21)
        out, ref = run(p, **kw)
    else:
        lens, qs = zip(*VARLEN)
        p, qsl = make_varlen(rng, lens, qs, num_heads=8, num_kv_heads=2, dtype=dtype, layout=layout, alibi=True)
        poison_outside_window(p, 21, qs)
        out, ref = run(p, qsl, **kw)
    assert out.dtype == np.dtype(dtype)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ["decode", "varlen"])
def test_fp8_caches(rng, kind, layout, form):
    kw = dict(sliding_window=30, soft_cap=2.0, sinks=sinks_for(rng, 8))
    lens, qs = ([5, 31, 64, 200], [5, 2, 40, 1]) if form == "varlen" else ([5, 31, 64, 200], None)
    p, fp8 = make_fp8(rng, lens, kind, layout=layout, num_heads=8, num_kv_heads=2, head_size=64, alibi=True)
    assert poison_outside_window(p, 30, qs) > 0
    if form == "varlen":
        qsl = np.concatenate([[0], np.cumsum(qs)]).astype(np.int32)
        p.query = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np.float32)
        out, ref = run(p, qsl, **kw, **fp8)
    else:
        out, ref = run(p, **kw, **fp8)
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (8, 2), (16, 2), (8, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("form", ["decode", "varlen"])
def test_mha_and_gqa(rng, heads, form):
    h, kh = heads
    kw = dict(sliding_window=19, soft_cap=4.0, sinks=sinks_for(rng, h))
    lens, qs = [300, 47, 257, 5], [300, 47, 33, 2]
    if form == "decode":
        p = make_problem(rng, lens, num_heads=h, num_kv_heads=kh, head_size=32, alibi=True)
        poison_outside_window(p, 19)
        out, ref = run(p, **kw)
    else:
        p, qsl = make_varlen(rng, lens, qs, num_heads=h, num_kv_heads=kh, head_size=32, alibi=True)
        poison_outside_window(p, 19, qs)
        out, ref = run(p, qsl, **kw)
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("head_size", [8, 12, 64, 72])  # the vector paths and the scalar ones
@pytest.mark.parametrize("block_size", [1, 3, 8, 16, 32])
def test_window_every_block_boundary(rng, head_size, block_size):
    """Windows starting at every offset inside a block, on vector and scalar paths."""
    lens = list(range(1, 3 * block_size + 3)) + [200]
    for window in (1, 2, block_size, block_size + 1, 3 * block_size - 1):
        p = make_problem(rng, lens, num_heads=4, num_kv_heads=2, head_size=head_size, block_size=block_size,
                         layout="nhd" if head_size % 8 else "vllm")  # fmt: skip
        poison_outside_window(p, window)
        out, ref = run(p, sliding_window=window)
        assert_close(out, ref, np.float32, f"window {window}")
        q = [min(n, 1 + (n % 7)) for n in lens]
        pv, qsl = make_varlen(rng, lens, q, num_heads=4, num_kv_heads=2, head_size=head_size,
                              block_size=block_size, layout="nhd" if head_size % 8 else "vllm")  # fmt: skip
        poison_outside_window(pv, window, q)
        out, ref = run(pv, qsl, sliding_window=window)
        assert_close(out, ref, np.float32, f"varlen window {window}")


def test_window_one_is_the_own_value(rng):
    """W = 1: every query sees only its own key, so the output is that token's value."""
    p = make_problem(rng, [1, 9, 40], num_heads=4, num_kv_heads=4, head_size=16, layout="nhd")
    poison_outside_window(p, 1)
    out = pagedattn.paged_attention(*p.args(), sliding_window=1)
    for i, n in enumerate(p.seq_lens.tolist()):
        b, off = p.block_tables[i, (n - 1) // 16], (n - 1) % 16
        np.testing.assert_allclose(out[i], p.value_cache[b, off], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [700, 701, 10_000, INT_MAX])
def test_window_past_the_context_is_no_window(rng, window):
    """A window covering the whole context reads everything and equals the plain call."""
    p = make_problem(rng, [0, 1, 100, 700], num_heads=8, num_kv_heads=2, alibi=True)
    plain = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes)
    np.testing.assert_array_equal(pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes,
                                                            sliding_window=window), plain)  # fmt: skip
    lens, qs = [100, 700], [100, 5]
    pv, qsl = make_varlen(rng, lens, qs, num_heads=8, num_kv_heads=2)
    plain = pagedattn.paged_attention(*pv.args(), query_start_loc=qsl)
    out = pagedattn.paged_attention(*pv.args(), query_start_loc=qsl, sliding_window=window)
    np.testing.assert_array_equal(out, plain)


def test_long_context_window(rng):
    """A 5000-token context (two decode chunks of 4096, several varlen folds) in a window."""
    p = make_problem(rng, [5000, 4100], num_heads=4, num_kv_heads=1, head_size=64, alibi=True)
    assert poison_outside_window(p, 4097) > 0
    out, ref = run(p, sliding_window=4097, soft_cap=5.0, sinks=np.array([0.5, -1, 2, 9], np.float32))
    assert_close(out, ref, np.float32)
    pv, qsl = make_varlen(rng, [5000, 4100], [300, 1], num_heads=4, num_kv_heads=1, head_size=64)
    poison_outside_window(pv, 1000, [300, 1])
    out, ref = run(pv, qsl, sliding_window=1000)
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("cap", [1e-3, 0.05, 30.0, 1e30])
def test_soft_cap_extremes(rng, cap):
    p = make_problem(rng, [1, 40, 300], num_heads=8, num_kv_heads=2, alibi=True)
    out, ref = run(p, soft_cap=cap)
    assert_close(out, ref, np.float32, f"cap {cap}")
    if cap == 1e30:  # tanh(x / c) * c = x: the plain call
        plain = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes)
        np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-6)
    lens, qs = [40, 300], [40, 7]
    pv, qsl = make_varlen(rng, lens, qs, num_heads=8, num_kv_heads=2, alibi=True)
    out, ref = run(pv, qsl, soft_cap=cap)
    assert_close(out, ref, np.float32, f"varlen cap {cap}")


def test_soft_cap_bounds_the_logits(rng):
    """With a tiny cap every logit is within +-cap: attention is almost uniform."""
    p = make_problem(rng, [64], num_heads=2, num_kv_heads=2, head_size=16, layout="nhd")
    p.query *= 100
    out = pagedattn.paged_attention(*p.args(), soft_cap=1e-4)
    vals = p.value_cache[p.block_tables[0, :4]].reshape(64, 2, 16)
    np.testing.assert_allclose(out[0], vals.mean(axis=0), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("form", ["decode", "varlen"])
def test_soft_cap_at_the_smallest_normal_float32_and_below(rng, form):
    """The kernels divide by the cap. The smallest normal float32 (1.18e-38) still caps every
    logit to about 0 (uniform attention, with zero queries too: 0 / cap = 0); a subnormal cap
    has no finite inverse (it gave NaN) and is refused, as is a cap float32 rounds to 0 (it
    would silently turn the cap off)."""
    tiny = float(np.finfo(np.float32).tiny)
    p = make_problem(rng, [64], num_heads=2, num_kv_heads=2, head_size=16, layout="nhd")
    p.query[:] = 0
    p.query[0, 1] *= 0  # a zero row: logit 0 / cap
    kw = {}
    if form == "varlen":
        kw = dict(query_start_loc=np.array([0, 1], np.int32), max_query_len=1)
    out = pagedattn.paged_attention(*p.args(), soft_cap=tiny, **kw)
    vals = p.value_cache[p.block_tables[0, :4]].reshape(64, 2, 16)
    np.testing.assert_allclose(out[0], vals.mean(axis=0), rtol=1e-5, atol=1e-6)
    for cap in (tiny / 2, 1e-40, float(np.finfo(np.float32).smallest_subnormal)):
        with pytest.raises(ValueError, match=r"soft_cap: must be 0 \(off\) or at least 1\.17549e-38.*got"):
            pagedattn.paged_attention(*p.args(), soft_cap=cap, **kw)
    with pytest.raises(ValueError, match=r"soft_cap: float 1e-50 is too small for float32"):
        pagedattn.paged_attention(*p.args(), soft_cap=1e-50, **kw)


@pytest.mark.parametrize("name", ["scale", "soft_cap", "k_scale"])
def test_a_number_outside_the_float32_range_is_a_value_error(rng, name):
    p = make_problem(rng, [5], num_heads=2, num_kv_heads=2, head_size=16, layout="nhd")
    with pytest.raises(ValueError, match=rf"{name}: int 1000000000.* is outside the float32 range"):
        pagedattn.paged_attention(*p.args(), **{name: 10**400})
    if name != "k_scale":  # (k_scale is read, and checked, with fp8 caches only)
        with pytest.raises(ValueError, match=rf"{name}: must be "):
            pagedattn.paged_attention(*p.args(), **{name: 1e39})  # inf in float32: "must be finite"


@pytest.mark.parametrize("form", ["decode", "varlen"])
def test_sink_values(rng, form):
    """-inf is no sink, +inf gives zeros, NaN gives NaN in that head only, a huge finite
    sink almost zeros; the others follow the reference."""
    lens, qs = [0, 1, 50, 300], [0, 1, 20, 3]
    if form == "decode":
        p = make_problem(rng, lens, num_heads=6, num_kv_heads=2, alibi=True)
        qsl = None
    else:
        p, qsl = make_varlen(rng, lens, qs, num_heads=6, num_kv_heads=2, alibi=True)
    sinks = np.array([-np.inf, np.inf, np.nan, 1e30, 0.0, -5.0], np.float32)
    kw = {} if qsl is None else dict(query_start_loc=qsl)
    out = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes, sinks=sinks, **kw)
    plain = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes, **kw)
    ref = paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes, sinks=sinks, **kw)
    rows = slice(1, None) if form == "decode" else slice(0, None)  # varlen: sequence 0 has no rows
    np.testing.assert_array_equal(out[rows, 0], plain[rows, 0])  # -inf: no sink
    assert np.all(out[rows, 1] == 0)  # +inf: all weight on the sink
    assert np.all(np.isnan(out[rows, 2]))  # NaN propagates, to its head only
    np.testing.assert_allclose(out[rows, 3], 0, atol=1e-30)
    assert_close(out[:, [0, 1, 3, 4, 5]], ref[:, [0, 1, 3, 4, 5]], np.float32)
    assert np.all(np.isnan(ref[rows, 2]))
    if form == "decode":
        assert np.all(out[0] == 0), "length 0: zeros, whatever the sink"


def test_sinks_in_the_denominator(rng):
    """One key: out = v * e^l / (e^l + e^sink), checked by hand."""
    p = make_problem(rng, [1], num_heads=2, num_kv_heads=1, head_size=16, layout="nhd")
    sinks = np.array([0.0, 2.0], np.float32)
    out = pagedattn.paged_attention(*p.args(), sinks=sinks, scale=0.1)
    k = p.key_cache[p.block_tables[0, 0], 0, 0].astype(np.float64)
    v = p.value_cache[p.block_tables[0, 0], 0, 0].astype(np.float64)
    for h in range(2):
        logit = 0.1 * p.query[0, h].astype(np.float64) @ k
        want = v * np.exp(logit) / (np.exp(logit) + np.exp(sinks[h]))
        np.testing.assert_allclose(out[0, h], want, rtol=1e-5, atol=1e-6)


def test_prepared_call_and_queries(rng):
    p = make_problem(rng, [10, 90, 300], num_heads=8, num_kv_heads=2, alibi=True)
    kw = dict(sliding_window=33, soft_cap=2.5, sinks=sinks_for(rng, 8))
    poison_outside_window(p, 33)
    prep = pagedattn.prepare_decode(*p.args(), alibi_slopes=p.alibi_slopes, **kw)
    first = np.array(prep())
    np.testing.assert_array_equal(first, pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes, **kw))
    assert_close(first, paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes, **kw), np.float32)
    # contents change between runs: a shorter sequence 2 moves its window back into a
    # released block (-1), which run() refuses; restored, it runs again
    p.seq_lens[2] = 283
    assert p.block_tables[2, (283 - 33) // 16] == -1
    with pytest.raises(IndexError, match=r"block_tables\[2, 15\] = -1"):
        prep()
    p.seq_lens[2] = 300
    np.testing.assert_array_equal(np.array(prep()), first)
    # the workspace and plan queries (CUDA builds: see test_cuda_variants) take the scalar variants
    for fn in (pagedattn.decode_workspace_size, pagedattn.decode_plan):
        assert "sliding_window" in fn.__doc__ and "soft_cap" in fn.__doc__ and "sinks" not in fn.__doc__


def test_window_block_ids_before_it_are_not_checked(rng):
    """Entries before the window may hold anything (released: -1, or huge); the entry of
    the window's first block is checked."""
    p = make_problem(rng, [100], num_heads=4, num_kv_heads=2)
    plain = paged_attention_ref(*p.args(), sliding_window=40)
    p.block_tables[0, :3] = [-1, 2**31 - 1, -7]  # blocks 0..2 (tokens 0..47); window from 60
    out = pagedattn.paged_attention(*p.args(), sliding_window=40)
    assert_close(out, plain, np.float32)
    p.block_tables[0, 3] = -1  # block 3 holds tokens 48..63: the window starts at 60
    with pytest.raises(IndexError, match=r"block_tables\[0, 3\] = -1"):
        pagedattn.paged_attention(*p.args(), sliding_window=40)
    # varlen: the first query row decides (rows at 90..99 see keys from 51)
    p.block_tables[0, 3] = -1
    q = rng.standard_normal((10, 4, 64)).astype(np.float32)
    with pytest.raises(IndexError, match=r"block_tables\[0, 3\]"):
        pagedattn.paged_attention(q, *p.args()[1:], query_start_loc=np.array([0, 10], np.int32), sliding_window=40)


# ---- errors ----------------------------------------------------------------------------


def test_errors(rng):
    p = make_problem(rng, [5, 20], num_heads=4, num_kv_heads=2)
    args = p.args()
    with pytest.raises(ValueError, match=r"sliding_window: must be >= 0.*got -1"):
        pagedattn.paged_attention(*args, sliding_window=-1)
    with pytest.raises(ValueError, match="sliding_window.*int32 range"):
        pagedattn.paged_attention(*args, sliding_window=2**31)
    with pytest.raises(TypeError, match="sliding_window: expected an integer"):
        pagedattn.paged_attention(*args, sliding_window=2.5)
    for bad in (-1.0, float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=r"soft_cap: must be a finite number >= 0"):
            pagedattn.paged_attention(*args, soft_cap=bad)
    with pytest.raises(TypeError, match="soft_cap: expected a float"):
        pagedattn.paged_attention(*args, soft_cap="big")
    with pytest.raises(TypeError, match="sinks: expected dtype float32, got float64"):
        pagedattn.paged_attention(*args, sinks=np.zeros(4))
    with pytest.raises(ValueError, match=r"sinks: dimension 0 \(num_heads\) must be 4, got 5"):
        pagedattn.paged_attention(*args, sinks=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"sinks: expected 1 dimensions"):
        pagedattn.paged_attention(*args, sinks=np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="sinks: must be C-contiguous"):
        pagedattn.paged_attention(*args, sinks=np.zeros(8, np.float32)[::2])
    with pytest.raises(TypeError, match="sinks"):
        pagedattn.paged_attention(*args, sinks=[0.0] * 4)
    out = np.zeros_like(p.query)
    with pytest.raises(ValueError, match="out overlaps sinks"):
        pagedattn.paged_attention(*args, out=out, sinks=out.reshape(-1)[:4])
    # the prepared call refuses the same
    with pytest.raises(ValueError, match="soft_cap"):
        pagedattn.prepare_decode(*args, soft_cap=-2.0)
    with pytest.raises(TypeError, match="sinks"):
        pagedattn.prepare_decode(*args, sinks=np.zeros(4, np.int32))


# ---- the block manager's sliding-window release --------------------------------------------


@pytest.mark.parametrize("pad", [-1, 0])
@pytest.mark.parametrize("window", [5, 8, 13])
def test_block_manager_window_release(rng, pad, window):
    """BlockManager(sliding_window=W) drives reshape_and_cache and paged_attention with the
    same W over chunked prefills and decodes. Every block the manager releases is filled
    with NaN at once, and the pool is small, so released blocks are reused by other
    sequences; the output must still match dense attention over each sequence's window
    (pad 0 makes released entries read back as block 0, a live block of someone else)."""
    num_blocks, bs, kh, h, d = 20, 4, 2, 4, 16
    m = pagedattn.BlockManager(num_blocks, bs, sliding_window=window)
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, bs, kh, d, np.float32, layout="nhd")
    kc = np.full(kshape, np.nan, np.float32)
    vc = np.full(vshape, np.nan, np.float32)
    dense_k, dense_v, owned = {}, {}, {}
    released_total = 0
    scale = 1.0 / np.sqrt(d)

    def step(ids, q_lens):
        nonlocal released_total
        md = m.step(ids, query_lens=q_lens, pad=pad)
        ks, vs = [], []
        for sid, q in zip(ids, np.diff(md.query_start_loc).tolist()):
            k = rng.standard_normal((q, kh, d))
            v = rng.standard_normal((q, kh, d))
            dense_k[sid] = np.concatenate([dense_k[sid], k])
            dense_v[sid] = np.concatenate([dense_v[sid], v])
            ks.append(k)
            vs.append(v)
        # the blocks released by this step: NaN now (a later allocation overwrites them)
        for sid in ids:
            now = set(b for b in m.block_table(sid) if b >= 0)
            for b in owned.get(sid, set()) - now:
                kc[b] = np.nan
                vc[b] = np.nan
                released_total += 1
            owned[sid] = now
        pagedattn.reshape_and_cache(np.concatenate(ks).astype(np.float32), np.concatenate(vs).astype(np.float32),
                                    kc, vc, md.slot_mapping)  # fmt: skip
        qsl = md.query_start_loc
        query = rng.standard_normal((int(qsl[-1]), h, d)).astype(np.float32)
        out = pagedattn.paged_attention(query, kc, vc, md.block_tables, md.seq_lens, query_start_loc=qsl,
                                        scale=scale, sliding_window=window)  # fmt: skip
        for i, sid in enumerate(ids):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            want = causal_attention(query[lo:hi], dense_k[sid], dense_v[sid], scale, sliding_window=window)
            np.testing.assert_allclose(out[lo:hi], want, rtol=2e-4, atol=2e-5, err_msg=f"seq {sid}")
        if all(q == 1 for q in np.diff(qsl).tolist()):  # a decode step: the decode form too
            out1 = pagedattn.paged_attention(query, kc, vc, md.block_tables, md.seq_lens, scale=scale,
                                             sliding_window=window)  # fmt: skip
            np.testing.assert_array_equal(out1, out)

    for sid, n in ((0, 23), (1, 9)):
        m.add_sequence_by_count(sid, n)
        dense_k[sid] = np.zeros((0, kh, d))
        dense_v[sid] = np.zeros((0, kh, d))
    step([0, 1], [10, 9])  # chunked prefill of 0, whole prompt of 1
    step([0], [13])  # the rest of 0
    for t in range(30):
        if t == 12:  # a third sequence arrives into blocks the window released
            m.add_sequence_by_count(2, 11)
            dense_k[2] = np.zeros((0, kh, d))
            dense_v[2] = np.zeros((0, kh, d))
            m.append_tokens_batch([0, 1], [1, 1])
            step([0, 1, 2], [1, 1, 11])
            continue
        ids = [0, 1] if t < 12 else [0, 1, 2]
        m.append_tokens_batch(ids, [1] * len(ids))
        step(ids, [1] * len(ids))
    assert released_total > 10, "the window released blocks"
