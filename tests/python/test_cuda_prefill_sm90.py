"""The varlen kernel families on CUDA: which one serves a call (decode_plan's
varlen_kernel), the Hopper (sm_90a, wgmma) kernel's own edges, and the sm_80 tensor-core
kernel kept under test on a Hopper GPU (PAGEDATTN_PREFILL_KERNEL=mma in a subprocess).

On a GPU of compute capability 9.0 the whole CUDA suite runs the Hopper kernel wherever
it applies (16-bit queries and caches, head sizes 64 and 128, nhd / hnd, vllm with pages
of 8 tokens or more); these tests add the shapes that stress its pipeline: more key tiles
than ring stages, row tiles that end inside a GQA group, a query without 16-byte
alignment (its element-by-element Q path), and windows that start inside a page.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from test_cuda_prefill import varlen

import pagedattn
from conftest import BF16, assert_close
from pagedattn.reference import paged_attention_ref

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
    pytest.skip("needs a CUDA device and pagedattn built with CUDA", allow_module_level=True)

from torch_arrays import to_numpy, to_torch  # noqa: E402

HOPPER = torch.cuda.get_device_capability(0) == (9, 0)
DTYPES = ["float16"] + (["bfloat16"] if BF16 is not None else [])


def family(dtype="bfloat16", head_size=128, layout="nhd", block_size=16, **kw):
    return pagedattn.decode_plan(4, 32, 8, head_size, block_size, 64, dtype, layout, **kw)["varlen_kernel"]


def test_the_kernel_family_each_call_gets():
    # On Hopper: a build whose architectures name 90 (the default list, and a build on the
    # GPU's own machine) serves these with the sm_90a kernel.
    tensor = "sm90_wgmma" if HOPPER else "sm80_mma"
    for dt in DTYPES:
        for d in (64, 128):
            for layout in ("nhd", "hnd", "vllm"):
                for b in (2, 4, 8, 16, 64, 256):
                    assert family(dt, d, layout, b) == tensor, (dt, d, layout, b)
            assert family(dt, d, "nhd", 1) == tensor
    # outside the Hopper kernel: the sm_80 tensor-core kernel
    assert family(head_size=96) == "sm80_mma"
    assert family(head_size=256) == "sm80_mma"
    assert family(kv_cache_dtype="fp8_e4m3") == "sm80_mma"
    # float32 queries and head sizes off the tensor-core list: the CUDA-core kernel
    assert family("float32") == "cuda_core"
    assert family("float16", head_size=72) == "cuda_core"


@pytest.mark.parametrize("layout", ["nhd", "vllm"])  # hnd: the nhd kernel at other strides (test_cuda_layouts)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,group", [(128, 4), (64, 1), (128, 8), (64, 3)])
def test_pipeline_edges(rng, layout, dtype, head_size, group):
    """Contexts of up to 9 key tiles of 128 (the ring has 3 or 4 stages), query rows that
    end mid-tile and mid-group (128 packed rows per CTA), q = 0, 1 and = seq_len, and a
    query without 16-byte alignment."""
    seq_lens = [1200, 129, 128, 1, 300, 700, 5]
    q_lens = [1200, 2, 128, 1, 0, 43, 5]
    kv = 2
    pb, q, qsl, _ = varlen(rng, seq_lens, q_lens, dtype=dtype, layout=layout, num_heads=kv * group, num_kv_heads=kv,
                           head_size=head_size, block_size=16)  # fmt: skip
    ref = paged_attention_ref(q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, query_start_loc=qsl)
    caches = [to_torch(a) for a in (pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens)]
    tq = to_torch(q)
    for mql in (None, max(q_lens)):
        out = pagedattn.paged_attention(tq, *caches, query_start_loc=to_torch(qsl), max_query_len=mql)
        assert_close(to_numpy(out), ref, dtype, f"aligned query, max_query_len={mql}")
    # the same query one element into a wider buffer: rows lose 16-byte alignment
    flat = torch.empty(tq.numel() + 1, dtype=tq.dtype, device=tq.device)
    flat[1:] = tq.reshape(-1)
    odd = flat[1:].view(tq.shape)
    assert odd.data_ptr() % 16 != 0
    out = pagedattn.paged_attention(odd, *caches, query_start_loc=to_torch(qsl))
    assert_close(to_numpy(out), ref, dtype, "unaligned query")
    # an output without 16-byte alignment (the epilogue's element-by-element stores),
    # between NaN guards that must stay untouched
    oflat = torch.full((tq.numel() + 2,), float("nan"), dtype=tq.dtype, device=tq.device)
    oview = oflat[1:-1].view(tq.shape)
    pagedattn.paged_attention(tq, *caches, query_start_loc=to_torch(qsl), out=oview)
    assert_close(to_numpy(oview), ref, dtype, "unaligned out")
    assert torch.isnan(oflat[0]) and torch.isnan(oflat[-1])


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_a_bad_block_id_spoils_only_the_rows_that_read_it(rng, layout):
    """An unchecked call with a block id outside the pool in a long prompt: the rows whose
    keys include that block are NaN, the earlier rows of the prompt and every row of the
    other sequence are exact (the Hopper kernel checks ids as it loads them; the sm_80
    kernel and the one-block-per-item grid run this test in the subprocesses below)."""
    seq_lens, q_lens = [600, 300], [600, 100]
    pb, q, qsl, _ = varlen(rng, seq_lens, q_lens, dtype="float16", layout=layout, num_heads=8, num_kv_heads=2,
                           head_size=128, block_size=16)  # fmt: skip
    ref = paged_attention_ref(q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, query_start_loc=qsl)
    bt = pb.block_tables.copy()
    bt[0, 30] = pb.key_cache.shape[0] + 7  # tokens 480 .. 495 of sequence 0
    args = [to_torch(a) for a in (q, pb.key_cache, pb.value_cache, bt, pb.seq_lens)]
    out = to_numpy(pagedattn.paged_attention(*args, query_start_loc=to_torch(qsl)))
    # sequence 0: rows 0 .. 599 at positions 0 .. 599; 128 packed rows = 32 tokens per CTA
    assert_close(out[:448], ref[:448], "float16", "rows before the bad block")
    assert np.isnan(out[480:600]).all(), "rows that read the bad block"
    assert_close(out[600:], ref[600:], "float16", "the other sequence")


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
@pytest.mark.parametrize("block_size", [2, 4, 8, 16, 32, 128])
def test_windows_start_inside_a_page(rng, layout, block_size):
    """Windows whose first key lies inside an 8-token piece of a page, or inside a page of
    2 or 4 tokens (the vllm value piece or run that straddles it is loaded, cleared below
    the window and stored by hand), with NaN in every slot outside the windows."""
    dtype = DTYPES[-1]
    seq_lens, q_lens = [900, 333], [300, 333]
    for window in (7, 100, 131, 517):
        pb, q, qsl, _ = varlen(rng, seq_lens, q_lens, dtype=dtype, layout=layout, num_heads=8, num_kv_heads=2,
                               head_size=128, block_size=block_size)  # fmt: skip
        # NaN in the keys and values no row's window reaches
        for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
            first = max(0, n - ql - window + 1)
            for t in range(first):
                blk, off = pb.block_tables[i, t // block_size], t % block_size
                if layout == "vllm":
                    pb.key_cache[blk, :, :, off, :] = np.nan
                    pb.value_cache[blk, :, :, off] = np.nan
                else:
                    pb.key_cache[blk, off] = np.nan
                    pb.value_cache[blk, off] = np.nan
        ref = paged_attention_ref(q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens,
                                  query_start_loc=qsl, sliding_window=window)  # fmt: skip
        out = pagedattn.paged_attention(to_torch(q), *[to_torch(a) for a in (pb.key_cache, pb.value_cache,
                                        pb.block_tables, pb.seq_lens)], query_start_loc=to_torch(qsl),
                                        sliding_window=window)  # fmt: skip
        assert_close(to_numpy(out), ref, dtype, f"window {window}")


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_a_running_maximum_that_jumps(rng, layout):
    """Logits that rise by steps smaller and larger than the kernel's rescale slack (8 in
    base 2: below it the weights are taken against the old maximum, above it O and l are
    rescaled), fall back, and jump once more near the end, so that rows of one warp and of
    one tile see their maxima move at different key tiles; every row against float64."""
    dtype = DTYPES[-1]
    seq_lens, q_lens = [1500, 900], [1500, 400]
    pb, q, qsl, _ = varlen(rng, seq_lens, q_lens, dtype=dtype, layout=layout, num_heads=8, num_kv_heads=2,
                           head_size=128, block_size=16)  # fmt: skip
    # q . k gains 4 * alpha(t) from dim 0: about 0.5 * alpha(t) in base 2 after the scale
    q[:, :, 0] = 4.0
    for i, n in enumerate(seq_lens):
        for t in range(n):
            if t < 700:
                alpha = 10.0 * (t // 200)  # steps of about 5 (base 2)
            elif t < 1100:
                alpha = 60.0 + 40.0 * ((t - 700) // 150)  # steps of about 20
            elif t < 1400:
                alpha = 10.0  # below the maximum so far
            else:
                alpha = 300.0  # one more jump, of about 70
            blk, off = pb.block_tables[i, t // 16], t % 16
            if layout == "vllm":
                pb.key_cache[blk, :, 0, off, 0] = alpha
            else:
                pb.key_cache[blk, off, :, 0] = alpha
    ref = paged_attention_ref(q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, query_start_loc=qsl)
    out = pagedattn.paged_attention(to_torch(q), *[to_torch(a) for a in (pb.key_cache, pb.value_cache,
                                    pb.block_tables, pb.seq_lens)], query_start_loc=to_torch(qsl),
                                    max_query_len=max(q_lens))  # fmt: skip
    assert_close(to_numpy(out), ref, dtype, "jumping maxima")


def run_tests_with(variable, value, tests):
    """Runs the named tests ("file::test") in a pytest subprocess with one environment
    variable set (the library reads its kernel choices once per process); all must pass."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, **{variable: value})
    paths = [os.path.join(here, t) for t in tests]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *paths], env=env,
                       capture_output=True, text=True, timeout=600, cwd=here)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1]
    return env


