"""API fuzzing: every public function, valid and invalid input (see harness/fuzz.py).

- A batch of seeded cases runs in a subprocess (harness/fuzz.py --isolate), so a
  segfault or abort is counted as a crash and fails the test instead of killing pytest.
- The same generators run in-process under hypothesis, one test per target, so a
  failure shrinks to a small reproducer.
- Meta-tests show that the fuzzer does catch a wrong answer, a wrong error type, a
  missing error and a crash.
- Regression tests pin the bugs the fuzzer found and that are fixed; the fuzzer's list of
  known open issues (fuzz.KNOWN_ISSUES) is pinned empty.

PAGEDATTN_FUZZ_CASES sets the size of the subprocess batch (default 6000, a few seconds).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzz
import pagedattn
from conftest import BASE_SEED

CASES = int(os.environ.get("PAGEDATTN_FUZZ_CASES", "6000"))
SUMMARY = re.compile(r"fuzz: (\d+) cases, seed (\d+): (\d+) crashes, (\d+) mismatches, (\d+) failures")


def limit_memory(nbytes: int) -> str:
    """Code for a child Python: cap its address space (not under AddressSanitizer, which
    reserves terabytes of shadow memory; huge requests fail there through
    allocator_may_return_null instead)."""
    return (
        f"import os, resource\nif 'asan' not in os.environ.get('LD_PRELOAD', ''):\n"
        f"    resource.setrlimit(resource.RLIMIT_AS, ({nbytes}, {nbytes}))\n"
    )


def run_fuzz(*args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, re.Match]:
    r = subprocess.run([sys.executable, fuzz.__file__, *args], capture_output=True, text=True,
                       timeout=timeout)  # fmt: skip
    m = SUMMARY.search(r.stdout)
    assert m, f"no summary line (exit status {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r, m


def test_fuzz_batch_in_subprocess():
    seed = zlib.crc32(f"{BASE_SEED}-fuzz".encode())
    r, m = run_fuzz("--cases", str(CASES), "--seed", str(seed), "--isolate", "2000")
    print(r.stdout[-4000:])
    assert r.returncode == 0, f"fuzz failures (seed {seed}):\n{r.stdout[-6000:]}\n{r.stderr[-2000:]}"
    ran, _, crashes, mismatches, failures = map(int, m.groups())
    assert (ran, crashes, mismatches, failures) == (CASES, 0, 0, 0)
    # Every target ran, and valid cases were compared with the reference.
    for target in fuzz.TARGETS if CASES >= 2000 else ():
        # Misuse-only targets have no valid calls: they must have run and refused.
        refusing_only = target in ("decode_workspace_size", "cache_mappings", "command_line")
        assert re.search(rf"^  {target}: .*{'error' if refusing_only else 'ok'} \d+", r.stdout, re.M), target


# ---- the same generators under hypothesis ----------------------------------------------
class HypothesisDraw(fuzz.Draw):
    def __init__(self, data) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


@pytest.mark.parametrize("target", sorted(fuzz.TARGETS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzz_target_hypothesis(target, data):
    with np.errstate(all="ignore"):
        out = fuzz.run_case(HypothesisDraw(data), target)
    assert out.kind in ("ok", "error", "known")


# ---- the fuzzer catches what it should ---------------------------------------------------
def _fails_some(target: str, n: int = 120) -> int:
    failed = 0
    for i in range(n):
        try:
            with np.errstate(all="ignore"):
                fuzz.run_case(fuzz.RandomDraw(12345, i), target)
        except fuzz.Failure:
            failed += 1
    return failed


def test_fuzzer_catches_a_wrong_answer(monkeypatch):
    real = pagedattn.paged_attention

    def off_by_a_bit(*a, **k):
        r = real(*a, **k)
        if r.size:
            r.reshape(-1)[-1] += 0.25
        return r

    monkeypatch.setattr(pagedattn, "paged_attention", off_by_a_bit)
    assert _fails_some("paged_attention") > 10


def test_fuzzer_catches_a_lost_cache_write(monkeypatch):
    real = pagedattn.reshape_and_cache

    def drops_first(k, v, kc, vc, slots, **kw):
        slots = np.array(slots, copy=True)
        if slots.size:
            slots[0] = -1
        return real(k, v, kc, vc, slots, **kw)

    monkeypatch.setattr(pagedattn, "reshape_and_cache", drops_first)
    assert _fails_some("reshape_and_cache") > 10


def test_fuzzer_catches_untyped_and_missing_errors(monkeypatch):
    def untyped(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(pagedattn, "paged_attention", untyped)
    assert _fails_some("paged_attention", 40) > 10

    monkeypatch.setattr(pagedattn, "paged_attention", lambda *a, **k: np.zeros(np.shape(a[0])))
    assert _fails_some("paged_attention", 40) > 10  # invalid calls that "succeed"


def test_fuzzer_catches_an_accepted_overlapping_output(monkeypatch):
    real = pagedattn.paged_attention

    def copies_out(*a, **k):  # computes into a private buffer: overlap goes unnoticed
        out = k.pop("out", None)
        r = real(*(np.array(x, copy=True) for x in a), **k)
        if out is not None:
            out[...] = r
            return out
        return r

    monkeypatch.setattr(pagedattn, "paged_attention", copies_out)
    assert _fails_some("shared_buffers") > 10


def test_fuzzer_catches_an_accepted_mapping_inside_a_cache(monkeypatch):
    real = pagedattn.copy_blocks
    monkeypatch.setattr(pagedattn, "copy_blocks", lambda k, v, m: real(k, v, np.array(m, np.int64)))
    assert _fails_some("cache_mappings") > 5


def test_fuzzer_catches_an_untyped_error_in_a_racing_call(monkeypatch):
    def untyped(*a, **k):
        raise RuntimeError("lost a race")

    monkeypatch.setattr(pagedattn, "paged_attention", untyped)
    monkeypatch.setattr(pagedattn, "reshape_and_cache", untyped)
    monkeypatch.setattr(pagedattn, "copy_blocks", untyped)
    assert _fails_some("index_race", 40) > 10


def test_fuzzer_catches_a_wrong_size_from_an_extreme_integer(monkeypatch):
    real = pagedattn.kv_cache_shape

    def wraps_around(*a, **k):  # a size that overflowed instead of being refused
        try:
            return real(*a, **k)
        except (ValueError, TypeError, OverflowError):
            return (-1, 4), (-1, 4)

    monkeypatch.setattr(pagedattn, "kv_cache_shape", wraps_around)
    assert _fails_some("extreme_ints", 400) > 5


@pytest.mark.skipif(not hasattr(os, "fork") or fuzz._asan_runtime_loaded(), reason="needs fork without ASan")
def test_fuzzer_catches_a_hanging_or_failing_fork_child(monkeypatch):
    real, parent = pagedattn.paged_attention, os.getpid()

    def hangs_in_a_child(*a, **k):
        if os.getpid() != parent:
            import time

            time.sleep(60)
        return real(*a, **k)

    monkeypatch.setattr(fuzz, "FORK_TIMEOUT_S", 0.5)
    monkeypatch.setattr(pagedattn, "paged_attention", hangs_in_a_child)
    assert _fails_some("fork", 4) == 4

    def wrong_in_a_child(*a, **k):
        r = real(*a, **k)
        if os.getpid() != parent and r.size:
            r.reshape(-1)[0] += 1.0
        return r

    monkeypatch.setattr(pagedattn, "paged_attention", wrong_in_a_child)
    assert _fails_some("fork", 20) > 5


def test_fuzzer_catches_a_command_line_that_runs_or_prints_a_traceback(monkeypatch):
    import pagedattn.__main__ as entry

    def traceback_instead(argv=None):
        print("Traceback (most recent call last):\nValueError: bad", file=sys.stderr)
        raise SystemExit(1)

    monkeypatch.setattr(entry, "main", traceback_instead)
    assert _fails_some("command_line", 20) == 20
    monkeypatch.setattr(entry, "main", lambda argv=None: print("serving demo on cpu") or 0)
    assert _fails_some("command_line", 20) == 20


def test_fuzzer_catches_token_ids_compared_loosely(monkeypatch):
    class Truncating(pagedattn.BlockManager):  # keeps only the low 16 bits of each id
        def add_sequence(self, seq_id, token_ids, **kw):
            ids = [int(t) for t in token_ids]
            if any(not -(2**31) <= t < 2**31 for t in ids):
                raise ValueError("token_ids outside int32")
            return super().add_sequence(seq_id, [t & 0xFFFF for t in ids], **kw)

    monkeypatch.setattr(pagedattn, "BlockManager", Truncating)
    assert _fails_some("token_ids", 60) > 10


def test_fuzzer_counts_a_crash_and_goes_on():
    r, m = run_fuzz("--cases", "60", "--seed", "5", "--isolate", "25", "--selftest-crash-at", "30")
    ran, _, crashes, _, failures = map(int, m.groups())
    assert r.returncode == 1
    assert (ran, crashes, failures) == (60, 1, 1), r.stdout
    assert "CRASH case 30" in r.stdout and "--first 30 --cases 1" in r.stdout


def test_fuzz_case_replays_identically():
    with np.errstate(all="ignore"):
        a = [fuzz.run_case(fuzz.RandomDraw(99, i)) for i in range(40)]
        b = [fuzz.run_case(fuzz.RandomDraw(99, i)) for i in range(40)]
    assert [(o.target, o.kind, o.label) for o in a] == [(o.target, o.kind, o.label) for o in b]


# ---- regressions: bugs found by fuzzing and fixed in the core ----------------------------
def _decode_setup(rng, dtype=np.float32, layout="vllm"):
    kshape, vshape = pagedattn.kv_cache_shape(6, 16, 2, 64, dtype, layout)
    kc = rng.standard_normal(kshape).astype(dtype)
    vc = rng.standard_normal(vshape).astype(dtype)
    q = rng.standard_normal((2, 4, 64)).astype(dtype)
    bt = np.array([[0, 1], [2, 3]], np.int32)
    sl = np.array([20, 7], np.int32)
    return q, kc, vc, bt, sl


def test_out_overlapping_a_cache_is_refused(rng):
    q, kc, vc, bt, sl = _decode_setup(rng)
    before = kc.copy()
    with pytest.raises(ValueError, match="out overlaps key_cache in memory"):
        pagedattn.paged_attention(q, kc, vc, bt, sl, out=kc.reshape(-1)[: q.size].reshape(q.shape))
    with pytest.raises(ValueError, match="out overlaps value_cache in memory"):
        pagedattn.paged_attention(q, kc, vc, bt, sl, out=vc.reshape(-1)[-q.size :].reshape(q.shape))
    assert np.array_equal(kc, before)


def test_out_overlapping_the_index_arrays_is_refused(rng):
    q, kc, vc, bt, sl = _decode_setup(rng)
    buf = np.zeros(q.size + 8, np.float32)
    tables = buf[:4].view(np.int32).reshape(2, 2)
    tables[...] = bt
    with pytest.raises(ValueError, match="out overlaps block_tables"):
        pagedattn.paged_attention(q, kc, vc, tables, sl, out=buf[2 : 2 + q.size].reshape(q.shape))


def test_out_with_overlapping_elements_is_refused(rng):
    q, kc, vc, bt, sl = _decode_setup(rng)
    row = np.zeros(64, np.float32)
    out = np.lib.stride_tricks.as_strided(row, (2, 4, 64), (0, 0, 4), writeable=True)
    with pytest.raises(ValueError, match=r"out: its elements overlap in memory .*strides \[0, 0, 1\]"):
        pagedattn.paged_attention(q, kc, vc, bt, sl, out=out)
    assert not row.any()


def test_out_partially_overlapping_query_is_refused(rng):
    q, kc, vc, bt, sl = _decode_setup(rng)
    buf = np.zeros(q.size + 64, np.float32)
    qv = buf[: q.size].reshape(q.shape)
    qv[...] = q
    with pytest.raises(ValueError, match="out overlaps query in memory.*in-place"):
        pagedattn.paged_attention(qv, kc, vc, bt, sl, out=buf[64:].reshape(q.shape))


@pytest.mark.parametrize("layout", ["vllm", "nhd"])
def test_in_place_out_is_query(rng, layout):
    q, kc, vc, bt, sl = _decode_setup(rng, np.float16, layout)
    expected = pagedattn.reference.paged_attention_ref(q, kc, vc, bt, sl)
    qq = q.copy()
    res = pagedattn.paged_attention(qq, kc, vc, bt, sl, out=qq)
    assert res is qq
    np.testing.assert_allclose(qq.astype(np.float64), expected, atol=2e-3, rtol=2e-3)


def test_out_interleaved_with_query_but_disjoint_is_allowed(rng):
    # A strided view whose rows do not overlap its own elements is still fine.
    q, kc, vc, bt, sl = _decode_setup(rng)
    out = np.full((2, 8, 64), np.nan, np.float32)[:, ::2]
    pagedattn.paged_attention(q, kc, vc, bt, sl, out=out)
    np.testing.assert_allclose(out, pagedattn.reference.paged_attention_ref(q, kc, vc, bt, sl), atol=2e-5, rtol=2e-5)


def test_cache_write_into_its_own_source_is_refused(rng):
    kshape, vshape = pagedattn.kv_cache_shape(4, 16, 2, 64, np.float32, "nhd")
    kc, vc = np.zeros(kshape, np.float32), np.zeros(vshape, np.float32)
    key = kc.reshape(-1)[: 3 * 2 * 64].reshape(3, 2, 64)
    value = rng.standard_normal((3, 2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="key_cache overlaps key in memory"):
        pagedattn.reshape_and_cache(key, value, kc, vc, np.array([5, 6, 7]))
    with pytest.raises(ValueError, match="value_cache overlaps key_cache in memory"):
        pagedattn.reshape_and_cache(value, value, kc, kc, np.array([5, 6, 7]))
    with pytest.raises(ValueError, match="overlaps slot_mapping"):
        slots = kc.reshape(-1)[:6].view(np.int64)
        slots[...] = [1, 2, 3]
        pagedattn.reshape_and_cache(value, value, kc, vc, slots)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_subnormal_fp8_scale_is_refused(which):
    # 1 / 1e-40 overflows float32: a zero key used to be stored as NaN.
    kshape, vshape = pagedattn.kv_cache_shape(1, 16, 1, 16, "fp8_e4m3")
    kc, vc = np.zeros(kshape, np.uint8), np.zeros(vshape, np.uint8)
    k = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match=rf"{which}: must be at least 1.17549e-38 .*got 9.99995e-41"):
        pagedattn.reshape_and_cache(k, k, kc, vc, np.array([0]), kv_cache_dtype="fp8", **{which: 1e-40})
    assert not kc.any() and not vc.any()
    q = np.ones((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match=rf"{which}: must be at least"):
        pagedattn.paged_attention(q, kc, vc, np.zeros((1, 1), np.int32), np.ones(1, np.int32),
                                  kv_cache_dtype="fp8", **{which: 1e-40})  # fmt: skip
    # The smallest normal float32 itself is accepted and stores zeros as zeros.
    pagedattn.reshape_and_cache(k, k, kc, vc, np.array([0]), kv_cache_dtype="fp8", **{which: 1.1754944e-38})
    assert not kc.any() and not vc.any()


def test_kv_cache_shape_refuses_an_impossible_size():
    with pytest.raises(ValueError, match="exceeds 2\\^63 bytes"):
        pagedattn.kv_cache_shape(2**40, 2**10, 2**10, 2**10, "float16", "nhd")
    # Large but representable geometries are only shapes: nothing is allocated.
    assert pagedattn.kv_cache_shape(2**40, 16, 8, 128, "float16")[1] == (2**40, 8, 128, 16)


def test_huge_sizes_are_refused_without_allocating():
    """Each call is refused by validation inside a 1 GiB address space."""
    code = textwrap.dedent(
        """
        import numpy as np, pagedattn
        f16 = np.float16
        kc, vc = (np.zeros(s, f16) for s in pagedattn.kv_cache_shape(2, 16, 2, 64, f16))
        calls = {
            "num_heads 2**40": lambda: pagedattn.paged_attention(np.empty((0, 2**40, 64), f16), kc, vc,
                                                                 np.empty((0, 1), np.int32), np.empty(0, np.int32)),
            "max_blocks 2**40": lambda: pagedattn.paged_attention(np.empty((0, 4, 64), f16), kc, vc,
                                                                  np.empty((0, 2**40), np.int32),
                                                                  np.empty(0, np.int32)),
            "head_size 10**6": lambda: pagedattn.paged_attention(np.empty((0, 1, 10**6), f16),
                                                                 np.empty((0, 16, 1, 10**6), f16),
                                                                 np.empty((0, 16, 1, 10**6), f16),
                                                                 np.empty((0, 1), np.int32), np.empty(0, np.int32)),
            "slot 2**40": lambda: pagedattn.reshape_and_cache(np.zeros((1, 2, 64), f16), np.zeros((1, 2, 64), f16),
                                                              kc, vc, np.array([2**40])),
            "block 2**40": lambda: pagedattn.copy_blocks([kc], [vc], [(0, 2**40)]),
            "manager 2**40 blocks": lambda: pagedattn.BlockManager(2**40, 16),
            "cache of 2**70 bytes": lambda: pagedattn.kv_cache_shape(2**40, 2**20, 2**10, 1, "float32", "nhd"),
        }
        for name, call in calls.items():
            try:
                call()
            except (ValueError, TypeError, IndexError) as e:
                print("refused", name, type(e).__name__)
            else:
                print("ACCEPTED", name)
        """
    )
    r = subprocess.run([sys.executable, "-c", limit_memory(1 << 30) + code], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("refused") == 7, r.stdout


def test_decode_scratch_does_not_grow_with_the_context():
    """A 2**25-token context (one block repeated) used to need 4 bytes of scratch per
    token and query head: 128 MiB here, terabytes for a 2**31-token length, and the OOM
    killer instead of an answer. The chunked softmax keeps it constant."""
    code = textwrap.dedent(
        """
        import resource, numpy as np, pagedattn
        from pagedattn.reference import dense_attention
        B, D, L = 1024, 8, 2**25
        rng = np.random.default_rng(1)
        kc = rng.standard_normal((1, B, 1, D)).astype(np.float32)
        vc = rng.standard_normal((1, B, 1, D)).astype(np.float32)
        q = rng.standard_normal((1, 2, D)).astype(np.float32)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = pagedattn.paged_attention(q, kc, vc, np.zeros((1, L // B), np.int32), np.array([L], np.int32))
        grow_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        # Every block is the same, so the answer is attention over one block.
        ref = dense_attention(q[0], kc[0].astype(np.float64), vc[0].astype(np.float64), 1 / np.sqrt(D))
        print(grow_mb, np.abs(out[0] - ref).max())
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PAGEDATTN_NUM_THREADS="1"))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    grow_mb, err = map(float, r.stdout.split())
    assert grow_mb < 32, f"peak RSS grew by {grow_mb:.0f} MiB"
    assert err < 5e-3


@pytest.mark.parametrize("length", [4095, 4096, 4097, 9000])
@pytest.mark.parametrize("block_size", [1, 16, 1000])
def test_long_contexts_across_softmax_chunks(rng, length, block_size):
    from conftest import assert_close, make_problem

    p = make_problem(rng, [length, 5, length // 3], num_heads=4, num_kv_heads=2, head_size=32,
                     block_size=block_size, dtype=np.float16, layout="nhd", alibi=True)  # fmt: skip
    out = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes)
    ref = pagedattn.reference.paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes)
    assert_close(out, ref, np.float16, f"length {length}")


