"""Varlen paged attention on the CPU (query_start_loc: chunked prefill and mixed batches)
against the float64 causal reference, with NaN in every cache slot no sequence owns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pagedattn
from conftest import BF16, DTYPES, FP8_KV_CACHE_DTYPES, LAYOUTS, assert_close, dtype_id, make_problem
from pagedattn.reference import causal_attention, paged_attention_ref


def make_varlen(rng, seq_lens, q_lens, *, dtype=np.float32, **kw):
    """A make_problem cache plus a [T, H, D] query and its query_start_loc."""
    assert len(seq_lens) == len(q_lens) and all(0 <= q <= n for q, n in zip(q_lens, seq_lens))
    p = make_problem(rng, seq_lens, dtype=dtype, **kw)
    qsl = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)
    h, d = p.query.shape[1:]
    p.query = rng.standard_normal((int(qsl[-1]), h, d)).astype(dtype)
    return p, qsl


def check(p, qsl, dtype, **kw):
    out = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes, query_start_loc=qsl, **kw)
    ref = paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes, query_start_loc=qsl, scale=kw.get("scale"))
    assert out.shape == p.query.shape and out.dtype == np.dtype(dtype)
    assert_close(out, ref, dtype)
    return out


# A mixed batch around the interesting boundaries for block size 16 and a group of 4
# (64 query tokens per tile; keys in chunks of 64, folded to float64 every 256): q = 0,
# q = 1, q = seq_len, tiles of 63 / 64 / 65 rows, contexts crossing chunk and fold edges.
MIXED = [  # (seq_len, q_len)
    (0, 0), (1, 1), (17, 0), (16, 16), (33, 1), (15, 15), (65, 65), (130, 64),
    (257, 129), (300, 3), (64, 63), (520, 2),
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_batch(rng, dtype, layout):
    lens, qs = zip(*MIXED)
    p, qsl = make_varlen(rng, lens, qs, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype, layout=layout)
    check(p, qsl, dtype)


@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (8, 2), (16, 2), (12, 12)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_query(rng, heads, layout):
    """GQA groups 1, 2, 4, 8 (the tile holds 256 / group tokens: 32 .. 256 here)."""
    lens = [300, 47, 257, 5]
    qs = [300, 47, 33, 2]
    p, qsl = make_varlen(rng, lens, qs, num_heads=heads[0], num_kv_heads=heads[1], head_size=32, layout=layout)
    check(p, qsl, np.float32)


def test_random_batches(rng):
    """Random lengths and query lengths (with zeros, ones and whole prompts) each run."""
    for _ in range(6):
        s = int(rng.integers(1, 7))
        lens = rng.integers(0, 400, size=s)
        qs = [int(rng.choice([0, 1, n, rng.integers(0, n + 1)])) if n else 0 for n in lens]
        block = int(rng.choice([8, 16, 32]))
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        layout = LAYOUTS[int(rng.integers(len(LAYOUTS)))]
        g = int(rng.choice([1, 2, 4, 8]))
        p, qsl = make_varlen(rng, lens, qs, num_heads=2 * g, num_kv_heads=2, head_size=64, block_size=block,
                             dtype=dtype, layout=layout)  # fmt: skip
        check(p, qsl, dtype)


@pytest.mark.parametrize("head_size", [8, 16, 40, 64, 72, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_head_sizes_vllm(rng, head_size, dtype):
    p, qsl = make_varlen(rng, [70, 9], [40, 9], num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype)
    check(p, qsl, dtype)


@pytest.mark.parametrize(("head_size", "block_size"), [(5, 1), (7, 3), (33, 16), (64, 100), (130, 7), (2, 128)])
def test_any_head_and_block_size_nhd(rng, head_size, block_size):
    """nhd takes any head size and block size: odd ones, blocks larger than a key chunk."""
    for dtype in DTYPES:
        p, qsl = make_varlen(rng, [230, 19, 1], [230, 5, 1], num_heads=4, num_kv_heads=2, head_size=head_size,
                             block_size=block_size, dtype=dtype, layout="nhd")  # fmt: skip
        check(p, qsl, dtype)


@pytest.mark.parametrize("block_size", [1, 3, 8, 32, 64, 256])
def test_block_sizes_vllm(rng, block_size):
    """Blocks smaller than, equal to and larger than a key chunk; an odd size splits the
    bfloat16 path's key pairs across blocks."""
    for dtype in DTYPES:
        p, qsl = make_varlen(rng, [300, 65], [130, 65], num_heads=4, num_kv_heads=1, head_size=32,
                             block_size=block_size, dtype=dtype)  # fmt: skip
        check(p, qsl, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_alibi(rng, layout, dtype):
    p, qsl = make_varlen(rng, [1, 90, 300], [1, 90, 70], num_heads=8, num_kv_heads=4, layout=layout, alibi=True,
                         dtype=dtype)  # fmt: skip
    out = check(p, qsl, dtype)
    without = pagedattn.paged_attention(*p.args(), query_start_loc=qsl)
    assert not np.allclose(out.astype(np.float32), without.astype(np.float32))


def test_explicit_scale(rng):
    p, qsl = make_varlen(rng, [40, 77], [40, 20], num_heads=4, num_kv_heads=1)
    check(p, qsl, np.float32, scale=0.37)
    if BF16 is not None:
        p, qsl = make_varlen(rng, [40, 77], [40, 20], num_heads=4, num_kv_heads=1, dtype=BF16)
        check(p, qsl, BF16, scale=0.05)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_query_and_out(rng, layout):
    """Query and out views with row strides (slices of wider arrays) are read and written
    in place; the padding between rows is left alone."""
    for dtype in DTYPES:
        p, qsl = make_varlen(rng, [100, 3, 70], [100, 1, 35], num_heads=8, num_kv_heads=2, layout=layout, dtype=dtype)
        t, h, d = p.query.shape
        wide_q = np.full((t, 2 * h, d), np.nan, dtype=dtype)
        wide_q[:, ::2] = p.query
        wide_out = np.full((t, h + 3, d), -7, dtype=dtype)
        out_view = wide_out[:, 1 : h + 1]
        got = pagedattn.paged_attention(wide_q[:, ::2], p.key_cache, p.value_cache, p.block_tables, p.seq_lens,
                                        query_start_loc=qsl, out=out_view)  # fmt: skip
        assert got is out_view
        assert_close(out_view, paged_attention_ref(*p.args(), query_start_loc=qsl), dtype)
        assert (wide_out[:, 0] == -7).all() and (wide_out[:, h + 1 :] == -7).all()


def test_out_rows_of_empty_sequences_untouched(rng):
    """A sequence with q_i = 0 owns no rows; every row belongs to some sequence, so an out=
    filled with NaN comes back finite everywhere."""
    p, qsl = make_varlen(rng, [0, 20, 5, 0], [0, 20, 0, 0], num_heads=4, num_kv_heads=2)
    out = np.full(p.query.shape, np.nan, np.float32)
    pagedattn.paged_attention(*p.args(), query_start_loc=qsl, out=out)
    assert_close(out, paged_attention_ref(*p.args(), query_start_loc=qsl), np.float32)


def test_no_rows_at_all(rng):
    p, qsl = make_varlen(rng, [5, 0], [0, 0], num_heads=4, num_kv_heads=2)
    out = pagedattn.paged_attention(*p.args(), query_start_loc=qsl)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_cache(rng, kind, layout):
    """fp8 caches written by reshape_and_cache (0x7f, NaN in both formats, elsewhere) and read
    by the varlen path with scales."""
    b, kh, h, d = 16, 2, 8, 64
    lens = np.array([1, 70, 16, 130], dtype=np.int32)
    qs = [1, 70, 3, 66]
    need = -(-lens // b)
    num_blocks = int(need.sum()) + 2
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, b, kh, d, kind, layout)
    key_cache = np.full(kshape, 0x7F, dtype=np.uint8)
    value_cache = np.full(vshape, 0x7F, dtype=np.uint8)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(lens), int(need.max()) + 1), perm[-1], dtype=np.int32)
    pos, slots = 0, []
    for i, n in enumerate(need):
        tables[i, :n] = perm[pos : pos + n]
        pos += n
        t = np.arange(lens[i])
        slots.append(tables[i, t // b].astype(np.int64) * b + t % b)
    slots = np.concatenate(slots)
    for dtype in [np.float32, np.float16] + ([BF16] if BF16 is not None else []):
        key = (rng.standard_normal((len(slots), kh, d)) * 3).astype(dtype)
        value = rng.standard_normal((len(slots), kh, d)).astype(dtype)
        pagedattn.reshape_and_cache(key, value, key_cache, value_cache, slots, kv_cache_dtype=kind,
                                    k_scale=0.05, v_scale=0.02)  # fmt: skip
        qsl = np.concatenate([[0], np.cumsum(qs)]).astype(np.int32)
        query = rng.standard_normal((int(qsl[-1]), h, d)).astype(dtype)
        kw = dict(kv_cache_dtype=kind, k_scale=0.05, v_scale=0.02, query_start_loc=qsl)
        out = pagedattn.paged_attention(query, key_cache, value_cache, tables, lens, **kw)
        assert_close(out, paged_attention_ref(query, key_cache, value_cache, tables, lens, **kw), dtype)


def test_single_rows_equal_the_decode_call(rng):
    """Every q_i = 1: the same numbers as the decode form, exactly."""
    for dtype in DTYPES:
        for layout in LAYOUTS:
            p = make_problem(rng, [1, 17, 300, 64], num_heads=8, num_kv_heads=2, dtype=dtype, layout=layout,
                             alibi=True)  # fmt: skip
            qsl = np.arange(len(p.seq_lens) + 1, dtype=np.int32)
            decode = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes)
            varlen = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes, query_start_loc=qsl)
            np.testing.assert_array_equal(varlen, decode)