def persistent_items(seq_lens_q, num_kv_heads, group, sure=False):
    """The items the Hopper kernel's persistent grid is chosen by (prefill_launch.cu):
    tiles x KV heads (sure: less two per sequence and KV head, the items that may be
    empty, as PAGEDATTN_SM90_SURE=1 has it); persistent from 2 x the SMs."""
    tiles = -(-sum(seq_lens_q) * group // 128) + len(seq_lens_q)
    return (tiles - (2 * len(seq_lens_q) if sure else 0)) * num_kv_heads


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_the_persistent_deal_of_items(rng, layout):
    """The persistent grid takes items from a device counter that each call leaves zeroed
    for the next: a batch of equal prompts (whose tile lengths form a sawtooth over the
    sequences) and a skewed one, each against float64; then the same call again and
    again on one stream, on two streams in turn, and replayed from a CUDA graph, with
    `out` NaN before each: every row is written every time, bit for bit the same (an item
    is computed the same whichever CTA takes it), so a counter left dirty by a call, or
    shared by two, would show as NaN or as a changed row."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv, group = 8, 2
    batches = {"equal prompts": ([1024] * 4, [1024] * 4), "skewed": ([2000, 64, 900, 1, 300, 1500],
                                                                       [2000, 64, 700, 1, 280, 1500])}  # fmt: skip
    for name, (seq_lens, q_lens) in batches.items():
        if HOPPER and family() == "sm90_wgmma":
            assert persistent_items(q_lens, kv, group) >= 2 * sms, "the shape must take the persistent grid"
        pb, q, qsl, _ = varlen(rng, seq_lens, q_lens, dtype="float16", layout=layout, num_heads=kv * group,
                               num_kv_heads=kv, head_size=64, block_size=16)  # fmt: skip
        ref = paged_attention_ref(q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, query_start_loc=qsl)
        args = [to_torch(a) for a in (q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens)]
        tqsl = to_torch(qsl)

        def call(out, args=args, tqsl=tqsl):
            out.fill_(float("nan"))
            pagedattn.paged_attention(*args, query_start_loc=tqsl, out=out)

        first = torch.empty_like(args[0])
        call(first)
        torch.cuda.synchronize()
        assert_close(to_numpy(first), ref, "float16", name)
        # again on the same stream, and on two streams in turn (each its own counters)
        streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
        outs = [torch.empty_like(first) for _ in range(6)]
        for i, out in enumerate(outs):
            with torch.cuda.stream(streams[0 if i < 2 else 1 + i % 2]):
                call(out)
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            assert torch.equal(out, first), f"{name}: call {i + 1} after the first"
        # captured in a graph (graph-owned counters), replayed, then eager calls again
        graph_out = torch.empty_like(first)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                pagedattn.paged_attention(*args, query_start_loc=tqsl, out=graph_out)
        for i in range(3):
            graph_out.fill_(float("nan"))
            graph.replay()
            call(outs[0])
            torch.cuda.synchronize()
            assert torch.equal(graph_out, first), f"{name}: graph replay {i}"
            assert torch.equal(outs[0], first), f"{name}: eager call after replay {i}"


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_items_back_to_back_in_one_block(rng, layout):
    """A persistent block runs many items in turn, the stage ring, Q and the item slots
    running on from one item to the next. Items of one key tile (short sequences) between
    long ones, with the per-item state the next item must not inherit (ALiBi positions and
    slopes, the running maximum and sum the sinks and the stores read, the window's first
    key): every row of a plain call, one with ALiBi + soft cap + sinks, and one with a
    window + sinks, against float64, with NaN in every unused cache slot."""
    from test_variants import sinks_for

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv, group, dtype = 8, 2, DTYPES[-1]
    short = [int(n) for n in rng.integers(2, 129, size=30)]
    seq_lens = [2048, 1500] + short[:15] + [1024] + short[15:]
    q_lens = [2048, 1000] + [int(rng.integers(1, n + 1)) for n in short[:15]] + [1024] + \
        [int(rng.integers(1, n + 1)) for n in short[15:]]
    if HOPPER and family() == "sm90_wgmma":
        assert persistent_items(q_lens, kv, group) >= 2 * sms, "the shape must take the persistent grid"
    pb, q, qsl, _ = varlen(rng, seq_lens, q_lens, dtype=dtype, layout=layout, num_heads=kv * group, num_kv_heads=kv,
                           head_size=128, block_size=16, alibi=True)  # fmt: skip
    sinks = sinks_for(rng, kv * group)
    args = [to_torch(a) for a in (q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens)]
    calls = {"plain": {}, "alibi + soft cap + sinks": dict(alibi_slopes=pb.alibi_slopes, soft_cap=20.0, sinks=sinks),
             "window + sinks": dict(sliding_window=100, sinks=sinks)}  # fmt: skip
    for name, kw in calls.items():
        ref = paged_attention_ref(q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, query_start_loc=qsl,
                                  **kw)  # fmt: skip
        tkw = {k: to_torch(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        out = pagedattn.paged_attention(*args, query_start_loc=to_torch(qsl), max_query_len=max(q_lens), **tkw)
        assert_close(to_numpy(out), ref, dtype, name)


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_a_mixed_batch_of_mostly_empty_items(rng, layout):
    """A chunked-prefill step of two chunks among many decodes (and sequences with no query
    row this step): the flat grid's items are mostly empty (a decode row's item: those rows
    go to the decode kernels), which the persistent blocks look up and pass over. Every
    row against float64 with NaN in every unused cache slot, and the call repeated bit for
    bit (an item is the same whichever block takes it; a counter left moved would show as
    rows never written); the same test runs with one block per item
    (PAGEDATTN_SM90_SURE=1, in a subprocess)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv, group = 8, 4
    n_dec = 2 * sms
    seq_lens = [700] + [int(n) for n in rng.integers(1, 600, size=n_dec)] + [333]
    q_lens = [300] + [0 if i % 7 == 3 else 1 for i in range(n_dec)] + [333]
    if HOPPER and family() == "sm90_wgmma":
        assert persistent_items(q_lens, kv, group) >= 2 * sms, "the shape must take the persistent grid"
        assert persistent_items(q_lens, kv, group, sure=True) < 2 * sms, "and not under the earlier rule"
    pb, q, qsl, _ = varlen(rng, seq_lens, q_lens, dtype=DTYPES[-1], layout=layout, num_heads=kv * group,
                           num_kv_heads=kv, head_size=128, block_size=16)  # fmt: skip
    ref = paged_attention_ref(q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, query_start_loc=qsl)
    args = [to_torch(a) for a in (q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens)]
    outs = []
    for _ in range(3):
        out = torch.full_like(args[0], float("nan"))
        pagedattn.paged_attention(*args, query_start_loc=to_torch(qsl), max_query_len=max(q_lens), out=out)
        outs.append(out)
    torch.cuda.synchronize()
    assert_close(to_numpy(outs[0]), ref, DTYPES[-1], layout)
    for i, out in enumerate(outs[1:]):
        assert torch.equal(out, outs[0]), f"call {i + 2}"


