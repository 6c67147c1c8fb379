"""Misuse of the call arguments: a prepared call outliving its caller's references, a
DLPack producer handing out one capsule twice, arrays that are not arrays, unsupported
dtypes, read-only outputs, unknown keywords.

Crash-class cases run in a subprocess and assert a clean exit: a regression must fail the
test, not kill the test run.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pagedattn
from conftest import DLPackOnly, assert_close, make_problem
from pagedattn.reference import paged_attention_ref


def run_script(code: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit code {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


PROBLEM = """
import gc
import numpy as np
import pagedattn
from pagedattn.reference import paged_attention_ref
rng = np.random.default_rng(7)
S, H, K, D, B, N = 4, 8, 2, 64, 16, 64
q = rng.standard_normal((S, H, D)).astype(np.float32)
kc = rng.standard_normal((N, B, K, D)).astype(np.float32)
vc = rng.standard_normal((N, B, K, D)).astype(np.float32)
bt = rng.permutation(N)[: S * 4].reshape(S, 4).astype(np.int32)
sl = np.array([1, 17, 40, 64], np.int32)
ref = paged_attention_ref(q, kc, vc, bt, sl)
"""


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_prepared_call_outlives_the_callers_arrays(framework):
    """`run = prepare_decode(...).run; del arrays; run()` reads arrays the prepared call
    owns: the right answer, every time, however much memory churns in between."""
    if framework == "torch":
        pytest.importorskip("torch")
    convert = "import torch\nT = torch.from_numpy\n" if framework == "torch" else "T = lambda a: a\n"
    run_script(
        PROBLEM
        + convert
        + """
run = pagedattn.prepare_decode(T(q.copy()), T(kc.copy()), T(vc.copy()), T(bt.copy()), T(sl.copy())).run
for i in range(20):
    gc.collect()
    junk = [np.full(kc.shape, np.nan, np.float32) for _ in range(4)]  # reuse any freed memory
    out = np.asarray(run())
    assert np.abs(out - ref).max() < 1e-4, (i, np.abs(out - ref).max())
    del junk
print("ok")
"""
    )


def test_prepared_call_keeps_query_and_out_alive_through_its_out():
    rng = np.random.default_rng(3)
    p = make_problem(rng, [5, 33])
    prepared = pagedattn.prepare_decode(*(a.copy() for a in p.args()))
    out = prepared.run()
    assert out is prepared.out
    assert_close(out, paged_attention_ref(*p.args()), np.float32)


def test_a_capsule_handed_out_twice_is_refused():
    run_script(
        PROBLEM
        + """
class Twice:  # a producer that returns the same capsule on every call
    def __init__(self, a):
        self.a, self.cap = a, None
    def __dlpack__(self, *args, **kwargs):
        if self.cap is None:
            self.cap = self.a.__dlpack__()
        return self.cap
    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

t = Twice(q)
out = pagedattn.paged_attention(t, kc, vc, bt, sl)  # the first import is fine
assert np.abs(out - ref).max() < 1e-4
for _ in range(3):
    try:
        pagedattn.paged_attention(t, kc, vc, bt, sl)
    except ValueError as e:
        assert "query: __dlpack__() returned a capsule that was already consumed" in str(e), e
    else:
        raise AssertionError("a consumed capsule was imported again")
