"""DLPack interop: NumPy always; torch, JAX when installed. Output kind follows the query."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import DTYPE_NAMES, assert_close, make_problem
from pagedattn.reference import paged_attention_ref


def test_numpy_in_numpy_out(rng):
    p = make_problem(rng, [10, 3])
    out = pagedattn.paged_attention(*p.args())
    assert type(out) is np.ndarray


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_torch_cpu(rng, dtype_name):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype_name)
    p = make_problem(rng, [1, 17, 64], num_heads=8, num_kv_heads=2, dtype=np.float32, layout="nhd")
    t = [torch.from_numpy(a).to(dt) for a in (p.query, p.key_cache, p.value_cache)]
    bt, sl = torch.from_numpy(p.block_tables), torch.from_numpy(p.seq_lens)
    out = pagedattn.paged_attention(t[0], t[1], t[2], bt, sl)
    assert isinstance(out, torch.Tensor) and out.dtype == dt and out.device.type == "cpu"
    ref = paged_attention_ref(*(x.float().numpy() for x in t), p.block_tables, p.seq_lens)
    assert_close(out.float().numpy(), ref, dtype_name)


def test_torch_cpu_reshape_and_cache_bf16(rng):
    torch = pytest.importorskip("torch")
    kshape, vshape = pagedattn.kv_cache_shape(4, 16, 2, 64, torch.bfloat16)
    kc = torch.full(kshape, float("nan"), dtype=torch.bfloat16)
    vc = torch.full(vshape, float("nan"), dtype=torch.bfloat16)
    key = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    value = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, 18, -1, 63])
    pagedattn.reshape_and_cache(key, value, kc, vc, slots)
    kc_ref = np.full(kshape, np.nan, np.float32)
    vc_ref = np.full(vshape, np.nan, np.float32)
    pagedattn.reference.reshape_and_cache_ref(key.float().numpy(), value.float().numpy(), kc_ref, vc_ref,
                                              slots.numpy())  # fmt: skip
    np.testing.assert_array_equal(kc.float().numpy(), kc_ref)
    np.testing.assert_array_equal(vc.float().numpy(), vc_ref)


def test_torch_strided_query_from_fused_qkv(rng):
    torch = pytest.importorskip("torch")
    p = make_problem(rng, [30, 2], num_heads=4, num_kv_heads=2)
    qkv = torch.randn(2, 8, 64)
    q = qkv[:, :4]
    out = pagedattn.paged_attention(q, *(torch.from_numpy(a) for a in p.args()[1:]))
    ref = paged_attention_ref(q.numpy(), *p.args()[1:])
    assert_close(out.numpy(), ref, np.float32)


def test_torch_out_argument(rng):
    torch = pytest.importorskip("torch")
    p = make_problem(rng, [30, 2], num_heads=4, num_kv_heads=2)
    out = torch.full((2, 4, 64), float("nan"))
    res = pagedattn.paged_attention(*(torch.from_numpy(a) for a in p.args()), out=out)
    assert res is out
    assert_close(out.numpy(), paged_attention_ref(*p.args()), np.float32)


def test_torch_cuda_arrays_rejected_without_cuda_build():
    torch = pytest.importorskip("torch")
    if pagedattn.built_with_cuda() or not torch.cuda.is_available():
        pytest.skip("needs a CPU-only build on a machine with a GPU")
    q = torch.zeros(1, 1, 64, device="cuda")
    with pytest.raises(ValueError, match="not supported by this build"):
        pagedattn.paged_attention(q, q, q, q, q)


def test_jax_cpu(rng):
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]
    p = make_problem(rng, [9, 40], num_heads=4, num_kv_heads=1)
    out = pagedattn.paged_attention(*(jax.device_put(a, cpu) for a in p.args()))
    assert isinstance(out, jax.Array)
    assert_close(np.asarray(out), paged_attention_ref(*p.args()), np.float32)


def test_jax_gpu_needs_out(rng):
    """JAX arrays are immutable: on a GPU there is no array of theirs to write into."""
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU")
    if not pagedattn.built_with_cuda():
        pytest.skip("pagedattn built without CUDA")
    p = make_problem(rng, [9], num_heads=4, num_kv_heads=1, block_size=16, head_size=64)
    with pytest.raises(TypeError, match="pass out="):
        pagedattn.paged_attention(*(jax.device_put(a, gpu) for a in p.args()))


def test_ml_dtypes_bfloat16_numpy(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    p = make_problem(rng, [33, 1], dtype=bf16)
    out = pagedattn.paged_attention(*p.args())
    assert out.dtype == bf16
    assert_close(out, paged_attention_ref(*p.args()), bf16)


def test_gil_released_threads_run_concurrently(rng):
    """Two Python threads calling in parallel both get correct answers."""
    import threading

    p = make_problem(rng, [700, 300], num_heads=8, num_kv_heads=2, dtype=np.float16)
    ref = paged_attention_ref(*p.args())
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(pagedattn.paged_attention(*p.args()))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 15
    for r in results:
        assert_close(r, ref, np.float16)
