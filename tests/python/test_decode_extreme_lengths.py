"""Sequences at the length limit: a block table may reach supported()["max_context_tokens"]
(2**30) tokens per sequence, max_blocks_per_seq x block_size, and no further.

Past 2**30 the kernels' 32-bit token arithmetic (a position plus a partition or a tile)
could wrap: before the limit existed, a CPU varlen call at seq_len 2**31 - 1024 + 1 with a
16-token window crashed (a key chunk's start wrapped negative and indexed the block table
before its start), and a CPU decode there returned 0.015 where every value was 1. So a
table past the limit is refused with a ValueError naming the limit, and at the limit every
path gives the float64 answer: a sliding window keeps those calls fast (only the last
block is read; every other slot holds NaN), and a decode without a window is seen to get
past its set-up into the kernel (attending over 2**30 tokens takes minutes on a CPU). On a
GPU the same calls run, and a seq_len of 2**31 - 1 (invalid: past the table) with a window,
whose partitions are laid from the unchecked length, gives NaN and leaves the context
usable (that length once made the decode kernel read block ids before its table row).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import pagedattn
from conftest import SUPPORTED
from pagedattn.reference import paged_attention_ref

LIMIT = SUPPORTED["max_context_tokens"]
WINDOW = 16
ROWS = 2  # query rows of the varlen call (the last tokens of the sequence)


def test_the_limit_is_2_pow_30():
    assert LIMIT == 2**30


def _problem(rng, layout, block_size, *, heads=4, kv_heads=2, head_size=64):
    """One sequence of LIMIT tokens in a table of LIMIT / block_size columns: block 1 holds
    its last block (the 32 last tokens written with reshape_and_cache, the slots before
    them NaN), every other column names block 0, all NaN. Returns the arrays and the
    float64 output of the last ROWS query rows under the window (the reference reads only
    the window's blocks)."""
    ks, vs = pagedattn.kv_cache_shape(2, block_size, kv_heads, head_size, "float32", layout)
    kc, vc = np.full(ks, np.nan, np.float32), np.full(vs, np.nan, np.float32)
    n = 32
    k = rng.standard_normal((n, kv_heads, head_size)).astype(np.float32)
    v = rng.standard_normal((n, kv_heads, head_size)).astype(np.float32)
    slots = (block_size + np.arange(block_size - n, block_size)).astype(np.int64)
    pagedattn.reshape_and_cache(k, v, kc, vc, slots, layout=layout)
    cols = LIMIT // block_size
    bt = np.zeros((1, cols), np.int32)
    bt[0, -1] = 1
    q = rng.standard_normal((ROWS, heads, head_size)).astype(np.float32)
    ref = paged_attention_ref(q, kc, vc, bt, np.array([LIMIT], np.int32), sliding_window=WINDOW, layout=layout,
                              query_start_loc=np.array([0, ROWS], np.int32))  # fmt: skip
    assert np.isfinite(ref).all()
    return q, kc, vc, bt, ref


@pytest.mark.parametrize("layout", ["vllm", "nhd", "hnd"])
def test_cpu_at_the_limit_decode_and_varlen_are_exact(rng, layout):
    q, kc, vc, bt, ref = _problem(rng, layout, 1024)
    lens = np.array([LIMIT], np.int32)
    out = pagedattn.paged_attention(q[-1:], kc, vc, bt, lens, sliding_window=WINDOW, layout=layout)
    np.testing.assert_allclose(out[0], ref[-1], rtol=1e-5, atol=1e-5)
    qsl = np.array([0, ROWS], np.int32)
    out = pagedattn.paged_attention(q, kc, vc, bt, lens, sliding_window=WINDOW, query_start_loc=qsl,
                                    max_query_len=ROWS, layout=layout)  # fmt: skip
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 1024])
def test_a_table_past_the_limit_is_refused(block_size):
    ks, vs = pagedattn.kv_cache_shape(1, block_size, 1, 64, "float32", "nhd")
    kc, vc = np.zeros(ks, np.float32), np.zeros(vs, np.float32)
    q = np.ones((1, 1, 64), np.float32)
    cols = LIMIT // block_size + 1
    bt = np.zeros((1, cols), np.int32)
    with pytest.raises(ValueError, match=rf"max_blocks_per_seq {cols} x block_size {block_size}.*{LIMIT}"):
        pagedattn.paged_attention(q, kc, vc, bt, np.array([3], np.int32))
    with pytest.raises(ValueError, match=r"max_context_tokens"):
        pagedattn.paged_attention(q, kc, vc, bt, np.array([3], np.int32), sliding_window=WINDOW,
                                  query_start_loc=np.array([0, 1], np.int32), max_query_len=1)  # fmt: skip