def test_decode_rows_of_a_mixed_batch_match_decode(rng):
    """In a mixed batch a sequence with one query row gets the decode call's answer (to
    float32 rounding: a different but equally accurate summation order)."""
    p, qsl = make_varlen(rng, [300, 41, 200], [1, 41, 1], num_heads=8, num_kv_heads=2)
    mixed = pagedattn.paged_attention(*p.args(), query_start_loc=qsl)
    rows = qsl[[0, 2]]
    decode = pagedattn.paged_attention(p.query[rows], p.key_cache, p.value_cache, p.block_tables[[0, 2]],
                                       p.seq_lens[[0, 2]])  # fmt: skip
    np.testing.assert_allclose(mixed[rows], decode, rtol=2e-5, atol=2e-6)


def test_long_context_stays_accurate(rng):
    """A chunk of 320 rows at the end of a 16384-token context: float32 accumulation with
    the float64 fold keeps every element at the float32 tolerance (no growth with length)."""
    p, qsl = make_varlen(rng, [16384], [320], num_heads=4, num_kv_heads=1, head_size=64, dtype=np.float32,
                         layout="nhd")  # fmt: skip
    check(p, qsl, np.float32)
    if BF16 is not None:
        p, qsl = make_varlen(rng, [16384], [96], num_heads=4, num_kv_heads=1, head_size=64, dtype=BF16)
        check(p, qsl, BF16)


