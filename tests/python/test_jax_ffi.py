"""pagedattn.jax: the XLA FFI handlers under jax.jit, donation, lax.scan and vmap, on the CPU
and (when JAX sees one and pagedattn has CUDA) the GPU; and the eager API's refusal to write
into JAX arrays, which are immutable.

The handler tests need a build with the handlers (jaxlib's headers found at build time);
they skip without, unless PAGEDATTN_JAX_FFI asks for them (CI), where that is a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import pagedattn
from conftest import BF16, assert_close, make_problem
from pagedattn import _core
from pagedattn.reference import paged_attention_ref, reshape_and_cache_ref

# JAX must not take most of the GPU's memory for itself when it starts here: the CUDA tests
# of other frameworks share the device (no effect where JAX already started).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

HANDLERS = bool(_core._jax_ffi_targets())
_ASKED = os.environ.get("PAGEDATTN_JAX_FFI", "").strip().lower() in ("1", "on", "true", "yes")


def test_handlers_built_when_asked():
    """CI builds with PAGEDATTN_JAX_FFI=1: a build that silently lost the handlers fails here."""
    if not _ASKED:
        pytest.skip("PAGEDATTN_JAX_FFI not set: the handlers are optional")
    targets = _core._jax_ffi_targets()
    assert set(targets) == {"cpu", "CUDA"}
    for platform in targets.values():
        assert set(platform) == {"pagedattn_paged_attention", "pagedattn_reshape_and_cache"}


needs_handlers = pytest.mark.skipif(not HANDLERS, reason="pagedattn was built without the XLA FFI handlers")


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
    """The JAX device a test runs on: the CPU always; the GPU when JAX sees one and pagedattn
    has its CUDA backend (skipped cleanly otherwise)."""
    if request.param == "cpu":
        return jax.devices("cpu")[0]
    gpu = _gpu()
    if gpu is None:
        pytest.skip("JAX sees no GPU")
    if not pagedattn.built_with_cuda():
        pytest.skip("pagedattn built without CUDA")
    return gpu


@pytest.fixture(scope="module")
def pj():
    if not HANDLERS:
        if _ASKED:
            pytest.fail("PAGEDATTN_JAX_FFI is set but pagedattn was built without the XLA FFI handlers")
        pytest.skip("pagedattn was built without the XLA FFI handlers")
    import pagedattn.jax

    return pagedattn.jax


def _put(device, *arrays):
    """JAX arrays on `device` that own their memory. (On the CPU, device_put may wrap a NumPy
    array's memory without a copy, and XLA cannot reuse a donated buffer it does not own.)"""
    return tuple(jax.device_put(np.asarray(a), device).copy() for a in arrays)


def _cpu(*arrays):
    """JAX arrays on the CPU (a machine with a GPU puts jnp.asarray's arrays there)."""
    return _put(jax.devices("cpu")[0], *arrays)


def _np(a):
    return np.asarray(jax.device_get(a))


def _same_bits(a, b, what=""):
    """Bitwise equality (NaN slots included, in any dtype)."""
    a, b = _np(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} != {b.shape} {b.dtype}"
    np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"), err_msg=what)


# ---- import isolation ---------------------------------------------------------------------


def test_import_pagedattn_does_not_import_jax():
    code = (
        "import sys, numpy as np, pagedattn\n"
        "q = np.zeros((1, 1, 8), np.float32)\n"
        "k, v = (np.zeros(s, np.float32) for s in pagedattn.kv_cache_shape(2, 4, 1, 8, np.float32))\n"
        "pagedattn.paged_attention(q, k, v, np.zeros((1, 1), np.int32), np.ones(1, np.int32))\n"
        "pagedattn.reshape_and_cache(q, q, k, v, np.zeros(1, np.int64))\n"
        "bad = [name for name in sys.modules if name == 'jax' or name.startswith(('jax.', 'jaxlib'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_handlers_the_import_error_says_how_to_build(pj):
    with pytest.raises(ImportError, match=r"no XLA FFI handlers.*--no-build-isolation.*PAGEDATTN_JAX_FFI=1"):
        pj._register({})


# ---- the eager API refuses to write into JAX arrays -------------------------------------


def _small(rng):
    return make_problem(rng, [5, 9], num_heads=4, num_kv_heads=2, head_size=32, block_size=8)


def test_eager_paged_attention_refuses_a_jax_out(rng):
    p = _small(rng)
    out = jnp.zeros(p.query.shape, jnp.float32)
    with pytest.raises(TypeError, match=r"^out: got a JAX array, which is immutable.*pagedattn\.jax"):
        pagedattn.paged_attention(*p.args(), out=out)
    assert not np.asarray(out).any(), "the refused call wrote into the JAX array"


def test_eager_paged_attention_refuses_a_jax_workspace(rng):
    p = _small(rng)
    with pytest.raises(TypeError, match=r"^workspace: got a JAX array"):
        pagedattn.paged_attention(*p.args(), workspace=jnp.zeros(1024, jnp.uint8))


def test_eager_reshape_and_cache_refuses_jax_caches(rng):
    p = _small(rng)
    key = rng.standard_normal((2, 2, 32)).astype(np.float32)
    slots = np.array([0, 1], np.int64)
    kc, vc = jnp.asarray(p.key_cache), jnp.asarray(p.value_cache)
    with pytest.raises(TypeError, match=r"^key_cache: got a JAX array.*reshape_and_cache returns the updated caches"):
        pagedattn.reshape_and_cache(key, key, kc, p.value_cache, slots)
    with pytest.raises(TypeError, match=r"^value_cache: got a JAX array"):
        pagedattn.reshape_and_cache(key, key, p.key_cache, vc, slots)
    np.testing.assert_array_equal(np.asarray(kc), p.key_cache)


def test_eager_block_ops_refuse_jax_caches(rng):
    p = _small(rng)
    kc = jnp.asarray(p.key_cache)
    with pytest.raises(TypeError, match=r"^key_caches: got a JAX array"):
        pagedattn.copy_blocks(kc, [], [[0, 1]])
    with pytest.raises(TypeError, match=r"^value_caches\[1\]: got a JAX array"):
        pagedattn.copy_blocks([], [p.value_cache, kc], [[0, 1]])
    with pytest.raises(TypeError, match=r"^dst: got a JAX array"):
        pagedattn.swap_blocks(p.key_cache, kc, [[0, 1]])
    np.testing.assert_array_equal(np.asarray(kc), p.key_cache)


def test_block_manager_refuses_jax_outputs():
    m = pagedattn.BlockManager(8, 4)
    m.add_sequence(0, [1, 2, 3, 4, 5])
    with pytest.raises(TypeError, match=r"^block_tables: got a JAX array"):
        m.step_into([0], [6], block_tables=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(TypeError, match=r"^slot_mapping: got a JAX array"):
        m.step([0], [6], slot_mapping=jnp.zeros(1, jnp.int32))
    with pytest.raises(TypeError, match=r"^out: got a JAX array"):
        m.block_tables([0], out=jnp.zeros((1, 4), jnp.int32))


def test_eager_calls_read_jax_arrays(rng):
    """Arrays pagedattn only reads may be JAX arrays: the eager calls take them as before."""
    p = _small(rng)
    out = pagedattn.paged_attention(*_cpu(*p.args()))
    assert isinstance(out, jax.Array)
    assert_close(np.asarray(out), paged_attention_ref(*p.args()), np.float32)
    key = rng.standard_normal((2, 2, 32)).astype(np.float32)
    value = rng.standard_normal((2, 2, 32)).astype(np.float32)
    slots = np.array([3, 40], np.int64)
    kc, vc = p.key_cache.copy(), p.value_cache.copy()
    pagedattn.reshape_and_cache(*_cpu(key, value), kc, vc, *_cpu(slots))
    reshape_and_cache_ref(key, value, p.key_cache, p.value_cache, slots)
    np.testing.assert_array_equal(kc, p.key_cache)
    np.testing.assert_array_equal(vc, p.value_cache)


def test_eager_call_inside_jit_points_at_pagedattn_jax(rng):
    p = _small(rng)

    def step(q):
        return pagedattn.paged_attention(q, *p.args()[1:])

    with pytest.raises(TypeError, match=r"^query: got a traced JAX value.*use pagedattn\.jax"):
        jax.jit(step)(jnp.asarray(p.query))


# ---- handlers: a decode step under jit, with and without donation ------------------------


def _decode_step(pj, q, k_new, v_new, key_cache, value_cache, slots, block_tables, seq_lens):
    key_cache, value_cache = pj.reshape_and_cache(k_new, v_new, key_cache, value_cache, slots)
    return pj.paged_attention(q, key_cache, value_cache, block_tables, seq_lens), key_cache, value_cache


def _growing_problem(rng, start, grow, block_size, **kw):
    """make_problem for sequences of lengths `start` that will grow by `grow` tokens: each
    sequence owns distinct blocks for all its tokens (the new ones' too), in a random order;
    its table's last entry pads, pointing at a NaN block nobody owns."""
    own = [-(-(int(n) + grow) // block_size) for n in start]
    num_blocks = sum(own) + 2
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(start), max(own) + 1), perm[-1], np.int32)
    pos = 0
    for i, n in enumerate(own):
        tables[i, :n] = perm[pos : pos + n]
        pos += n
    return make_problem(rng, start, block_size=block_size, block_tables=tables, num_blocks=num_blocks, **kw)


def _decode_inputs(rng, layout, dtype, num_heads=8, num_kv_heads=2, head_size=64, block_size=16):
    """A problem whose sequences each get one new token: the inputs of one decode step, the
    new token's slot included."""
    p = _growing_problem(rng, [0, 15, 16, 40], 1, block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_size=head_size, dtype=dtype, layout=layout)  # fmt: skip
    seq_lens = p.seq_lens + 1
    pos = p.seq_lens.astype(np.int64)
    slots = p.block_tables[np.arange(len(pos)), pos // block_size].astype(np.int64) * block_size + pos % block_size
    k_new = rng.standard_normal((len(pos), num_kv_heads, head_size)).astype(dtype)
    v_new = rng.standard_normal((len(pos), num_kv_heads, head_size)).astype(dtype)
    return p, k_new, v_new, slots.astype(np.int32), seq_lens


DECODE_CASES = [("vllm", np.float32), ("nhd", np.float16)] + ([("vllm", BF16)] if BF16 is not None else [])


@needs_handlers
@pytest.mark.parametrize("layout,dtype", DECODE_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
def test_jitted_decode_step_matches_eager_and_reference(pj, device, rng, layout, dtype, donate):
    p, k_new, v_new, slots, seq_lens = _decode_inputs(rng, layout, dtype)
    # The float64 reference (the cache writes are exact copies).
    kc_r, vc_r = p.key_cache.copy(), p.value_cache.copy()
    reshape_and_cache_ref(k_new, v_new, kc_r, vc_r, slots)
    ref = paged_attention_ref(p.query, kc_r, vc_r, p.block_tables, seq_lens)
    args = _put(device, p.query, k_new, v_new, p.key_cache, p.value_cache, slots, p.block_tables, seq_lens)
    # The eager call on the same device, whose numbers the jitted step must reproduce
    # exactly: the NumPy API on the CPU; on the GPU (no JAX array can be written there)
    # the same functions outside jit.
    if device.platform == "cpu":
        kc_e, vc_e = p.key_cache.copy(), p.value_cache.copy()
        pagedattn.reshape_and_cache(k_new, v_new, kc_e, vc_e, slots)
        out_e = pagedattn.paged_attention(p.query, kc_e, vc_e, p.block_tables, seq_lens)
    else:
        out_e = _np(_decode_step(pj, *args)[0])
    kc_ptr, vc_ptr = args[3].unsafe_buffer_pointer(), args[4].unsafe_buffer_pointer()
    step = jax.jit(lambda *a: _decode_step(pj, *a), donate_argnums=(3, 4) if donate else ())
    out, kc, vc = step(*args)
    assert out.dtype == args[0].dtype and out.shape == p.query.shape
    _same_bits(out, out_e, "out")
    _same_bits(kc, kc_r, "key_cache")
    _same_bits(vc, vc_r, "value_cache")
    assert_close(_np(out), ref, dtype)
    if donate:
        # The caches were written where they lay: no copy.
        assert args[3].is_deleted() and args[4].is_deleted()
        assert (kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()) == (kc_ptr, vc_ptr)
    else:
        # Functional: the caches passed in are unchanged (XLA copied them for the write).
        _same_bits(args[3], p.key_cache, "key_cache passed in")
        _same_bits(args[4], p.value_cache, "value_cache passed in")
        assert kc.unsafe_buffer_pointer() != kc_ptr


@needs_handlers
def test_calls_outside_jit(pj, device, rng):
    """Outside jit the functions run op by op, with the same results."""
    p, k_new, v_new, slots, seq_lens = _decode_inputs(rng, "vllm", np.float32)
    args = _put(device, p.query, k_new, v_new, p.key_cache, p.value_cache, slots, p.block_tables, seq_lens)
    out, kc, vc = _decode_step(pj, *args)
    jitted = jax.jit(lambda *a: _decode_step(pj, *a))(*args)
    for a, b, what in zip((out, kc, vc), jitted, ("out", "key_cache", "value_cache")):
        _same_bits(a, _np(b), what)
    _same_bits(args[3], p.key_cache, "key_cache passed in")  # inputs untouched


# ---- handlers: several decode iterations under lax.scan ----------------------------------


@needs_handlers
@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donate"])
def test_decode_loop_under_scan(pj, device, rng, donate):
    """Each iteration writes one new token per sequence, then attends over the grown cache."""
    steps, block_size, heads, kv_heads, head_size = 5, 8, 4, 2, 64
    start = np.array([0, 3, 7, 8, 20], np.int32)  # lengths before the loop (0: a new sequence)
    p = _growing_problem(rng, start, steps, block_size, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size)
    s = len(start)
    pos = start[None, :] + np.arange(steps)[:, None]  # [steps, S]: the new token's position
    slots = (p.block_tables[np.arange(s)[None, :], pos // block_size] * block_size + pos % block_size).astype(np.int32)
    qs = rng.standard_normal((steps, s, heads, head_size)).astype(np.float32)
    ks = rng.standard_normal((steps, s, kv_heads, head_size)).astype(np.float32)
    vs = rng.standard_normal((steps, s, kv_heads, head_size)).astype(np.float32)

    def loop(key_cache, value_cache, block_tables, seq_lens, qs, ks, vs, slots):
        def body(carry, x):
            kc, vc, lens = carry
            q, k, v, slot = x
            lens = lens + 1
            out, kc, vc = _decode_step(pj, q, k, v, kc, vc, slot, block_tables, lens)
            return (kc, vc, lens), out

        (kc, vc, lens), outs = jax.lax.scan(body, (key_cache, value_cache, seq_lens), (qs, ks, vs, slots))
        return outs, kc, vc, lens

    args = _put(device, p.key_cache, p.value_cache, p.block_tables, start, qs, ks, vs, slots)
    outs, kc, vc, lens = jax.jit(loop, donate_argnums=(0, 1) if donate else ())(*args)

    kc_r, vc_r = p.key_cache.copy(), p.value_cache.copy()
    for t in range(steps):
        reshape_and_cache_ref(ks[t], vs[t], kc_r, vc_r, slots[t])
        ref = paged_attention_ref(qs[t], kc_r, vc_r, p.block_tables, start + t + 1)
        assert_close(_np(outs[t]), ref, np.float32, f"step {t}")
    np.testing.assert_array_equal(_np(lens), start + steps)
    _same_bits(kc, kc_r, "key_cache")
    _same_bits(vc, vc_r, "value_cache")


# ---- handlers: options and the varlen form ------------------------------------------------


@needs_handlers
def test_varlen_query_under_jit(pj, device, rng):
    """query_start_loc + max_query_len: chunked prefill rows beside decode rows."""
    seq_lens = np.array([5, 17, 1, 9], np.int32)
    q_lens = np.array([2, 4, 1, 0], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    p = make_problem(rng, seq_lens, num_heads=4, num_kv_heads=1, head_size=64, block_size=8)
    query = rng.standard_normal((int(qsl[-1]), 4, 64)).astype(np.float32)
    ref = paged_attention_ref(query, p.key_cache, p.value_cache, p.block_tables, seq_lens, query_start_loc=qsl)
    args = _put(device, query, p.key_cache, p.value_cache, p.block_tables, seq_lens, qsl)

    def attend(q, kc, vc, bt, sl, qsl):
        return pj.paged_attention(q, kc, vc, bt, sl, query_start_loc=qsl, max_query_len=int(q_lens.max()))

    out = jax.jit(attend)(*args)
    assert_close(_np(out), ref, np.float32)
    if device.platform == "cpu":
        eager = pagedattn.paged_attention(query, p.key_cache, p.value_cache, p.block_tables, seq_lens,
                                          query_start_loc=qsl)  # fmt: skip
    else:
        eager = _np(attend(*args))  # outside jit, on the same device
    _same_bits(out, eager, "out")


@needs_handlers
@pytest.mark.parametrize("kernel", ["auto", "partitioned"])
def test_alibi_scale_and_kernel_under_jit(pj, device, rng, kernel):
    p = make_problem(rng, [3, 600], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, alibi=True)
    ref = paged_attention_ref(*p.args(), scale=0.2, alibi_slopes=p.alibi_slopes)
    args = _put(device, *p.args(), p.alibi_slopes)

    def attend(q, kc, vc, bt, sl, al):
        return pj.paged_attention(q, kc, vc, bt, sl, scale=0.2, alibi_slopes=al, kernel=kernel, partition_size=0)

    assert_close(_np(jax.jit(attend)(*args)), ref, np.float32)


@needs_handlers
def test_variants_under_jit(pj, device, rng):
    """sliding_window, soft_cap and sinks reach the kernels, in decode and varlen calls."""
    seq_lens = np.array([5, 40, 1, 23], np.int32)
    q_lens = np.array([2, 6, 1, 1], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    p = make_problem(rng, seq_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=8)
    query = rng.standard_normal((int(qsl[-1]), 4, 64)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    opts = dict(sliding_window=7, soft_cap=4.0)
    for q, loc in ((p.query, None), (query, qsl)):
        ref = paged_attention_ref(q, p.key_cache, p.value_cache, p.block_tables, seq_lens, query_start_loc=loc,
                                  sinks=sinks, **opts)  # fmt: skip
        plain = paged_attention_ref(q, p.key_cache, p.value_cache, p.block_tables, seq_lens, query_start_loc=loc)
        args = _put(device, q, p.key_cache, p.value_cache, p.block_tables, seq_lens, sinks, qsl)
        varlen = loc is not None

        def attend(q, kc, vc, bt, sl, sk, qs, varlen=varlen):
            extra = dict(query_start_loc=qs, max_query_len=6) if varlen else {}
            return pj.paged_attention(q, kc, vc, bt, sl, sinks=sk, **opts, **extra)

        out = _np(jax.jit(attend)(*args))
        assert_close(out, ref, np.float32)
        assert not np.allclose(out, plain, atol=1e-3)  # the variants changed the result


@needs_handlers
def test_hnd_layout_under_jit(pj, device, rng):
    """layout="hnd" reaches both calls: a jitted write then attention over [N, K, B, D] caches."""
    H, K, D, B = 4, 2, 64, 16
    kshape, vshape = pagedattn.kv_cache_shape(8, B, K, D, np.float32, layout="hnd")
    kc = rng.standard_normal(kshape).astype(np.float32)
    vc = rng.standard_normal(vshape).astype(np.float32)
    bt = np.array([[3, 5], [6, 1]], np.int32)
    sl = np.array([20, 7], np.int32)
    k = rng.standard_normal((2, K, D)).astype(np.float32)
    v = rng.standard_normal((2, K, D)).astype(np.float32)
    slots = np.array([5 * B + 3, 6 * B + 6])  # the last token of each sequence
    q = rng.standard_normal((2, H, D)).astype(np.float32)
    want_k, want_v = kc.copy(), vc.copy()
    for t, slot in enumerate(slots):
        want_k[slot // B, :, slot % B] = k[t]
        want_v[slot // B, :, slot % B] = v[t]
    ref = paged_attention_ref(q, want_k, want_v, bt, sl, layout="hnd")

    def step(q, k, v, kc, vc, slots, bt, sl):
        kc, vc = pj.reshape_and_cache(k, v, kc, vc, slots, layout="hnd")
        return pj.paged_attention(q, kc, vc, bt, sl, layout="hnd"), kc

    out, new_k = jax.jit(step)(*_put(device, q, k, v, kc, vc, slots, bt, sl))
    assert_close(_np(out), ref, np.float32)
    np.testing.assert_array_equal(_np(new_k), want_k)


@needs_handlers
def test_fp8_caches_typed_or_uint8(pj, device, rng):
    """An fp8 cache may be a uint8 array or a float8 array of the same bytes: both give the
    eager call's bytes and output."""
    kind = "fp8_e4m3"
    p = make_problem(rng, [6, 19], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=np.float16)
    kshape, vshape = pagedattn.kv_cache_shape(p.key_cache.shape[0], 16, 2, 64, "uint8")
    kc0, vc0 = np.zeros(kshape, np.uint8), np.zeros(vshape, np.uint8)
    key = rng.standard_normal((25, 2, 64)).astype(np.float16)
    value = rng.standard_normal((25, 2, 64)).astype(np.float16)
    bt = p.block_tables.astype(np.int64)
    slots = np.concatenate([bt[0, 0] * 16 + np.arange(6), (bt[1, :2, None] * 16 + np.arange(16)).ravel()[:19]])
    slots = slots.astype(np.int32)
    opts = dict(kv_cache_dtype=kind, k_scale=0.5, v_scale=0.25)

    def step(k, v, kc, vc, sl, q, bt, lens):
        kc, vc = pj.reshape_and_cache(k, v, kc, vc, sl, **opts)
        return pj.paged_attention(q, kc, vc, bt, lens, **opts), kc, vc

    rest = _put(device, p.query, p.block_tables, p.seq_lens)
    # The eager call on the same device: the NumPy API on the CPU, else outside jit.
    if device.platform == "cpu":
        kc_e, vc_e = kc0.copy(), vc0.copy()
        pagedattn.reshape_and_cache(key, value, kc_e, vc_e, slots, **opts)
        out_e = pagedattn.paged_attention(p.query, kc_e, vc_e, p.block_tables, p.seq_lens, **opts)
    else:
        out_e, kc_e, vc_e = (_np(a) for a in step(*_put(device, key, value, kc0, vc0, slots), *rest))
    ref = paged_attention_ref(p.query, kc_e, vc_e, p.block_tables, p.seq_lens, **opts)
    assert_close(out_e, ref, np.float16, "eager vs reference over the written fp8 caches")

    for storage in (jnp.uint8, jnp.float8_e4m3fn):
        k, v, kc, vc, sl = _put(device, key, value, kc0, vc0, slots)
        out, kc, vc = jax.jit(step)(k, v, kc.view(storage), vc.view(storage), sl, *rest)
        _same_bits(kc.view(jnp.uint8), kc_e, f"key_cache ({storage.__name__})")
        _same_bits(vc.view(jnp.uint8), vc_e, f"value_cache ({storage.__name__})")
        _same_bits(out, out_e, f"out ({storage.__name__})")

    f8 = _put(device, kc0)[0].view(jnp.float8_e5m2)
    with pytest.raises(Exception, match=r"key_cache: a float8_e5m2 cache needs kv_cache_dtype='fp8_e5m2'"):
        pj.reshape_and_cache(*_put(device, key, value), f8, f8, _put(device, slots)[0], **opts)[0].block_until_ready()


@needs_handlers
def test_vmap_over_queries(pj, rng):
    p = make_problem(rng, [4, 21], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    queries = rng.standard_normal((3,) + p.query.shape).astype(np.float32)
    kc, vc, bt, sl = _cpu(*p.args()[1:])
    outs = jax.jit(jax.vmap(lambda q: pj.paged_attention(q, kc, vc, bt, sl)))(*_cpu(queries))
    for i in range(3):
        assert_close(np.asarray(outs[i]), paged_attention_ref(queries[i], *p.args()[1:]), np.float32, f"query {i}")


# ---- handlers: errors surface as Python exceptions, never a crash ------------------------


@needs_handlers
def test_errors_under_jit(pj, device, rng):
    p = _small(rng)
    q, kc, vc, bt, sl = _put(device, *p.args())
    attend = jax.jit(pj.paged_attention)
    with pytest.raises(Exception, match=r"ValueError: paged_attention: seq_lens: dimension 0") as err:
        attend(q, kc, vc, bt, sl[:1]).block_until_ready()
    assert isinstance(err.value, RuntimeError)  # jax.errors.JaxRuntimeError
    with pytest.raises(Exception, match=r"paged_attention: kv_cache_dtype"):
        jax.jit(lambda *a: pj.paged_attention(*a, kv_cache_dtype="int4"))(q, kc, vc, bt, sl).block_until_ready()
    with pytest.raises(Exception, match=r"TypeError: paged_attention: block_tables"):
        attend(q, kc, vc, bt.astype(jnp.float32), sl).block_until_ready()
    key = _put(device, rng.standard_normal((2, 2, 32)).astype(np.float32))[0]
    write = jax.jit(pj.reshape_and_cache)
    with pytest.raises(Exception, match=r"reshape_and_cache: .*key"):
        write(key[:, :1], key, kc, vc, _put(device, np.array([0, 1], np.int32))[0])[0].block_until_ready()
    bad = _put(device, np.where(np.arange(p.block_tables.shape[1]) == 0, 10_000, p.block_tables))[0]
    checked = jax.jit(lambda *a: pj.paged_attention(*a, check_block_tables=True))
    with pytest.raises(Exception, match=r"IndexError: paged_attention: block_tables\[[01], 0\] = 10000 is outside"):
        checked(q, kc, vc, bad, sl).block_until_ready()
    # The process goes on: a good call after the bad ones.
    assert_close(_np(attend(q, kc, vc, bt, sl)), paged_attention_ref(*p.args()), np.float32)


@needs_handlers
def test_index_errors_under_jit_on_the_cpu(pj, rng):
    """Index contents are checked where they can be read: on the host."""
    p = _small(rng)
    bt = p.block_tables.copy()
    bt[1, 0] = 10_000
    with pytest.raises(Exception, match=r"IndexError: paged_attention: block_tables"):
        jax.jit(pj.paged_attention)(*_cpu(p.query, p.key_cache, p.value_cache, bt, p.seq_lens)).block_until_ready()
    slots = np.array([0, 10_000], np.int64)
    key = np.zeros((2, 2, 32), np.float32)
    write = jax.jit(pj.reshape_and_cache)
    with pytest.raises(Exception, match=r"IndexError: reshape_and_cache: slot_mapping"):
        write(*_cpu(key, key, p.key_cache, p.value_cache, slots.astype(np.int32)))[0].block_until_ready()


@needs_handlers
def test_attributes_are_checked_by_name_and_type(pj, rng):
    """An attribute no option reads, or one of the wrong type, is an error: a misspelt or
    mistyped option never passes silently."""
    p = _small(rng)
    args = _cpu(*p.args())
    call = jax.ffi.ffi_call("pagedattn_paged_attention", jax.ShapeDtypeStruct(p.query.shape, p.query.dtype))
    with pytest.raises(Exception, match=r"ValueError: paged_attention: unknown attribute 'sclae'"):
        call(*args, sclae=np.float32(0.5)).block_until_ready()
    with pytest.raises(Exception, match=r"TypeError: paged_attention: attribute 'k_scale' has the wrong type"):
        call(*args, k_scale=np.float64(0.5)).block_until_ready()
    with pytest.raises(Exception, match=r"paged_attention: unknown optional operand 'bias'"):
        call(*args, args[4], operands="bias").block_until_ready()
    with pytest.raises(Exception, match=r"2 optional operand\(s\) given, 1 named"):
        call(*args, args[4], args[4], operands="alibi_slopes").block_until_ready()