def test_cpu_a_length_past_the_table_is_an_index_error():
    ks, vs = pagedattn.kv_cache_shape(1, 1024, 1, 64, "float32", "nhd")
    kc, vc = np.zeros(ks, np.float32), np.zeros(vs, np.float32)
    bt = np.zeros((1, LIMIT // 1024), np.int32)
    with pytest.raises(IndexError, match="seq_lens"):
        pagedattn.paged_attention(np.ones((1, 1, 64), np.float32), kc, vc, bt, np.array([2**31 - 1], np.int32),
                                  sliding_window=WINDOW)  # fmt: skip


SCRIPT = textwrap.dedent(
    f"""
    import numpy as np, pagedattn
    bs, L = 1024, {LIMIT}
    ks, vs = pagedattn.kv_cache_shape(1, bs, 1, 64, "float32")
    kc = np.zeros(ks, np.float32)      # every logit 0: uniform attention
    vc = np.ones(vs, np.float32)       # so the output is exactly 1
    bt = np.zeros((1, L // bs), np.int32)
    q = np.ones((1, 1, 64), np.float32)
    print("started", flush=True)
    out = pagedattn.paged_attention(q, kc, vc, bt, np.array([L], np.int32))
    print("ok" if np.allclose(out, 1.0, atol=1e-3) else f"wrong {{out.ravel()[:4]}}", flush=True)
    """
)


def test_cpu_decode_without_a_window_at_the_limit_reaches_the_kernel():
    p = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        if p.poll() is None:  # computing over 2**30 tokens: past every size computation
            return
        out, err = p.communicate()
        assert p.returncode == 0 and out.split() == ["started", "ok"], out + err
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
        pytest.skip("needs a CUDA device and pagedattn built with CUDA")
    return torch


@pytest.mark.parametrize("layout", ["vllm", "nhd"])
def test_cuda_at_the_limit_decode_and_varlen_are_exact(rng, layout):
    torch = _cuda()
    q, kc, vc, bt, ref = _problem(rng, layout, 256)
    dev = [torch.from_numpy(a).cuda() for a in (q, kc, vc, bt)]
    lens = torch.tensor([LIMIT], dtype=torch.int32, device="cuda")
    out = pagedattn.paged_attention(dev[0][-1:], *dev[1:], lens, sliding_window=WINDOW, layout=layout)
    np.testing.assert_allclose(out.cpu().numpy()[0], ref[-1], rtol=1e-4, atol=1e-4)
    qsl = torch.tensor([0, ROWS], dtype=torch.int32, device="cuda")
    out = pagedattn.paged_attention(*dev, lens, sliding_window=WINDOW, query_start_loc=qsl, max_query_len=ROWS,
                                    layout=layout)  # fmt: skip
    np.testing.assert_allclose(out.cpu().numpy(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [1, 16, 100, 1000])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_a_length_near_2_pow_31_with_a_window_gives_nan(window, dtype):
    torch = _cuda()
    tdt = getattr(torch, dtype)
    ks, vs = pagedattn.kv_cache_shape(4, 16, 2, 128, dtype, "nhd")
    kc, vc = torch.randn(ks, device="cuda").to(tdt), torch.randn(vs, device="cuda").to(tdt)
    bt = torch.zeros((3, 4), dtype=torch.int32, device="cuda")
    lens = torch.tensor([2**31 - 1, 40, 2**31 - 17], dtype=torch.int32, device="cuda")
    q = torch.randn((3, 8, 128), device="cuda").to(tdt)
    out = pagedattn.paged_attention(q, kc, vc, bt, lens, sliding_window=window)
    torch.cuda.synchronize()  # no illegal address: the context stays usable
    got = out.float().cpu().numpy()
    assert np.isnan(got[[0, 2]]).all() and np.isfinite(got[1]).all()
    with pytest.raises(IndexError, match="seq_lens"):
        pagedattn.paged_attention(q, kc, vc, bt, lens, sliding_window=window, check_block_tables=True)