@pytest.mark.parametrize(("token", "window"), [(120, 0), (140, 64)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_a_token_stays_out_of_other_tiles(rng, dtype, layout, token, window):
    """A prompt of five tiles per KV head (64 tokens each with a group of 4, counted from
    the last row: [236, 300), [172, 236), [108, 172), [44, 108), [0, 44)), whose context
    is converted once for all of them, in chunks that straddle the tiles' edges. NaN
    written as one token's key and value stays inside the tiles that attend to it: the
    tiles before it, and with a window the tile whose windows have passed it, are exact,
    though the shared chunk holding the token is read by them."""
    n, d = 300, 64
    p, qsl = make_varlen(rng, [n], [n], num_heads=8, num_kv_heads=2, head_size=d, dtype=dtype, layout=layout)
    ref = paged_attention_ref(*p.args(), query_start_loc=qsl, sliding_window=window)
    nan = np.full((1, 2, d), np.nan, dtype)
    slot = np.array([p.block_tables[0, token // 16] * 16 + token % 16], np.int64)
    pagedattn.reference.reshape_and_cache_ref(nan, nan, p.key_cache, p.value_cache, slot, layout=layout)
    out = pagedattn.paged_attention(*p.args(), query_start_loc=qsl, sliding_window=window)
    rows = np.arange(n)
    clean = (rows < 108) | ((window > 0) & (rows >= 236))
    assert_close(out[clean], ref[clean], dtype)
    # the rows that attend to the token do take its NaN
    sees = (rows >= token) & ((window == 0) | (rows - window + 1 <= token))
    assert np.isnan(out[sees].astype(np.float64)).all()


def test_matches_dense_causal_attention(rng):
    """A whole prompt: the rows of paged_attention(query_start_loc) equal causal attention
    over the unpaged K / V (what the cache was written from)."""
    b, k, h, d, n = 16, 2, 8, 64, 200
    kshape, vshape = pagedattn.kv_cache_shape(20, b, k, d, np.float32, "vllm")
    kc = np.full(kshape, np.nan, np.float32)
    vc = np.full(vshape, np.nan, np.float32)
    table = rng.permutation(20)[: -(-n // b)].astype(np.int32)[None]
    keys = rng.standard_normal((n, k, d)).astype(np.float32)
    values = rng.standard_normal((n, k, d)).astype(np.float32)
    t = np.arange(n)
    pagedattn.reshape_and_cache(keys, values, kc, vc, table[0, t // b].astype(np.int64) * b + t % b)
    q = rng.standard_normal((n, h, d)).astype(np.float32)
    lens, qsl = np.array([n], np.int32), np.array([0, n], np.int32)
    out = pagedattn.paged_attention(q, kc, vc, table, lens, query_start_loc=qsl)
    ref = causal_attention(q.astype(np.float64), keys.astype(np.float64), values.astype(np.float64), 1 / np.sqrt(d))
    assert_close(out, ref, np.float32)


def test_concurrent_calls_from_threads(rng):
    """Host threads calling at once, each on its own problem: one call holds the conversion
    buffer the process keeps, the others convert into buffers of their own, and every
    output is bit for bit that thread's call alone (a shared buffer would mix the threads'
    contexts)."""
    import threading

    problems = [make_varlen(rng, [600, 300], [600, 300], num_heads=8, num_kv_heads=2, head_size=64)
                for _ in range(3)]  # fmt: skip
    alone = []
    for p, qsl in problems:
        alone.append(check(p, qsl, np.float32))
    outs = [[] for _ in problems]
    errors = []

    def work(i):
        p, qsl = problems[i]
        try:
            for _ in range(6):
                outs[i].append(pagedattn.paged_attention(*p.args(), query_start_loc=qsl))
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, mine in enumerate(outs):
        assert len(mine) == 6
        for out in mine:
            np.testing.assert_array_equal(out, alone[i])


def run_in_fresh_interpreter(rng, script, **env):
    """Runs script (argv: this folder, a seed) in a new interpreter with the environment
    variables env set (the library reads them once per process); it must print ok."""
    r = subprocess.run([sys.executable, "-c", script, os.path.dirname(os.path.abspath(__file__)),
                        str(rng.integers(2**31))],
                       env=dict(os.environ, **env), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@pytest.mark.parametrize("budget", ["0", "200000"])
def test_shared_context_budget(rng, budget):
    """PAGEDATTN_CPU_SHARED_BYTES caps the context converted ahead at once. At 0 every tile
    reads its own chunks; at 200 kB (32 kB a chunk of 64 keys here) the 300-token groups
    share theirs in several waves and the 1000-token groups (512 kB each) do not. Either
    way, every dtype, layout and window gives the float64 numbers."""
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        sys.path.insert(0, sys.argv[1])
        from conftest import DTYPES, LAYOUTS, assert_close
        from test_prefill import MIXED, make_varlen
        from pagedattn.reference import paged_attention_ref
        import pagedattn
        rng = np.random.default_rng(int(sys.argv[2]))
        lens, qs = zip(*(MIXED + [(300, 300), (1000, 200), (300, 150)]))
        for dtype in DTYPES:
            for layout in LAYOUTS:
                for window in (0, 100):
                    p, qsl = make_varlen(rng, lens, qs, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype,
                                         layout=layout)
                    out = pagedattn.paged_attention(*p.args(), query_start_loc=qsl, sliding_window=window)
                    ref = paged_attention_ref(*p.args(), query_start_loc=qsl, sliding_window=window)
                    assert_close(out, ref, dtype, f"{dtype} {layout} window={window}")
        print("ok")
        """
    )
    run_in_fresh_interpreter(rng, script, PAGEDATTN_CPU_SHARED_BYTES=budget)


# --------------------------------------------------------------------------------------
# Every instruction-set variant of the inner loops (picked once per process, so each runs
# in its own interpreter).
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "generic"])
def test_instruction_set_variants(rng, isa):
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        sys.path.insert(0, sys.argv[1])
        from conftest import BF16, DTYPES, LAYOUTS, assert_close
        from test_prefill import MIXED, make_varlen
        from pagedattn.reference import paged_attention_ref
        import pagedattn
        rng = np.random.default_rng(int(sys.argv[2]))
        lens, qs = zip(*MIXED)
        for dtype in DTYPES:
            for layout in LAYOUTS:
                for alibi in (False, True):
                    p, qsl = make_varlen(rng, lens, qs, num_heads=8, num_kv_heads=2, head_size=40 if layout == "nhd"
                                         else 64, dtype=dtype, layout=layout, alibi=alibi)
                    out = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes, query_start_loc=qsl)
                    ref = paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes, query_start_loc=qsl)
                    assert_close(out, ref, dtype, f"{dtype} {layout} alibi={alibi}")
        print("ok")
        """
    )
    run_in_fresh_interpreter(rng, script, PAGEDATTN_CPU_ISA=isa)


# --------------------------------------------------------------------------------------
# The prepared call.
# --------------------------------------------------------------------------------------
def test_prepared_call_reruns_with_new_contents(rng):
    p, qsl = make_varlen(rng, [40, 17, 90], [40, 1, 30], num_heads=8, num_kv_heads=2, dtype=np.float16,
                         extra_blocks=6)  # fmt: skip
    prepared = pagedattn.prepare_decode(*p.args(), query_start_loc=qsl)
    assert isinstance(prepared, pagedattn.PreparedDecode)
    out = prepared.run()
    assert out is prepared.out and out.shape == p.query.shape
    assert_close(out, paged_attention_ref(*p.args(), query_start_loc=qsl), np.float16)
    # New query rows, shorter sequences, a different split of the same 71 rows.
    p.query[...] = rng.standard_normal(p.query.shape).astype(np.float16)
    p.seq_lens[...] = [30, 17, 24]
    qsl[...] = [0, 30, 47, 71]
    assert_close(prepared(), paged_attention_ref(*p.args(), query_start_loc=qsl), np.float16)
    # Contents that became invalid are caught on the host by run(), before any work.
    prepared.out[...] = 0
    for bad, match in [
        ([0, 31, 47, 71], r"sequence 0 has 31 query rows .* seq_lens\[0\] = 30"),
        ([0, 30, 29, 71], "non-decreasing"),
        ([1, 30, 47, 71], r"query_start_loc\[0\]: must be 0"),
        ([0, 30, 47, 70], r"query_start_loc\[3\]: must equal the query's num_tokens 71"),
    ]:
        qsl[...] = bad
        with pytest.raises(ValueError, match=match):
            prepared.run()
    assert (prepared.out == 0).all()
    qsl[...] = [0, 30, 47, 71]
    p.block_tables[2, 0] = 10**6
    with pytest.raises(IndexError, match=r"block_tables\[2, 0\]"):
        prepared.run()


def test_prepared_call_checks_max_query_len_on_run(rng):
    p, qsl = make_varlen(rng, [40, 20], [10, 20], num_heads=4, num_kv_heads=2)
    prepared = pagedattn.prepare_decode(*p.args(), query_start_loc=qsl, max_query_len=20)
    assert_close(prepared.run(), paged_attention_ref(*p.args(), query_start_loc=qsl), np.float32)
    qsl[...] = [0, 21, 30]
    p.seq_lens[...] = [40, 20]
    with pytest.raises(ValueError, match="max_query_len: 20 is smaller than sequence 0's 21"):
        prepared.run()


# --------------------------------------------------------------------------------------
# Misuse: typed errors naming the argument.
# --------------------------------------------------------------------------------------
def _problem(rng):
    return make_varlen(rng, [10, 20], [4, 6], num_heads=4, num_kv_heads=2)


def test_query_start_loc_shape_and_dtype(rng):
    p, qsl = _problem(rng)
    with pytest.raises(ValueError, match="query_start_loc"):
        pagedattn.paged_attention(*p.args(), query_start_loc=qsl[None])
    with pytest.raises(TypeError, match="query_start_loc.*int32"):
        pagedattn.paged_attention(*p.args(), query_start_loc=qsl.astype(np.int64))
    with pytest.raises(ValueError, match="query_start_loc"):
        pagedattn.paged_attention(*p.args(), query_start_loc=np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="query_start_loc"):  # 3 entries = 2 sequences
        pagedattn.paged_attention(*p.args(), query_start_loc=np.array([0, 10], np.int32))
    with pytest.raises(ValueError, match="query_start_loc"):
        pagedattn.paged_attention(*p.args(), query_start_loc=np.array([0, 4, 6, 10], np.int32)[::2])


@pytest.mark.parametrize(
    ("qsl", "match"),
    [
        ([1, 4, 10], r"query_start_loc\[0\]: must be 0, got 1"),
        ([0, 7, 6], r"non-decreasing, got query_start_loc\[1\] = 7 > query_start_loc\[2\] = 6"),
        ([0, 4, 9], r"query_start_loc\[2\]: must equal the query's num_tokens 10, got 9"),
        ([0, 11, 10], r"sequence 0 has 11 query rows .* seq_lens\[0\] = 10"),
        ([0, -1, 10], r"non-decreasing"),
        ([0, -(2**31), 10], r"query_start_loc"),
        ([0, 2**31 - 1, 10], r"query_start_loc"),
    ],
)
def test_query_start_loc_contents(rng, qsl, match):
    p, _ = _problem(rng)
    with pytest.raises(ValueError, match=match):
        pagedattn.paged_attention(*p.args(), query_start_loc=np.array(qsl, np.int32))


def test_all_rows_to_one_sequence(rng):
    p, _ = _problem(rng)
    qsl = np.array([0, 0, 10], np.int32)  # none for the 10-token sequence, 10 of the 20
    out = pagedattn.paged_attention(*p.args(), query_start_loc=qsl)
    assert_close(out, paged_attention_ref(*p.args(), query_start_loc=qsl), np.float32)


def test_query_longer_than_sequence(rng):
    p, _ = make_varlen(rng, [3, 20], [3, 6], num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"sequence 0 has 4 query rows .* seq_lens\[0\] = 3"):
        pagedattn.paged_attention(*p.args(), query_start_loc=np.array([0, 4, 9], np.int32))


def test_max_query_len(rng):
    p, qsl = _problem(rng)
    ref = paged_attention_ref(*p.args(), query_start_loc=qsl)
    for ok in (6, 7, 10**6):
        assert_close(pagedattn.paged_attention(*p.args(), query_start_loc=qsl, max_query_len=ok), ref, np.float32)
    with pytest.raises(ValueError, match="max_query_len: 5 is smaller than sequence 1's 6 query rows"):
        pagedattn.paged_attention(*p.args(), query_start_loc=qsl, max_query_len=5)
    with pytest.raises(ValueError, match="max_query_len: must be >= 0, got -1"):
        pagedattn.paged_attention(*p.args(), query_start_loc=qsl, max_query_len=-1)


def test_query_rows_must_match_query_start_loc(rng):
    p, qsl = _problem(rng)
    with pytest.raises(ValueError, match=r"query_start_loc\[2\]: must equal the query's num_tokens 9"):
        pagedattn.paged_attention(p.query[:9], *p.args()[1:], query_start_loc=qsl)
    with pytest.raises(ValueError, match="out"):
        pagedattn.paged_attention(*p.args(), query_start_loc=qsl, out=np.empty((2, 4, 64), np.float32))


def test_query_start_loc_may_not_alias_out(rng):
    p, qsl = _problem(rng)
    buf = np.zeros(p.query.size + 8, np.float32)
    out = buf[: p.query.size].reshape(p.query.shape)
    alias = buf.view(np.int32)[: len(qsl)]
    alias[...] = qsl
    with pytest.raises(ValueError, match="query_start_loc"):
        pagedattn.paged_attention(*p.args(), query_start_loc=alias, out=out)