print("ok")
"""
    )


def test_dlpack_only_query_without_out_gets_a_numpy_output(rng):
    p = make_problem(rng, [3, 20, 17])
    out = pagedattn.paged_attention(DLPackOnly(p.query), *p.args()[1:])
    assert isinstance(out, np.ndarray) and out.shape == p.query.shape and out.dtype == np.float32
    assert_close(out, paged_attention_ref(*p.args()), np.float32)


@pytest.mark.parametrize(
    "index, bad, match",
    [
        (0, lambda a: a.astype(np.complex64), r"query: dtype complex64 is not supported"),
        (1, lambda a: a.astype(np.float64), r"key_cache: dtype float64 does not match the query/key dtype float32"),
        (3, lambda a: a.tolist(), r"block_tables: expected an array \(NumPy, PyTorch, CuPy, JAX or any object with "
                                  r"__dlpack__\), got list"),
        (4, lambda a: a.astype(np.uint32), r"seq_lens: dtype uint32 is not supported"),
        (0, lambda a: "query", r"query: expected an array .*, got str"),
    ],
)
def test_non_arrays_and_unsupported_dtypes_are_named(rng, index, bad, match):
    p = make_problem(rng, [3, 20])
    args = list(p.args())
    args[index] = bad(args[index])
    with pytest.raises(TypeError, match=match) as e:
        pagedattn.paged_attention(*args)
    assert "an unsupported dtype" not in str(e.value)


def test_read_only_outputs_and_caches_are_refused_in_the_core(rng):
    p = make_problem(rng, [3, 20])
    out = np.full(p.query.shape, np.nan, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: the array is read-only; pagedattn writes into it"):
        pagedattn.paged_attention(*p.args(), out=out)
    kc = p.key_cache.copy()
    kc.flags.writeable = False
    key = rng.standard_normal((2, 2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="key_cache: the array is read-only"):
        pagedattn.reshape_and_cache(key, key, kc, p.value_cache, np.array([0, 1], np.int64))
    # A read-only query is fine: it is only read.
    q = p.query.copy()
    q.flags.writeable = False
    assert_close(pagedattn.paged_attention(q, *p.args()[1:]), paged_attention_ref(*p.args()), np.float32)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(version=2), TypeError, r"paged_attention\(\) got an unexpected keyword argument 'version'"),
        (dict(kernel=2), TypeError, r"kernel: expected a str, got int 2"),
        (dict(kernel="fast"), ValueError, r'kernel: got "fast", expected "auto", "single_pass" or "partitioned"'),
        (dict(scale="0.1"), TypeError, r"scale: expected a float, got str '0.1'"),
        (dict(partition_size=2**40), ValueError, r"partition_size: 1099511627776 is outside the int32 range"),
        (dict(check_block_tables=1), TypeError, r"check_block_tables: expected True or False, got int 1"),
        (dict(kv_cache_dtype="int4"), ValueError, r"kv_cache_dtype"),
        (dict(stream=-1), TypeError, r"stream: expected a non-negative stream handle, got -1"),
        (dict(stream="default"), TypeError, r"stream: expected an int handle or an object with __cuda_stream__"),
    ],
)
def test_option_errors_name_the_keyword(rng, kw, exc, match):
    p = make_problem(rng, [3, 20])
    with pytest.raises(exc, match=match):
        pagedattn.paged_attention(*p.args(), **kw)
    with pytest.raises(exc, match=match.replace("paged_attention", "prepare_decode")):
        pagedattn.prepare_decode(*p.args(), **kw)


def test_every_kernel_choice_gives_the_same_answer_on_the_cpu(rng):
    p = make_problem(rng, [3, 200, 1])
    ref = paged_attention_ref(*p.args())
    assert set(pagedattn.supported()["kernels"]) == {"auto", "single_pass", "partitioned"}
    for kernel in pagedattn.supported()["kernels"]:
        assert_close(pagedattn.paged_attention(*p.args(), kernel=kernel, partition_size=64), ref, np.float32)


def test_copy_and_swap_refuse_read_only_destinations_in_the_core(rng):
    k = rng.standard_normal((6, 4, 8)).astype(np.float32)
    ro = k.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"caches\[0\]: the array is read-only"):
        pagedattn.copy_blocks([ro], [], [(0, 1)])
    with pytest.raises(ValueError, match="dst: the array is read-only"):
        pagedattn.swap_blocks(k, ro, [(0, 1)])
    assert np.array_equal(ro, k)
    # Lists of pairs become int64 arrays in the core; a bad list is named.
    with pytest.raises(TypeError, match="block_mapping: the pairs are not integers"):
        pagedattn.copy_blocks([k.copy()], [], [("a", "b")])


def test_arrays_by_keyword_and_argument_count_errors(rng):
    p = make_problem(rng, [3, 20])
    q, kc, vc, bt, sl = p.args()
    ref = paged_attention_ref(*p.args())
    assert_close(pagedattn.paged_attention(q, kc, vc, seq_lens=sl, block_tables=bt), ref, np.float32)
    with pytest.raises(TypeError, match="paged_attention\\(\\) missing required argument 'seq_lens'"):
        pagedattn.paged_attention(q, kc, vc, bt)
    with pytest.raises(TypeError, match="got multiple values for argument 'query'"):
        pagedattn.paged_attention(q, kc, vc, bt, sl, query=q)
    with pytest.raises(TypeError, match="takes 5 positional arguments"):
        pagedattn.paged_attention(q, kc, vc, bt, sl, None)
    sig = str(inspect.signature(pagedattn.paged_attention))
    assert sig.startswith("(query, key_cache, value_cache, block_tables, seq_lens, *, out=None,"), sig


def test_a_cycle_through_a_prepared_call_is_collected(rng):
    """The prepared call holds its arrays; an array that refers back to the call makes a
    cycle, which the garbage collector must still free (no leak at exit)."""
    import gc

    freed = []

    class Out(np.ndarray):
        def __del__(self):
            freed.append(True)

    p = make_problem(rng, [3, 20])
    out = np.full(p.query.shape, np.nan, np.float32).view(Out)
    prepared = pagedattn.prepare_decode(*p.args(), out=out)
    out.owner = prepared  # out -> prepared call -> out
    assert_close(np.asarray(prepared.run()), paged_attention_ref(*p.args()), np.float32)
    del out, prepared
    gc.collect()
    assert freed, "the cycle through the prepared call was not collected"
