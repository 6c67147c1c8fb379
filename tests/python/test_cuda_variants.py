"""Attention variants on CUDA (sliding_window, soft_cap, sinks) against the float64
reference and the CPU path, in the decode kernels (tensor-core and CUDA-core, single
pass and partitioned + reduce) and the varlen kernels (tensor-core and CUDA-core, per
sequence and flat grids, mixed batches whose single rows take the decode kernels).

With a window, every slot before a sequence's window holds NaN and the block-table
entries of the blocks wholly before it are -1 (as the block manager's release leaves
them), so a kernel that reads outside the window, or checks an entry it does not read,
shows. Also: the plan follows the window (partitions over W, not the context), sinks
enter once per row whatever the partitioning, checked calls, the prepared call, errors.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_variants import COMBOS, make_fp8, make_varlen, poison_outside_window, sinks_for, variant_kw

import pagedattn
from conftest import CUDA_BLOCK_SIZES, CUDA_HEAD_SIZES, LAYOUTS, TOL, assert_close, make_problem, np_dtype
from pagedattn.reference import paged_attention_ref

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
    pytest.skip("needs a CUDA device and pagedattn built with CUDA", allow_module_level=True)

DEV = torch.device("cuda", 0)
from torch_arrays import to_numpy, to_torch  # noqa: E402

DTYPES = ["float16", "bfloat16", "float32"]  # tensor-core (16-bit) and CUDA-core (float32) kernels
KERNELS = [("single_pass", 0), ("partitioned", 64), ("auto", 0)]


def run_cuda(p, qsl=None, *, alibi=True, **kw):
    """The CUDA output (NumPy) of p with the options kw (arrays among them moved to the GPU)."""
    dev_kw = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    if qsl is not None:
        dev_kw["query_start_loc"] = to_torch(qsl)
    out = pagedattn.paged_attention(*[to_torch(a) for a in p.args()],
                                    alibi_slopes=to_torch(p.alibi_slopes) if alibi else None, **dev_kw)  # fmt: skip
    assert out.is_cuda
    return to_numpy(out)


def check(p, dtype, qsl=None, *, cpu=True, alibi=True, **kw):
    """CUDA against the float64 reference (and the CPU path, at twice the tolerance)."""
    out = run_cuda(p, qsl, alibi=alibi, **kw)
    slopes = p.alibi_slopes if alibi else None
    ref_kw = {k: v for k, v in kw.items() if k in ("scale", "sliding_window", "soft_cap", "sinks", "kv_cache_dtype",
                                                   "k_scale", "v_scale")}  # fmt: skip
    if qsl is not None:
        ref_kw["query_start_loc"] = qsl
    ref = paged_attention_ref(*p.args(), alibi_slopes=slopes, **ref_kw)
    assert_close(out, ref, dtype, f"cuda vs float64 reference {sorted(kw)}")
    if cpu:
        cpu_out = pagedattn.paged_attention(*p.args(), alibi_slopes=slopes, **ref_kw)
        atol, rtol = TOL[np.dtype(np_dtype(dtype)).name]
        np.testing.assert_allclose(out.astype(np.float64), np.asarray(cpu_out).astype(np.float64),
                                   atol=2 * atol, rtol=2 * rtol, err_msg="cuda vs cpu")  # fmt: skip
    return out


DECODE_LENS = [0, 1, 15, 16, 17, 35, 300, 700]
VARLEN = [(0, 0), (1, 1), (17, 0), (16, 16), (33, 1), (65, 65), (130, 64), (257, 129), (300, 3), (520, 2)]


# ---- decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k[0])
def test_decode_combinations(rng, combo, dtype, kernel):
    """Each variant, every pair and all three, with ALiBi, in each decode kernel."""
    layout = LAYOUTS[len(combo) % len(LAYOUTS)]
    p = make_problem(rng, DECODE_LENS, num_heads=8, num_kv_heads=2, head_size=128, dtype=np_dtype(dtype),
                     layout=layout, alibi=True)  # fmt: skip
    kw = variant_kw(rng, combo, 8, window=37)
    if "sliding_window" in combo:
        assert poison_outside_window(p, 37) > 0
    out = check(p, dtype, kernel=kernel[0], partition_size=kernel[1], **kw)
    assert np.all(out[0].astype(np.float64) == 0), "a sequence of length 0 yields zeros"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("kernel", KERNELS[:2], ids=lambda k: k[0])
def test_decode_window_offsets(rng, layout, block_size, dtype, kernel):
    """Windows starting at every offset of a block and of a 16-token chunk (with 8-token
    blocks a chunk's first block may lie wholly before the window: never read, never
    checked), windows of one token, past the context and INT_MAX."""
    b = block_size
    lens = list(range(1, 2 * b + 18)) + [300]
    for window in (1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 301, 2**31 - 1):
        p = make_problem(rng, lens, num_heads=4, num_kv_heads=2, head_size=64, dtype=np_dtype(dtype), layout=layout,
                         block_size=b)  # fmt: skip
        poison_outside_window(p, window)
        check(p, dtype, alibi=False, cpu=False, sliding_window=window, kernel=kernel[0], partition_size=kernel[1],
              check_block_tables=True)  # fmt: skip


@pytest.mark.parametrize("head_size", CUDA_HEAD_SIZES + [8, 72, 136])
def test_decode_every_head_size(rng, head_size):
    dtype = "bfloat16"
    p = make_problem(rng, [1, 40, 333], num_heads=8, num_kv_heads=2, head_size=head_size, dtype=np_dtype(dtype),
                     layout="nhd", alibi=True)  # fmt: skip
    poison_outside_window(p, 50)
    for kernel in KERNELS[:2]:
        check(p, dtype, sliding_window=50, soft_cap=5.0, sinks=sinks_for(rng, 8), kernel=kernel[0],
              partition_size=kernel[1])  # fmt: skip


@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (8, 2), (16, 2), (32, 1), (64, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_gqa_and_mha(rng, heads, dtype):
    """GQA groups 1..32: groups wider than a CTA's head tile (16 / 8 heads) take several
    tiles, each with its own sinks."""
    h, kh = heads
    p = make_problem(rng, [5, 130, 600], num_heads=h, num_kv_heads=kh, head_size=64, dtype=np_dtype(dtype),
                     alibi=True)  # fmt: skip
    poison_outside_window(p, 70)
    for kernel in KERNELS:
        check(p, dtype, sliding_window=70, soft_cap=3.0, sinks=sinks_for(rng, h), kernel=kernel[0],
              partition_size=kernel[1])  # fmt: skip


def assert_bad_block_id_named(p, col, past):
    """A block id `past` beyond the pool at block_tables[0, col], inside sequence 0: the checked
    call names the entry and its value."""
    bad = p.block_tables.copy()
    bad[0, col] = p.key_cache.shape[0] + past
    args = [to_torch(a) for a in (p.query, p.key_cache, p.value_cache, bad, p.seq_lens)]
    with pytest.raises(IndexError, match=rf"block_tables\[0, {col}\] = {bad[0, col]} is outside"):
        pagedattn.paged_attention(*args, check_block_tables=True)


@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("head_size", [64, 80, 112, 72, 136])
@pytest.mark.parametrize("cache", ["float16", "fp8_e4m3"])
def test_vllm_small_pages(rng, block_size, head_size, cache):
    """vllm pages of 2, 4 and 8 (16-bit) run a kernel of their own (whole blocks' value slabs, the
    slots past a sequence's end or before its window zeroed after the copy; for pages of 2
    and 4 whole key slabs too, NaN keys past the end read and masked): specialised head
    sizes whose slabs fill whole 128-byte lines (64) and end inside one (80, 112: the
    swizzled pieces of a partial line), generic ones, 16-bit and fp8 caches, sequences
    ending inside a block and inside a 16-token chunk, windows starting inside a block, a
    bad block id."""
    lens = [n for n in (1, block_size - 1, block_size + 1, 15, 17, 33, 250) if n > 0]
    if cache != "float16":  # fp8 vllm keys come in 16-element chunks: 72 -> 80, 136 -> 144
        head_size = -(-head_size // 16) * 16
    for window in (0, 21):
        if cache == "float16":
            p = make_problem(rng, lens, num_heads=8, num_kv_heads=2, head_size=head_size, dtype=np.float16,
                             layout="vllm", block_size=block_size, alibi=True)  # fmt: skip
            fp8 = {}
        else:
            p, fp8 = make_fp8(rng, lens, cache, dtype=np.float16, layout="vllm", num_heads=8, num_kv_heads=2,
                              head_size=head_size, block_size=block_size, alibi=True)  # fmt: skip
        if window:
            assert poison_outside_window(p, window) > 0
        for kernel in KERNELS[:2]:
            check(p, "float16", sliding_window=window, kernel=kernel[0], partition_size=kernel[1], **fp8)
    if cache == "float16":
        p = make_problem(rng, [250, 40], num_heads=8, num_kv_heads=2, head_size=head_size, dtype=np.float16,
                         layout="vllm", block_size=block_size)  # fmt: skip
        assert_bad_block_id_named(p, 3, 5)


@pytest.mark.parametrize("block_size", [32, 64, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_vllm_wide_value_rows(rng, block_size, dtype):
    """vllm pages of 64 and more with 16-bit caches and head sizes 64 and 128 run the wide-row
    kernel: the 4 warps' chunks of a 64-token group share one V stage, each warp copying a
    quarter of the group's dim rows, mbarriers handing the stages between them. Sequences
    ending inside a chunk, on and around group edges; partitions of 48 tokens (a warp with no
    chunk in a group) and 80 (groups straddling blocks); windows starting inside a chunk and
    a group, NaN before them; soft cap, sinks and ALiBi at once. Head size 96 and pages of 32
    keep the per-warp kernel and take the same checks."""
    lens = [1, 15, 16, 17, 63, 64, 65, 100, 3 * block_size + 5, 700]
    for head_size, window in itertools.product((64, 128, 96), (0, 150, 21)):
        p = make_problem(rng, lens, num_heads=8, num_kv_heads=2, head_size=head_size, dtype=np_dtype(dtype),
                         layout="vllm", block_size=block_size, alibi=True)  # fmt: skip
        if window:  # a fresh problem per window: poisoning goes through the table, whose entries it sets to -1
            assert poison_outside_window(p, window) > 0
        for kernel, psize in (("single_pass", 0), ("partitioned", 48), ("partitioned", 80), ("auto", 0)):
            check(p, dtype, sliding_window=window, soft_cap=4.0, sinks=sinks_for(rng, 8), kernel=kernel,
                  partition_size=psize)  # fmt: skip
    p = make_problem(rng, [700, 300], num_heads=8, num_kv_heads=2, head_size=128, dtype=np_dtype(dtype),
                     layout="vllm", block_size=block_size)  # fmt: skip
    assert_bad_block_id_named(p, 2, 7)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_fp8_caches(rng, kind, dtype, layout):
    lens = [5, 31, 64, 200, 333]
    # pages of 2 and 4: the vllm values come in runs of 2-8 bytes (element by element, 4- and
    # 8-byte copies), the window's start inside a run
    for block_size in (2, 4, 8, 16):
        p, fp8 = make_fp8(rng, lens, kind, dtype=np_dtype(dtype), layout=layout, num_heads=8, num_kv_heads=2,
                          head_size=64, block_size=block_size, alibi=True)  # fmt: skip
        assert poison_outside_window(p, 30) > 0
        for kernel in KERNELS[:2]:
            check(p, dtype, sliding_window=30, soft_cap=2.0, sinks=sinks_for(rng, 8), kernel=kernel[0],
                  partition_size=kernel[1], **fp8)  # fmt: skip


# fp8 caches with groups of up to 8 query heads per KV head take the transposed kernels (the
# heads as the mma's N, keys and values its A operand; nhd values with permuted dims), larger
# groups the untransposed ones: each group size on both sides of 8, every specialised head
# size, both layouts, a page of 16 and of 64, every variant at once (window with NaN before
# it, soft cap, sinks, ALiBi), bf16 queries whose heads differ in magnitude by 2^40 (each
# head's scale into f16 reaches the lanes that hold that head's logits).
@pytest.mark.parametrize("group", [1, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_fp8_transposed_groups(rng, group, layout):
    kh = 2
    for head_size in CUDA_HEAD_SIZES:
        for block_size in (16, 64):
            p, fp8 = make_fp8(rng, [1, 17, 80, 333], "fp8_e4m3", dtype=np_dtype("bfloat16"), layout=layout,
                              num_heads=group * kh, num_kv_heads=kh, head_size=head_size, block_size=block_size,
                              alibi=True)  # fmt: skip
            q = p.query.astype(np.float32)
            q *= (2.0 ** (np.arange(group * kh) % 5 * 10 - 20)).astype(np.float32)[None, :, None]
            p.query = q.astype(p.query.dtype)
            assert poison_outside_window(p, 45) > 0
            for kernel in KERNELS[:2]:
                check(p, "bfloat16", sliding_window=45, soft_cap=30.0, sinks=sinks_for(rng, group * kh),
                      kernel=kernel[0], partition_size=kernel[1], **fp8)  # fmt: skip


@pytest.mark.parametrize("kernel", ["auto", "partitioned"])
def test_long_context_window(rng, kernel):
    """A 4096-token window over 32k contexts: NaN in the 28k slots before the window,
    released entries (-1) for its blocks."""
    dtype = "bfloat16"
    p = make_problem(rng, [32768, 32000, 4000], num_heads=32, num_kv_heads=8, head_size=128, dtype=np_dtype(dtype),
                     alibi=True)  # fmt: skip
    assert poison_outside_window(p, 4096) > 50000
    check(p, dtype, cpu=False, kernel=kernel, sliding_window=4096, soft_cap=30.0, sinks=sinks_for(rng, 32))


def test_plan_follows_the_window(rng):
    """The partitions cover the window (W + 16 tokens), not the context: a 4096-token
    window over 32k contexts plans like a 4112-token context; the workspace size takes the
    window too, and a workspace of that size runs the windowed call."""
    args = (8, 32, 8, 128, 16, 2048, "bfloat16")
    windowed = pagedattn.decode_plan(*args, sliding_window=4096)
    short = pagedattn.decode_plan(8, 32, 8, 128, 16, (4096 + 16) // 16, "bfloat16")
    full = pagedattn.decode_plan(*args)
    assert windowed == short
    assert windowed["ctas"] <= full["ctas"]  # b8: both may be single-pass grids
    # one sequence of 32k: the planner fills the GPU either way, with partitions sized to
    # the window's 4112 tokens instead of the 32k context
    one = (1, 32, 8, 128, 16, 2048, "bfloat16")
    w1, f1 = pagedattn.decode_plan(*one, sliding_window=4096), pagedattn.decode_plan(*one)
    assert w1["partition_size"] < f1["partition_size"]
    assert 4096 + 16 <= w1["partition_size"] * w1["num_partitions"] < 32768
    assert pagedattn.decode_plan(*args, sliding_window=2**31 - 1) == full
    assert pagedattn.decode_plan(*args, soft_cap=30.0) == full
    ws = pagedattn.decode_workspace_size(*args, sliding_window=4096, kernel="partitioned")
    assert ws == pagedattn.decode_plan(*args, sliding_window=4096, kernel="partitioned")["workspace_bytes"] > 0
    for fn in (pagedattn.decode_workspace_size, pagedattn.decode_plan):
        with pytest.raises(ValueError, match="sliding_window"):
            fn(*args, sliding_window=-1)
        with pytest.raises(ValueError, match="soft_cap"):
            fn(*args, soft_cap=float("nan"))
    p = make_problem(rng, [700, 2000], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16)
    poison_outside_window(p, 300)
    need = pagedattn.decode_workspace_size(2, 8, 2, 128, 16, p.block_tables.shape[1], "float16",
                                           sliding_window=300, kernel="partitioned", partition_size=64)  # fmt: skip
    plain = pagedattn.decode_workspace_size(2, 8, 2, 128, 16, p.block_tables.shape[1], "float16",
                                            kernel="partitioned", partition_size=64)  # fmt: skip
    assert 0 < need < plain
    workspace = torch.empty(need, dtype=torch.uint8, device=DEV)
    out = run_cuda(p, alibi=False, sliding_window=300, kernel="partitioned", partition_size=64, workspace=workspace)
    assert_close(out, paged_attention_ref(*p.args(), sliding_window=300), np.float16)
    with pytest.raises(ValueError, match="workspace"):  # the unwindowed call needs more
        run_cuda(p, alibi=False, kernel="partitioned", partition_size=64, workspace=workspace)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_values_and_partitioning(rng, dtype):
    """-inf is no sink, +inf gives zeros, NaN gives NaN in its head only; a sink enters
    each row once: single pass, partitions of every size and the CPU agree."""
    p = make_problem(rng, [1, 50, 700, 2500], num_heads=6, num_kv_heads=2, head_size=64, dtype=np_dtype(dtype),
                     alibi=True)  # fmt: skip
    sinks = np.array([-np.inf, np.inf, np.nan, 1e30, 0.0, 3.0], np.float32)
    ref = paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes, sinks=sinks)
    atol, rtol = TOL[np.dtype(np_dtype(dtype)).name]
    first = None
    for kernel, ps in [("single_pass", 0), ("partitioned", 16), ("partitioned", 64), ("partitioned", 512), ("auto", 0)]:
        plain = run_cuda(p, kernel=kernel, partition_size=ps).astype(np.float64)
        out = run_cuda(p, sinks=sinks, kernel=kernel, partition_size=ps).astype(np.float64)
        np.testing.assert_array_equal(out[:, 0], plain[:, 0])  # -inf: no sink, the same bits
        assert np.all(out[:, 1] == 0)
        assert np.all(np.isnan(out[:, 2]))
        assert_close(out[:, [0, 1, 3, 4, 5]], ref[:, [0, 1, 3, 4, 5]], dtype, f"{kernel} {ps}")
        if first is None:
            first = out
        np.testing.assert_allclose(out[:, 3:], first[:, 3:], atol=atol, rtol=rtol, err_msg=f"{kernel} {ps}")


@pytest.mark.parametrize("cap", [1e-3, 0.05, 0.5, 2.0, 30.0, 1e30])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_soft_cap_extremes(rng, cap, dtype):
    p = make_problem(rng, [1, 40, 300], num_heads=8, num_kv_heads=2, head_size=128, dtype=np_dtype(dtype),
                     alibi=True)  # fmt: skip
    for kernel in KERNELS[:2]:
        check(p, dtype, soft_cap=cap, kernel=kernel[0], partition_size=kernel[1])
    lens, qs = [40, 300], [40, 7]
    pv, qsl = make_varlen(rng, lens, qs, dtype=np_dtype(dtype), num_heads=8, num_kv_heads=2, head_size=128,
                          alibi=True)  # fmt: skip
    check(pv, dtype, qsl, soft_cap=cap)


@pytest.mark.parametrize("cap", [700.0, 800.0])
def test_soft_cap_either_side_of_the_short_form(rng, cap):
    """The tensor-core kernels' soft cap has a short form for caps up to 1024 / log2(e)
    (710) and a longer one above; logits of hundreds (scale 40) reach |logit / cap| of
    0.5 and more, past both forms' switch to the exponential."""
    p = make_problem(rng, [1, 40, 300], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16,
                     alibi=True)  # fmt: skip
    for kernel in KERNELS[:2]:
        check(p, "float16", soft_cap=cap, scale=40.0, kernel=kernel[0], partition_size=kernel[1])
    pv, qsl = make_varlen(rng, [40, 300], [40, 7], dtype=np.float16, num_heads=8, num_kv_heads=2, head_size=128,
                          alibi=True)  # fmt: skip
    check(pv, "float16", qsl, soft_cap=cap, scale=40.0)


