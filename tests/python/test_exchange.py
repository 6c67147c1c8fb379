"""Arrays converted through the DLPack C exchange API (`__dlpack_c_exchange_api__`, torch >= 2.11).

Every call converts each array once in C++: through its type's exchange table when it
offers one, else through ``__dlpack__`` / the buffer protocol. These tests check that
torch tensors compute the same results and raise the same errors whichever way they are
converted (an object offering only ``__dlpack__`` forces the second way), that mixed
kinds work, and that the output is allocated by the query's framework.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import BF16, DTYPE_NAMES, LAYOUTS, DLPackOnly, assert_close, make_problem
from pagedattn import _core
from pagedattn.reference import paged_attention_ref

torch = pytest.importorskip("torch")
import torch_arrays  # noqa: E402  (needs torch)

if not _core.exchange_api_available(torch.empty(0)):
    pytest.skip("this torch does not offer the DLPack C exchange API", allow_module_level=True)


def to_torch(a):
    """NumPy (ml_dtypes bfloat16 included) -> torch CPU tensor with the same values."""
    return torch_arrays.to_torch(a, "cpu")


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_exchange_matches_reference(rng, dtype_name, layout):
    if dtype_name == "bfloat16" and BF16 is None:
        pytest.skip("needs ml_dtypes")
    dt = getattr(torch, dtype_name)
    npdt = BF16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    p = make_problem(rng, [1, 16, 17, 95], num_heads=8, num_kv_heads=2, layout=layout, alibi=True, dtype=npdt)
    t = [to_torch(a) for a in (p.query, p.key_cache, p.value_cache)]
    bt, sl, al = to_torch(p.block_tables), to_torch(p.seq_lens), to_torch(p.alibi_slopes)
    assert _core.exchange_api_available(t[0])
    out = pagedattn.paged_attention(*t, bt, sl, alibi_slopes=al, scale=0.3)
    assert isinstance(out, torch.Tensor), "the output is allocated by the query's framework"
    assert out.dtype == dt and tuple(out.shape) == p.query.shape
    ref = paged_attention_ref(*(x.float().numpy() for x in t), p.block_tables, p.seq_lens, scale=0.3,
                              alibi_slopes=p.alibi_slopes)  # fmt: skip
    assert_close(out.float().numpy(), ref, dtype_name)
    # the same bits when every array is converted through __dlpack__ instead
    gen = torch.empty_like(out)
    args = [DLPackOnly(x) for x in (*t, bt, sl)]
    r = pagedattn.paged_attention(*args, alibi_slopes=DLPackOnly(al), scale=0.3, out=DLPackOnly(gen))
    assert isinstance(r, DLPackOnly) and r.a is gen
    assert torch.equal(gen.view(torch.uint8), out.view(torch.uint8))


def test_exchange_out_strided_query_and_int_stream(rng):
    p = make_problem(rng, [30, 2, 64], num_heads=4, num_kv_heads=2)
    qkv = torch.randn(3, 12, 64)
    q = qkv[:, 4:8]  # strided in the head dimension's parent
    out = torch.full((3, 4, 64), float("nan"))
    r = pagedattn.paged_attention(q, *(to_torch(a) for a in p.args()[1:]), out=out, stream=0)
    assert r is out
    assert_close(out.numpy(), paged_attention_ref(q.numpy(), *p.args()[1:]), np.float32)


def test_mixed_kinds_and_dlpack_only_query(rng):
    p = make_problem(rng, [20, 3])
    args = [to_torch(a) for a in p.args()]
    args[3] = p.block_tables  # a NumPy array among torch tensors
    out = pagedattn.paged_attention(*args)
    assert isinstance(out, torch.Tensor)
    assert_close(out.numpy(), paged_attention_ref(*p.args()), np.float32)
    # A query that only offers __dlpack__ (no framework to ask): a NumPy output on the host.
    out = pagedattn.paged_attention(DLPackOnly(args[0]), *args[1:])
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert_close(out, paged_attention_ref(*p.args()), np.float32)
    with pytest.raises(TypeError, match="stream: expected an int handle or an object with __cuda_stream__"):
        pagedattn.paged_attention(*args, stream="not a handle")


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(bt=a["bt"].long()), TypeError, "block_tables"),
        (lambda a: a.update(sl=a["sl"][:1]), ValueError, "seq_lens"),
        (lambda a: a.update(q=a["q"][..., :32]), ValueError, "head"),
        (lambda a: a.update(kc=a["kc"].half()), TypeError, "key_cache"),
        (lambda a: a.update(sl=torch.tensor([5, 10_000], dtype=torch.int32)), IndexError, "seq_lens"),
    ],
)
def test_exchange_errors_match_general_path(rng, mutate, exc, match):
    p = make_problem(rng, [20, 3])
    a = dict(zip(("q", "kc", "vc", "bt", "sl"), (to_torch(x) for x in p.args())))
    mutate(a)
    args = (a["q"], a["kc"], a["vc"], a["bt"], a["sl"])
    out = torch.empty(tuple(p.query.shape))
    with pytest.raises(exc, match=match) as fast_err:
        pagedattn.paged_attention(*args, out=out)
    with pytest.raises(exc, match=match) as gen_err:
        pagedattn.paged_attention(*(DLPackOnly(x) for x in args), out=DLPackOnly(out))
    assert str(fast_err.value) == str(gen_err.value)


def test_exchange_num_seqs_mismatch_allocates_nothing(rng):
    p = make_problem(rng, [20, 3])
    args = [to_torch(a) for a in p.args()]
    args[0] = torch.randn(5, 4, 64)  # 5 queries, 2 sequences
    with pytest.raises(ValueError, match=r"block_tables: dimension 0 \(num_seqs, as in query\) must be 5, got 2"):
        pagedattn.paged_attention(*args)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reshape_and_cache_fast_path(rng, layout):
    kshape, vshape = pagedattn.kv_cache_shape(6, 16, 2, 64, torch.float16, layout)
    kc = torch.full(kshape, float("nan"), dtype=torch.float16)
    vc = torch.full(vshape, float("nan"), dtype=torch.float16)
    key, value = torch.randn(7, 2, 64, dtype=torch.float16), torch.randn(7, 2, 64, dtype=torch.float16)
    slots = torch.from_numpy(rng.permutation(96)[:7].astype(np.int64))
    slots[2] = -1  # padding
    pagedattn.reshape_and_cache(key, value, kc, vc, slots)
    kc_ref = np.full(kshape, np.nan, np.float16)
    vc_ref = np.full(vshape, np.nan, np.float16)
    pagedattn.reference.reshape_and_cache_ref(key.numpy(), value.numpy(), kc_ref, vc_ref, slots.numpy())
    np.testing.assert_array_equal(kc.numpy(), kc_ref)
    np.testing.assert_array_equal(vc.numpy(), vc_ref)
    # a NumPy cache among torch tensors
    kc2 = np.full(kshape, np.nan, np.float16)
    pagedattn.reshape_and_cache(key, value, kc2, vc, slots)
    np.testing.assert_array_equal(kc2, kc_ref)


def test_reshape_and_cache_fast_path_errors(rng):
    kshape, vshape = pagedattn.kv_cache_shape(2, 16, 2, 64, torch.float16)
    kc, vc = torch.zeros(kshape, dtype=torch.float16), torch.zeros(vshape, dtype=torch.float16)
    key = torch.randn(3, 2, 64, dtype=torch.float16)
    with pytest.raises(IndexError, match="slot_mapping"):
        pagedattn.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1, 32]))
    with pytest.raises(TypeError, match="slot_mapping"):
        pagedattn.reshape_and_cache(key, key, kc, vc, torch.tensor([0.0, 1.0, 2.0]))


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and _core.with_cuda), reason="needs a CUDA device")


@cuda
def test_exchange_runs_on_the_current_torch_stream(rng):
    """The kernel must be ordered after work queued on the current (non-default) stream."""
    dev = torch.device("cuda", 0)
    p = make_problem(rng, [700, 33, 1], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16)
    q_new = rng.standard_normal(p.query.shape).astype(np.float16)
    q = to_torch(p.query).to(dev)
    q_src = to_torch(q_new).to(dev)
    kc, vc, bt, sl = (to_torch(a).to(dev) for a in p.args()[1:])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(2_000_000)  # ~1 ms: the copy below lands late on s
        q.copy_(q_src)
        out = pagedattn.paged_attention(q, kc, vc, bt, sl)
    s.synchronize()
    ref = paged_attention_ref(q_new, *p.args()[1:])
    assert_close(out.cpu().numpy(), ref, np.float16)
