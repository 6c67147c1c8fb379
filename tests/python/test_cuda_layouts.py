"""Cache layouts and block-strided caches on CUDA, in every op.

The problems are test_layouts.py's (NaN everywhere no sequence owns, the other half of
an [N, 2, ...] allocation included), moved to the GPU as whole allocations so that the
caches stay views of them. Every output is checked against the float64 reference and the
CPU path; writes and block moves against the CPU ops on the same views.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_layouts import NAN_FP8, cache_pair, problem

import pagedattn
from conftest import ALL_LAYOUTS, CUDA_BLOCK_SIZES, FP8_KV_CACHE_DTYPES, TOL, assert_close, np_dtype
from pagedattn.reference import paged_attention_ref

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
    pytest.skip("needs a CUDA device and pagedattn built with CUDA", allow_module_level=True)

DEV = torch.device("cuda", 0)
from torch_arrays import to_numpy, to_torch  # noqa: E402

STORAGES = ["contiguous", "n2", "2n", "padded"]
DTYPES = [d for d in ("float32", "float16", "bfloat16") if np_dtype(d) is not None]


def view_on_gpu(view: np.ndarray, backing: list[np.ndarray], gpu_backing: list):
    """The tensor that is to gpu_backing (CUDA or pinned copies of `backing`) what `view`
    is to its NumPy backing array (same element offset and strides)."""
    for b, g in zip(backing, gpu_backing):
        if np.shares_memory(view, b):
            item = view.dtype.itemsize
            offset = (view.__array_interface__["data"][0] - b.__array_interface__["data"][0]) // item
            strides = tuple(s // item for s in view.strides)
            t = torch.as_strided(g, view.shape, strides, offset)
            assert t.data_ptr() == g.data_ptr() + offset * item
            return t
    raise AssertionError("the view is not in any backing array")


def gpu_caches(kc, vc, backing):
    gb = [to_torch(b) for b in backing]
    return view_on_gpu(kc, backing, gb), view_on_gpu(vc, backing, gb), gb


def check_cuda(query, kc, vc, tables, lens, kw, backing, dtype, kernel="auto", **extra):
    """paged_attention on the GPU views of the caches against the float64 reference and the
    CPU path; `extra` holds array options (query_start_loc), given to all three."""
    kt, vt, _ = gpu_caches(kc, vc, backing)
    ex = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in extra.items()}
    out = to_numpy(pagedattn.paged_attention(to_torch(query), kt, vt, to_torch(tables), to_torch(lens), kernel=kernel,
                                             **kw, **ex))  # fmt: skip
    ref = paged_attention_ref(query, kc, vc, tables, lens, **kw, **extra)
    assert_close(out, ref, dtype, "cuda vs float64 reference")
    cpu = pagedattn.paged_attention(query, kc, vc, tables, lens, **kw, **extra)
    atol, rtol = TOL[np.dtype(dtype).name]
    np.testing.assert_allclose(out.astype(np.float64), np.asarray(cpu).astype(np.float64), atol=2 * atol,
                               rtol=2 * rtol, err_msg="cuda vs cpu")  # fmt: skip
    return out


# ---- hnd ------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_size", [64, 128, 40])  # specialised and generic
@pytest.mark.parametrize("dtype", DTYPES)
def test_hnd_decode_and_varlen(rng, dtype, head_size):
    dt = np_dtype(dtype)
    lens = [1, 15, 16, 17, 100]
    q, kc, vc, bt, sl, kw, back = problem(rng, lens, layout="hnd", storage="contiguous", dtype=dt, d=head_size,
                                          block_size=16, group=4)  # fmt: skip
    check_cuda(q, kc, vc, bt, sl, kw, back, dt)
    q_lens = [1, 7, 16, 0, 40]
    q, kc, vc, bt, sl, kw, back = problem(rng, lens, layout="hnd", storage="contiguous", dtype=dt, d=head_size,
                                          block_size=16, group=4, q_lens=q_lens)  # fmt: skip
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    check_cuda(q, kc, vc, bt, sl, kw, back, dt, query_start_loc=qsl)


@pytest.mark.parametrize("kernel", ["single_pass", "partitioned"])
def test_hnd_decode_kernels(rng, kernel):
    q, kc, vc, bt, sl, kw, back = problem(rng, [3, 700, 2049], layout="hnd", storage="contiguous", dtype=np.float16,
                                          d=128, block_size=16, group=8)  # fmt: skip
    check_cuda(q, kc, vc, bt, sl, kw, back, np.float16, kernel=kernel)


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
def test_hnd_fp8(rng, kind):
    q, kc, vc, bt, sl, kw, back = problem(rng, [5, 64], layout="hnd", storage="contiguous", dtype=np.float16,
                                          d=128, block_size=16, kind=kind)  # fmt: skip
    check_cuda(q, kc, vc, bt, sl, kw, back, np.float16)


# ---- block-strided caches --------------------------------------------------------------------


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_strided_caches_decode_and_varlen(rng, dtype, layout, storage):
    dt = np_dtype(dtype)
    lens, q_lens = [1, 16, 33, 80], [1, 5, 0, 33]
    q, kc, vc, bt, sl, kw, back = problem(rng, lens, layout=layout, storage=storage, dtype=dt, d=64, block_size=16)
    check_cuda(q, kc, vc, bt, sl, kw, back, dt)
    q, kc, vc, bt, sl, kw, back = problem(rng, lens, layout=layout, storage=storage, dtype=dt, d=64, block_size=16,
                                          q_lens=q_lens)  # fmt: skip
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    check_cuda(q, kc, vc, bt, sl, kw, back, dt, query_start_loc=qsl)


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_strided_fp8_caches(rng, layout, kind):
    q, kc, vc, bt, sl, kw, back = problem(rng, [9, 50], layout=layout, storage="n2", dtype=np.float16, d=128,
                                          block_size=16, kind=kind)  # fmt: skip
    check_cuda(q, kc, vc, bt, sl, kw, back, np.float16)


@pytest.mark.parametrize("kind", ["auto"] + FP8_KV_CACHE_DTYPES)
@pytest.mark.parametrize("storage", ["n2", "2n", "padded"])
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_strided_reshape_and_cache_matches_cpu(rng, layout, storage, kind):
    fp8 = kind != "auto"
    cdt = np.uint8 if fp8 else np.float16
    fill = NAN_FP8 if fp8 else np.nan
    kc, vc, back = cache_pair(6, 16, 2, 64, cdt, layout, storage, fill)
    kt, vt, gback = gpu_caches(kc, vc, back)
    slots = np.array([3, 0, -1, 95, 40, 17], np.int64)
    key = rng.standard_normal((6, 2, 64)).astype(np.float16)
    value = rng.standard_normal((6, 2, 64)).astype(np.float16)
    kw = dict(layout=layout)
    if fp8:
        kw.update(kv_cache_dtype=kind, k_scale=0.02, v_scale=0.03)
    pagedattn.reshape_and_cache(to_torch(key), to_torch(value), kt, vt, to_torch(slots), **kw)
    pagedattn.reshape_and_cache(key, value, kc, vc, slots, **kw)
    torch.cuda.synchronize()
    for g, b in zip(gback, back):  # the whole allocations: the other half and padding untouched
        assert np.array_equal(to_numpy(g), b, equal_nan=True)


@pytest.mark.parametrize("storage", ["n2", "2n", "padded"])
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_strided_copy_and_swap_blocks(rng, layout, storage):
    kc, vc, back = cache_pair(8, 16, 2, 64, np.float16, layout, storage, np.nan)
    kc[...] = rng.standard_normal(kc.shape)
    vc[...] = rng.standard_normal(vc.shape)
    kt, vt, gback = gpu_caches(kc, vc, back)
    pairs = [(0, 5), (7, 1), (2, 3)]
    pagedattn.copy_blocks([kt], [vt], pairs)
    pagedattn.copy_blocks([kc], [vc], pairs)
    torch.cuda.synchronize()
    for g, b in zip(gback, back):
        assert np.array_equal(to_numpy(g), b, equal_nan=True)
    # GPU view -> pinned host view and back, through strided copies
    host_k, _, host_back = cache_pair(8, 16, 2, 64, np.float16, layout, storage, np.nan)
    pinned = [torch.from_numpy(b).pin_memory() for b in host_back]
    hk = view_on_gpu(host_k, host_back, pinned)  # the same view of the pinned copies
    stream = torch.cuda.current_stream()
    pagedattn.swap_blocks(kt, hk, [(5, 0), (1, 6), (4, 4)])
    stream.synchronize()
    got = hk.numpy()
    for s, d in [(5, 0), (1, 6), (4, 4)]:
        assert np.array_equal(got[d], kc[s])
    assert np.isnan(got[[1, 2, 3, 5, 7]]).all()
    # and back into the GPU cache's block 2
    pagedattn.swap_blocks(hk, kt, [(6, 2)])
    stream.synchronize()
    assert np.array_equal(to_numpy(kt[2]), kc[1])


def test_cuda_block_stride_must_be_16_byte_multiple(rng):
    q, kc, vc, bt, sl, kw, back = problem(rng, [5], layout="nhd", storage="contiguous", dtype=np.float16, d=64,
                                          block_size=16)  # fmt: skip
    n = kc.shape[0]
    elems = int(np.prod(kc.shape[1:]))
    buf = torch.full((n * (elems + 4),), float("nan"), dtype=torch.float16, device=DEV)  # stride 8 bytes past 16
    kt = torch.as_strided(buf, kc.shape, (elems + 4,) + tuple(s // 2 for s in kc.strides[1:]))
    kt.copy_(to_torch(kc))
    with pytest.raises(ValueError, match=r"key_cache: the CUDA kernels need a block stride .* multiple of 16 bytes, "
                                         r"got \d+ elements of 2 bytes"):  # fmt: skip
        pagedattn.paged_attention(to_torch(q), kt, to_torch(vc), to_torch(bt), to_torch(sl))


# ---- page sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_every_cuda_page_size_decode_varlen_and_write(rng, layout, block_size):
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 300]
    lens = [n for n in lens if n > 0]
    q, kc, vc, bt, sl, kw, back = problem(rng, lens, layout=layout, storage="n2", dtype=np.float16, d=128,
                                          block_size=block_size, group=4)  # fmt: skip
    check_cuda(q, kc, vc, bt, sl, kw, back, np.float16)
    for kernel in ("single_pass", "partitioned"):
        check_cuda(q, kc, vc, bt, sl, kw, back, np.float16, kernel=kernel)
    q_lens = [min(n, 37) for n in lens]
    q, kc, vc, bt, sl, kw, back = problem(rng, lens, layout=layout, storage="n2", dtype=np.float16, d=128,
                                          block_size=block_size, group=4, q_lens=q_lens)  # fmt: skip
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    check_cuda(q, kc, vc, bt, sl, kw, back, np.float16, query_start_loc=qsl)
    # float32 takes the CUDA-core kernels
    q, kc, vc, bt, sl, kw, back = problem(rng, lens, layout=layout, storage="n2", dtype=np.float32, d=64,
                                          block_size=block_size, group=2)  # fmt: skip
    check_cuda(q, kc, vc, bt, sl, kw, back, np.float32)
    # cache writes at this page size
    ck, cv, cback = cache_pair(4, block_size, 2, 64, np.float16, layout, "n2", np.nan)
    kt, vt, gback = gpu_caches(ck, cv, cback)
    slots = rng.permutation(4 * block_size)[: min(10, 4 * block_size)].astype(np.int64)
    key = rng.standard_normal((len(slots), 2, 64)).astype(np.float16)
    pagedattn.reshape_and_cache(to_torch(key), to_torch(key), kt, vt, to_torch(slots), layout=layout)
    pagedattn.reshape_and_cache(key, key, ck, cv, slots, layout=layout)
    torch.cuda.synchronize()
    assert np.array_equal(to_numpy(gback[0]), cback[0], equal_nan=True)


def test_hnd_plans_like_nhd():
    # hnd runs in the nhd kernels with other row strides: the same grid at every page size.
    for b in CUDA_BLOCK_SIZES:
        args = (8, 32, 8, 128, b, -(-16384 // b), "bfloat16")
        hnd = pagedattn.decode_plan(*args, layout="hnd", kernel="partitioned")
        assert hnd == pagedattn.decode_plan(*args, layout="nhd", kernel="partitioned"), b
        assert hnd["partition_size"] % 16 == 0 and hnd["num_partitions"] > 1


def test_vllm_one_token_pages_run_as_nhd():
    # A vllm cache of one-token blocks is byte for byte an nhd one: it gets the nhd plan and
    # workspace (the values the caller queries are those of the kernels that run); at other
    # page sizes the vllm plan stays its own. The numbers are checked for page 1 by
    # test_every_cuda_page_size_decode_varlen_and_write.
    for dtype, kind in (("bfloat16", "auto"), ("float16", "fp8_e4m3"), ("float32", "auto")):
        args = (8, 32, 8, 128, 1, 4096, dtype)
        vllm = pagedattn.decode_plan(*args, layout="vllm", kv_cache_dtype=kind)
        assert vllm == pagedattn.decode_plan(*args, layout="nhd", kv_cache_dtype=kind), dtype
        assert pagedattn.decode_workspace_size(*args, layout="vllm", kv_cache_dtype=kind) == vllm["workspace_bytes"]