def test_check_block_tables_reads_only_the_window(rng):
    """Checked calls: entries before the window (released, -1) are not checked; a bad
    entry inside it is an error naming it, in both forms."""
    p = make_problem(rng, [100, 40], num_heads=8, num_kv_heads=2, head_size=64, dtype=np.float16)
    poison_outside_window(p, 40)  # sequence 0: window from 60, blocks 0..2 released
    assert (p.block_tables[0, :3] == -1).all()
    for kernel in KERNELS[:2]:
        check(p, "float16", alibi=False, sliding_window=40, check_block_tables=True, kernel=kernel[0],
              partition_size=kernel[1])  # fmt: skip
    bad = p.block_tables.copy()
    bad[0, 3] = -5  # tokens 48..63: inside the window
    args = [to_torch(a) for a in (p.query, p.key_cache, p.value_cache, bad, p.seq_lens)]
    with pytest.raises(IndexError, match=r"block_tables\[0, 3\] = -5"):
        pagedattn.paged_attention(*args, sliding_window=40, check_block_tables=True)
    q = rng.standard_normal((10, 8, 64)).astype(np.float16)
    qsl = to_torch(np.array([0, 10, 10], np.int32))
    with pytest.raises(IndexError, match=r"block_tables\[0, 3\]"):
        pagedattn.paged_attention(to_torch(q), *args[1:], query_start_loc=qsl, sliding_window=40,
                                  check_block_tables=True)  # fmt: skip