@pytest.mark.skipif(not HOPPER, reason="the Hopper kernel only")
def test_mixed_batches_under_the_earlier_persistence_rule():
    """PAGEDATTN_SM90_SURE=1: a grid whose items may be mostly empty takes one block per
    item; the mixed-batch tests pass that way too."""
    if family() != "sm90_wgmma":
        pytest.skip("this build has no Hopper kernels")
    run_tests_with("PAGEDATTN_SM90_SURE", "1", [
        "test_cuda_prefill_sm90.py::test_a_mixed_batch_of_mostly_empty_items",
        "test_cuda_prefill.py::test_mixed_batch"])  # fmt: skip


def test_per_thread_default_streams_keep_their_own_counters(rng):
    """Two host threads calling on the per-thread default stream (one handle, a stream of
    its own in each thread, whose kernels may overlap) each get their own work counters:
    every call of both threads writes every row, bit for bit as a call alone."""
    import threading

    per_thread = 2  # cudaStreamPerThread
    pb, q, qsl, _ = varlen(rng, [1024] * 4, [1024] * 4, dtype="float16", layout="nhd", num_heads=16, num_kv_heads=8,
                           head_size=64, block_size=16)  # fmt: skip
    args = [to_torch(a) for a in (q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens)]
    tqsl = to_torch(qsl)
    alone = pagedattn.paged_attention(*args, query_start_loc=tqsl)
    torch.cuda.synchronize()
    outs = [[torch.full_like(alone, float("nan")) for _ in range(32)] for _ in range(2)]
    torch.cuda.synchronize()
    errors = []

    def work(mine):
        try:
            for out in mine:
                pagedattn.paged_attention(*args, query_start_loc=tqsl, out=out, stream=per_thread)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(mine,)) for mine in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    for i, mine in enumerate(outs):
        for j, out in enumerate(mine):
            assert torch.equal(out, alone), f"thread {i}, call {j}"


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_a_block_stride_beyond_32_bits(rng, layout):
    """Caches that are views with 2^31 + 4096 elements between blocks (an engine's layer
    tensor could be that large): the copies of token-major rows leave their 32-bit products
    for 64-bit ones (PrefillKernelParams::strides32), the vllm copies take 64-bit products
    always, and every row is right in both layouts. Two blocks of 4.3 GB apart per cache,
    nothing between them written or read."""
    props = torch.cuda.get_device_properties(0)
    block = 16 * 2 * 128  # [B, K, D] elements
    stride = 2**31 + block
    if props.total_memory < 24 * 2**30:
        pytest.skip("needs about 9 GB of GPU memory")
    seq_lens, q_lens = [32, 20], [32, 7]
    nh, kv, d = 8, 2, 128
    k = rng.standard_normal((2, 16, kv, d)).astype(np.float16)
    v = rng.standard_normal((2, 16, kv, d)).astype(np.float16)
    bt = np.array([[1, 0], [0, 1]], np.int32)
    sl = np.array(seq_lens, np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), nh, d)).astype(np.float16)
    ref = paged_attention_ref(q, k, v, bt, sl, query_start_loc=qsl, layout="nhd")
    if layout == "vllm":  # keys [N, K, D/8, B, 8], values [N, K, D, B]
        hosts = [k.reshape(2, 16, kv, d // 8, 8).transpose(0, 2, 3, 1, 4), v.transpose(0, 2, 3, 1)]
    else:
        hosts = [k, v]
    caches = []
    for host in hosts:
        host = np.ascontiguousarray(host)
        inner = tuple(s // host.itemsize for s in host.strides[1:])
        store = torch.empty(stride + block, dtype=torch.float16, device="cuda")
        view = store.as_strided(host.shape, (stride,) + inner)
        view.copy_(torch.from_numpy(host))
        caches.append(view)
    args = [to_torch(q), *caches, to_torch(bt), to_torch(sl)]
    for mql in (None, 32):
        out = pagedattn.paged_attention(*args, query_start_loc=to_torch(qsl), max_query_len=mql, layout=layout)
        assert_close(to_numpy(out), ref, "float16", f"{layout}, max_query_len={mql}")
    del caches, args
    torch.cuda.empty_cache()


@pytest.mark.skipif(not HOPPER, reason="the Hopper kernel only")
def test_the_hopper_kernel_with_one_block_per_item():
    """PAGEDATTN_SM90_PERSISTENT=0: the Hopper kernel on a grid of one block per work item
    (as checked calls run it) instead of its persistent grid; the same tests pass."""
    if family() != "sm90_wgmma":
        pytest.skip("this build has no Hopper kernels")
    run_tests_with("PAGEDATTN_SM90_PERSISTENT", "0", [
        "test_cuda_prefill.py::test_mixed_batch", "test_cuda_prefill.py::test_head_sizes",
        "test_cuda_prefill_sm90.py::test_pipeline_edges", "test_cuda_prefill_sm90.py::test_windows_start_inside_a_page",
        "test_cuda_prefill_sm90.py::test_a_running_maximum_that_jumps",
        "test_cuda_prefill_sm90.py::test_a_bad_block_id_spoils_only_the_rows_that_read_it"])  # fmt: skip


@pytest.mark.skipif(not HOPPER, reason="the sm_80 kernel is the default off Hopper")
def test_the_sm80_kernel_on_hopper():
    """PAGEDATTN_PREFILL_KERNEL=mma: decode_plan reports the sm_80 kernel, and the varlen
    tests of both files pass with it (in a subprocess: the variable is read once)."""
    if family() != "sm90_wgmma":
        pytest.skip("this build has no Hopper kernels")
    env = run_tests_with("PAGEDATTN_PREFILL_KERNEL", "mma", [
        "test_cuda_prefill.py::test_mixed_batch", "test_cuda_prefill.py::test_head_sizes",
        "test_cuda_prefill.py::test_gqa_groups_alibi_scale",
        "test_cuda_prefill.py::test_max_query_len_bound_and_strided",
        "test_cuda_prefill_sm90.py::test_pipeline_edges",
        "test_cuda_prefill_sm90.py::test_a_bad_block_id_spoils_only_the_rows_that_read_it"])  # fmt: skip
    code = "import pagedattn; print(pagedattn.decode_plan(4, 32, 8, 128, 16, 64, 'bfloat16', 'nhd')['varlen_kernel'])"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == "sm80_mma", got.stderr