def test_first_chunk_of_minus_infinity_does_not_poison_later_chunks(rng):
    # Keys of the first 4096 tokens give -inf logits, later ones finite: the early tokens
    # weigh exactly 0, as in a single-pass softmax.
    B, L, D = 16, 5000, 8
    kc = np.ones((L // B + 1, B, 1, D), np.float32)
    kc[: 4096 // B] = -np.inf
    vc = rng.standard_normal(kc.shape).astype(np.float32)
    q = np.ones((1, 1, D), np.float32)
    bt = np.arange(L // B + 1, dtype=np.int32)[None]
    out = pagedattn.paged_attention(q, kc, vc, bt, np.array([L], np.int32))
    expected = vc.reshape(-1, D)[4096:L].mean(axis=0)
    np.testing.assert_allclose(out[0, 0], expected, rtol=1e-4, atol=1e-5)


# ---- issues the fuzzer found, now fixed: regression tests --------------------------------
def test_no_known_issue_is_left_open():
    assert fuzz.KNOWN_ISSUES == {}


def test_fixed_readonly_output(rng):
    q, kc, vc, bt, sl = _decode_setup(rng)
    out = np.zeros_like(q)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: the array is read-only"):
        pagedattn.paged_attention(q, kc, vc, bt, sl, out=out)
    assert not out.any(), "nothing may be written into a read-only array"


def test_fixed_alloc_before_validate():
    code = textwrap.dedent(
        """
        import numpy as np, pagedattn
        kc, vc = (np.zeros(s, np.float32) for s in pagedattn.kv_cache_shape(2, 16, 1, 64, np.float32))
        q = np.lib.stride_tricks.as_strided(np.zeros(64, np.float32), (2**31, 4, 64), (0, 0, 4))
        try:
            pagedattn.paged_attention(q, kc, vc, np.zeros((1, 1), np.int32), np.ones(1, np.int32))
        except ValueError as e:
            print("ValueError", e)
        """
    )
    r = subprocess.run([sys.executable, "-c", limit_memory(1 << 31) + code], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("ValueError"), r.stdout + r.stderr


def test_fixed_int_overflow_error():
    with pytest.raises(TypeError, match="num_blocks: expected an integer, got float inf"):
        pagedattn.kv_cache_shape(float("inf"), 16, 2, 64, "float16")


def test_fixed_bm_alloc_before_check():
    m = pagedattn.BlockManager(8, 4)
    m.add_sequence(1, [1, 2, 3])
    with pytest.raises(IndexError):
        m.slots(1, 0, 2**62)
    with pytest.raises(ValueError, match="max_blocks"):
        m.block_tables([1], max_blocks=2**40)


def test_fixed_bm_eager_prefix_table():
    code = textwrap.dedent(
        """
        import pagedattn
        try:
            pagedattn.BlockManager(2**20, 2**20, enable_prefix_caching=True)
            print("ok")
        except (ValueError, MemoryError) as e:
            print(type(e).__name__)
        """
    )
    r = subprocess.run([sys.executable, "-c", limit_memory(1 << 31) + code], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.stdout.strip() in ("ok", "ValueError"), r.stdout + r.stderr