def test_prepared_call_and_graph(rng):
    """A prepared windowed call replayed in a CUDA graph with new lengths: the window moves
    with the lengths (device data), the plan does not change. The slots before the
    window of the shortest lengths hold NaN and their whole blocks are released (-1)."""
    p = make_problem(rng, [900, 1500], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16, alibi=True)
    all_lens = ([900, 1500], [1, 1300], [257, 1024])
    p.seq_lens[:] = np.min(all_lens, axis=0)
    poison_outside_window(p, 256)
    sinks = sinks_for(rng, 8)
    kw = dict(sliding_window=256, soft_cap=20.0)
    q, kc, vc, bt, sl = (to_torch(a) for a in p.args())
    out = torch.full_like(q, float("nan"))
    prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out, alibi_slopes=to_torch(p.alibi_slopes),
                                    sinks=to_torch(sinks), kernel="partitioned", partition_size=128, **kw)  # fmt: skip
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    assert prep.run(stream=s) is out
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        prep.run(stream=s)
    for lens in all_lens:
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        p.seq_lens[:] = lens
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes, sinks=sinks, **kw)
        assert_close(to_numpy(out), ref, np.float16, f"lens {lens}")


# ---- varlen ------------------------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid", ["flat", "per_sequence", "checked"])
def test_varlen_combinations(rng, combo, dtype, grid):
    """Each variant, every pair and all three, with ALiBi, through the flat grid (no
    max_query_len), the per-sequence grid and the checked call (the varlen kernel for
    every sequence); mixed batches route their single rows to the decode kernels."""
    layout = LAYOUTS[len(combo) % len(LAYOUTS)]
    lens, qs = zip(*VARLEN)
    p, qsl = make_varlen(rng, lens, qs, dtype=np_dtype(dtype), num_heads=8, num_kv_heads=2, head_size=128,
                         layout=layout, alibi=True)  # fmt: skip
    kw = variant_kw(rng, combo, 8, window=45)
    if "sliding_window" in combo:
        assert poison_outside_window(p, 45, qs) > 0
    if grid == "per_sequence":
        kw["max_query_len"] = max(qs)
    elif grid == "checked":
        kw["check_block_tables"] = True
    check(p, dtype, qsl, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_varlen_window_offsets(rng, layout, block_size, dtype):
    """Windows against key tiles (64 / 32 keys) and blocks: narrower than a CTA's rows
    (rows see disjoint keys), equal to a tile, starting anywhere in a block."""
    lens = [1, 20, 64, 65, 130, 300, 520]
    qs = [1, 20, 3, 65, 100, 257, 9]
    for window in (1, 5, 16, 63, 64, 65, 200, 2**31 - 1):
        p, qsl = make_varlen(rng, lens, qs, dtype=np_dtype(dtype), num_heads=8, num_kv_heads=2, head_size=64,
                             layout=layout, block_size=block_size)  # fmt: skip
        poison_outside_window(p, window, qs)
        check(p, dtype, qsl, alibi=False, cpu=False, sliding_window=window)
        check(p, dtype, qsl, alibi=False, cpu=False, sliding_window=window, max_query_len=max(qs))


@pytest.mark.parametrize("head_size", CUDA_HEAD_SIZES + [8, 72, 136])
def test_varlen_every_head_size(rng, head_size):
    """Tensor-core (multiples of 16) and CUDA-core (others) varlen kernels."""
    lens, qs = [40, 333, 129], [40, 70, 1]
    p, qsl = make_varlen(rng, lens, qs, dtype=np_dtype("float16"), num_heads=8, num_kv_heads=2,
                         head_size=head_size, layout="nhd", alibi=True)  # fmt: skip
    poison_outside_window(p, 50, qs)
    check(p, "float16", qsl, sliding_window=50, soft_cap=5.0, sinks=sinks_for(rng, 8))


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (16, 2), (32, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varlen_gqa_and_mha(rng, heads, dtype):
    h, kh = heads
    lens, qs = [300, 47, 257, 5], [300, 47, 33, 2]
    p, qsl = make_varlen(rng, lens, qs, dtype=np_dtype(dtype), num_heads=h, num_kv_heads=kh, head_size=64,
                         alibi=True)  # fmt: skip
    poison_outside_window(p, 19, qs)
    check(p, dtype, qsl, sliding_window=19, soft_cap=4.0, sinks=sinks_for(rng, h))


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_fp8_caches(rng, kind, dtype, layout):
    lens, qs = [5, 31, 64, 200], [5, 2, 40, 1]
    p, fp8 = make_fp8(rng, lens, kind, dtype=np_dtype(dtype), layout=layout, num_heads=8, num_kv_heads=2,
                      head_size=64, alibi=True)  # fmt: skip
    assert poison_outside_window(p, 30, qs) > 0
    qsl = np.concatenate([[0], np.cumsum(qs)]).astype(np.int32)
    p.query = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np_dtype(dtype))
    check(p, dtype, qsl, sliding_window=30, soft_cap=2.0, sinks=sinks_for(rng, 8), **fp8)


def test_varlen_long_chunk_in_a_window(rng):
    """A 1024-row chunk at the end of a 16k context with a 300-token window: the rows of
    one CTA see different, partly disjoint key ranges, and most key tiles of the context
    are never visited."""
    p, qsl = make_varlen(rng, [16384, 3000], [1024, 1], dtype=np_dtype("bfloat16"), num_heads=8, num_kv_heads=2,
                         head_size=128, alibi=True)  # fmt: skip
    assert poison_outside_window(p, 300, [1024, 1]) > 15000
    for extra in ({}, {"max_query_len": 1024}):
        check(p, "bfloat16", qsl, cpu=False, sliding_window=300, soft_cap=30.0, sinks=sinks_for(rng, 8), **extra)


# ---- errors ------------------------------------------------------------------------------


def test_errors(rng):
    p = make_problem(rng, [5, 20], num_heads=4, num_kv_heads=2, head_size=64, dtype=np.float16)
    args = [to_torch(a) for a in p.args()]
    with pytest.raises(ValueError, match=r"sinks is on cpu but query is on cuda"):
        pagedattn.paged_attention(*args, sinks=np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="sinks: expected dtype float32, got float16"):
        pagedattn.paged_attention(*args, sinks=torch.zeros(4, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"sinks: dimension 0 \(num_heads\) must be 4, got 3"):
        pagedattn.paged_attention(*args, sinks=torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="sinks: must be C-contiguous"):
        pagedattn.paged_attention(*args, sinks=torch.zeros(8, device=DEV)[::2])
    with pytest.raises(ValueError, match="sliding_window: must be >= 0"):
        pagedattn.paged_attention(*args, sliding_window=-4)
    with pytest.raises(ValueError, match="soft_cap: must be a finite number >= 0"):
        pagedattn.paged_attention(*args, soft_cap=float("inf"))


def test_every_pair_is_listed():
    assert len(COMBOS) == 7 and set(itertools.chain(*COMBOS)) == set(pagedattn.supported()["variants"])
