"""API fuzzer: random calls to every public function, valid and invalid.

Every case builds one call (or, for the block manager, a short run of calls) from a
seeded random source and checks the contract:

- a valid call returns what the float64 reference (:mod:`pagedattn.reference`) returns,
  within the dtype's tolerance, with NaN-poisoned cache slots that only a wrong index
  would read;
- an invalid call raises the documented typed error (``ValueError`` / ``TypeError`` /
  ``IndexError``; the block manager adds ``KeyError`` and ``OutOfBlocksError``) and
  leaves every array and manager it was given unchanged;
- nothing else: any other exception, a wrong answer or a crash is a failure.

Beside the per-function targets, misuse targets generate the classes that once crashed
the library: a second thread rewriting index arrays during calls (``index_race``: any
answer or IndexError / ValueError, never an access out of bounds, which AddressSanitizer
sees), forked children checking a decode (``fork``: skipped under AddressSanitizer, whose
allocator is not fork-safe while other threads allocate), outputs sharing memory with
inputs (``shared_buffers``), mappings inside caches and repeated / chained destinations
(``cache_mappings``), extreme integers on every integer argument and sequences at the
context limit read through a small window (``extreme_ints``),
token ids over the int32 range (``token_ids``), bad command lines (``command_line``,
in-process: exit status 2, one stderr line naming the option, nothing run) and varlen
queries (``varlen``: bad ``query_start_loc`` contents and extreme integers in it or in
``max_query_len``, offsets inside ``out``'s memory, offsets changed under a prepared call
or rewritten by a racing thread).

Run long campaigns from the command line (``--cases`` as many as you like; case ``i`` of
seed ``S`` is reproducible on its own with ``--seed S --first i --cases 1``)::

    python tests/python/harness/fuzz.py --cases 100000 --seed 1

The last line printed is the summary, e.g.
``fuzz: 300 cases, seed 7: 0 crashes, 0 mismatches, 0 failures (...)``; the exit status
is 0 only when nothing failed. A crash (segfault, abort) kills the process, so run it in
a subprocess (the test suite does) and read the last ``case`` line ``--trace`` printed.

The generators only need a source of integers (:class:`Draw`), so the tests drive the
very same generators from hypothesis (with shrinking) in-process. No dependency beyond
NumPy (ml_dtypes, when installed, adds bfloat16 cases).
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import faulthandler
import gc
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import numpy as np

import pagedattn
from pagedattn import reference
from reference_block_manager import ReferenceBlockManager, ReferenceOutOfBlocks

__all__ = ["Draw", "RandomDraw", "Failure", "TARGETS", "KNOWN_ISSUES", "run_case", "main"]

TYPED = (ValueError, TypeError, IndexError)
# Open bugs outside this module's reach (label -> description with a reproducer). A case
# that hits one counts as "known" (not a failure) unless --strict-known is given, and the
# summary lists the hits. None is open: test_no_known_issue_is_left_open in
# test_fuzz_api.py pins this dict empty.
KNOWN_ISSUES: dict = {}
# How to run this file again, for the replay line of a failing case.
_SCRIPT = os.path.abspath(__file__)


# ---------------------------------------------------------------------------------------
# Random source
# ---------------------------------------------------------------------------------------
class Draw(abc.ABC):
    """Integers on demand; everything else is derived. Subclass and define ``int``."""

    @abc.abstractmethod
    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi] (inclusive bounds)."""

    def choice(self, items: Any) -> Any:
        items = list(items)
        return items[self.int(0, len(items) - 1)]

    def bool(self, p: float = 0.5) -> bool:
        return self.int(0, 999) < int(p * 1000)

    def rng(self) -> np.random.Generator:
        """A NumPy generator for bulk values (array contents), seeded from this source."""
        return np.random.default_rng(self.int(0, 2**32 - 1))


class RandomDraw(Draw):
    def __init__(self, seed: int, case: int) -> None:
        self._rng = np.random.default_rng([seed, case])

    def int(self, lo: int, hi: int) -> int:
        return int(self._rng.integers(lo, hi, endpoint=True))


class Failure(AssertionError):
    """A contract violation: wrong answer, untyped error, missing error, state changed."""


@dataclasses.dataclass
class Outcome:
    target: str
    kind: str  # "ok", "error" (the expected typed error), "known"
    label: str = ""


def _fail(label: str, msg: str) -> None:
    raise Failure(f"[{label}] {msg}")


# ---------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------
# Valid calls draw from the library's own list of what it supports.
SUPPORTED = pagedattn.supported()
# The layouts the rank of the caches tells apart: the fuzzed calls pass no layout=
# ("hnd" shares "nhd"'s rank and is covered by test_layouts.py with layout="hnd").
LAYOUTS = [name for name in SUPPORTED["layouts"] if name != "hnd"]
FP8_KINDS = [k for k in SUPPORTED["kv_cache_dtypes"] if k != "auto"]


def _float_dtypes() -> list:
    """Every supported dtype NumPy can hold (bfloat16 through ml_dtypes, when installed)."""
    out = []
    for name in SUPPORTED["dtypes"]:
        if name == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
                continue
            out.append(np.dtype(ml_dtypes.bfloat16))
        else:
            out.append(np.dtype(name))
    return out


FLOAT_DTYPES = _float_dtypes()
# (atol, rtol) against float64 on the fuzzer's inputs (normal values, moderate logits).
TOL = {"float32": (1e-4, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
NAN_CODE = 0x7F  # NaN in both fp8 formats


def _fp8_codes(kind: str) -> np.ndarray:
    t = reference.fp8_decode(np.arange(256), kind)
    return np.nonzero(np.isfinite(t) & (np.abs(t) <= 4.0))[0].astype(np.uint8)


FP8_CODES = {k: _fp8_codes(k) for k in FP8_KINDS}


def _expect_error(label: str, fn: Callable[[], Any], expected: tuple, known: Optional[str] = None) -> Outcome:
    """Runs fn, which must raise one of `expected` (typed) errors."""
    try:
        fn()
    except expected:
        return Outcome("", "error", label)
    except Exception as e:  # noqa: BLE001 - any other type is exactly what we look for
        if known:
            return Outcome("", "known", known)
        _fail(label, f"expected {[t.__name__ for t in expected]}, got {type(e).__name__}: {e}")
    if known:
        return Outcome("", "known", known)
    _fail(label, f"expected {[t.__name__ for t in expected]}, but the call returned normally")
    raise AssertionError("unreachable")


def _call_valid(label: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        _fail(label, f"valid call raised {type(e).__name__}: {e}")


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _check_close(label: str, out: Any, ref: np.ndarray, dtype: np.dtype, nonfinite: bool = False) -> None:
    got = _f64(out)
    if got.shape != ref.shape:
        _fail(label, f"output shape {got.shape} != reference {ref.shape}")
    fin_ref = np.isfinite(ref)
    if nonfinite:
        # Non-finite inputs: the output is non-finite exactly where the reference's is
        # (nothing leaks into other rows), and close elsewhere.
        if not np.array_equal(np.isfinite(got), fin_ref):
            bad = np.argwhere(np.isfinite(got) != fin_ref)[:3].tolist()
            _fail(label, f"non-finite pattern differs from the reference at {bad}")
    elif not np.isfinite(got).all():
        bad = np.argwhere(~np.isfinite(got))[:3].tolist()
        _fail(label, f"non-finite output at {bad} (a wrong index read a NaN slot?)")
    atol, rtol = TOL[np.dtype(dtype).name]
    g, r = got[fin_ref], ref[fin_ref]
    err = np.abs(g - r) - (atol + rtol * np.abs(r))
    if err.size and err.max() > 0:
        i = int(np.argmax(err))
        _fail(label, f"mismatch: got {g[i]!r}, reference {r[i]!r} (atol {atol}, rtol {rtol})")


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.name == "bfloat16":
        a, b = a.view(np.uint16), b.view(np.uint16)
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def _readonly(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


# ---------------------------------------------------------------------------------------
# paged_attention / prepare_decode
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class DecodeProblem:
    query: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    kw: dict
    dtype: np.dtype
    block_size: int
    num_blocks: int
    nonfinite: bool = False

    def args(self) -> list:
        return [self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens]

    def reference(self) -> np.ndarray:
        kw = {k: self.kw[k] for k in REF_KEYS if k in self.kw}
        return reference.paged_attention_ref(*self.args(), **kw)


# The keywords of a call that the float64 reference takes too.
REF_KEYS = ("scale", "alibi_slopes", "kv_cache_dtype", "k_scale", "v_scale", "sliding_window", "soft_cap", "sinks")


def _draw_variants(d: Draw, H: int, B: int, nan_sinks: bool) -> dict:
    """Random attention variants with extreme values: windows of one token, around the
    block size, past every context and INT_MAX; caps from tiny to huge; sinks with
    -inf (none), +inf (all the weight), huge values and, when allowed, NaN."""
    kw: dict = {}
    if d.bool(0.5):
        kw["sliding_window"] = d.choice([1, 2, B - 1 or 1, B, B + 1, 3 * B, d.int(1, 5 * B), 2**31 - 1])
    if d.bool(0.4):
        kw["soft_cap"] = d.choice([1e-30, 1e-3, 0.5, 5.0, 50.0, 1e30, 0.0])
    if d.bool(0.4):
        sinks = d.rng().standard_normal(H).astype(np.float32) * d.choice([1.0, 10.0])
        specials = [-np.inf, np.inf, 1e30, -1e30] + ([np.nan] if nan_sinks else [])
        for _ in range(d.int(0, 2)):
            if H:
                sinks[d.int(0, H - 1)] = d.choice(specials)
        kw["sinks"] = sinks
    return kw


def _reached_blocks(p: DecodeProblem) -> list:
    """(sequence, block index) of every block a decode reads: a window's earlier blocks are not."""
    w = int(p.kw.get("sliding_window", 0))
    out = []
    for i in range(p.query.shape[0]):
        n = int(p.seq_lens[i])
        first = max(0, n - w) // p.block_size if w else 0
        out += [(i, b) for b in range(first, -(-n // p.block_size))]
    return out


def _seq_len(d: Draw, B: int) -> int:
    return max(0, d.choice([0, 1, B - 1, B, B + 1, 2 * B, 3 * B - 1, d.int(0, 4 * B)]))


def _draw_cache_kind(d: Draw) -> tuple:
    """(rng, dtype, kv_cache_dtype, layout, cache dtype, x) of a random cache setup."""
    rng = d.rng()
    dtype = d.choice(FLOAT_DTYPES)
    kv = d.choice(["auto"] * len(FP8_KINDS) + FP8_KINDS)  # float caches half the time
    layout = d.choice(LAYOUTS)
    cache_dt = dtype if kv == "auto" else np.dtype(np.uint8)
    return rng, dtype, kv, layout, cache_dt, 16 // cache_dt.itemsize


def make_decode_problem(d: Draw, variants: bool = False, nan_sinks: bool = True, long: bool = False) -> DecodeProblem:
    """long: sequences of 150-400 tokens (a varlen prompt then spans several CPU tiles per KV
    head, whose context is converted once for all of them)."""
    rng, dtype, kv, layout, cache_dt, x = _draw_cache_kind(d)
    big = d.bool(0.05) and not long  # the CPU limits on head size and block size
    K = d.int(1, 3)
    G = d.choice([1, 1, 2, 3, 4])
    if layout == "vllm":
        D = x * d.int(1, 6)
    else:
        D = d.choice([1, 3, 8, 16, 17, 32, 64, 80])
    B = d.choice([1, 2, 3, 4, 7, 8, 16, 17, 32])
    S = d.choice([0, 1, 1, 2, 3, 4, 5])
    if big:
        K, G, S = 1, 1, min(S, 1)
        if d.bool():
            D = SUPPORTED["cpu_max_head_size"]
        else:
            B = SUPPORTED["cpu_max_block_size"]
    lens = [_seq_len(d, B) for _ in range(S)]
    if long:
        S = min(S, 2)
        lens = [d.int(150, 400) for _ in range(S)]
    if big:
        lens = [min(n, 2 * B) for n in lens]
    need = [-(-n // B) for n in lens]
    M = max(need + [0]) + d.int(0, 2)
    N = sum(need) + d.int(0, 3)
    shared = d.bool(0.2) and N > 0
    perm = rng.permutation(N).astype(np.int32)
    tables = np.empty((S, M), np.int32)
    pos = 0
    for i, n in enumerate(need):
        if shared:
            tables[i, :n] = rng.integers(0, N, n)
        else:
            tables[i, :n] = perm[pos : pos + n]
            pos += n
        # Padding is never read: fill it with garbage, out-of-range ids included.
        tables[i, n:] = d.choice([0, -1, N, 2**31 - 1, -(2**31), d.int(-5, N + 5)])
    kshape, vshape = pagedattn.kv_cache_shape(N, B, K, D, cache_dt, layout)
    if kv == "auto":
        kc = np.full(kshape, np.nan, dtype)
        vc = np.full(vshape, np.nan, dtype)
    else:
        kc = np.full(kshape, NAN_CODE, np.uint8)
        vc = np.full(vshape, NAN_CODE, np.uint8)
    # Fill exactly the slots some sequence reaches.
    for i, n in enumerate(lens):
        for t in range(n):
            b, off = int(tables[i, t // B]), t % B
            if kv == "auto":
                kv_k = rng.standard_normal((K, D)).astype(dtype)
                kv_v = rng.standard_normal((K, D)).astype(dtype)
            else:
                kv_k = rng.choice(FP8_CODES[kv], (K, D))
                kv_v = rng.choice(FP8_CODES[kv], (K, D))
            if layout == "vllm":
                kc[b, :, :, off, :] = kv_k.reshape(K, D // x, x)
                vc[b, :, :, off] = kv_v
            else:
                kc[b, off] = kv_k
                vc[b, off] = kv_v
    H = K * G
    # The query: contiguous, a strided view of a wider buffer, or reversed.
    qmode = d.choice(["contig", "contig", "wide", "reversed"])
    if qmode == "wide" and S > 0:
        buf = rng.standard_normal((S, 3 * H, D + d.choice([0, 5]))).astype(dtype)
        q = buf[:, H : 2 * H, :D]
    elif qmode == "reversed" and S > 1:
        q = rng.standard_normal((S, H, D)).astype(dtype)[::-1]
    else:
        q = rng.standard_normal((S, H, D)).astype(dtype)
    kw: dict = {}
    if kv != "auto":
        kw.update(kv_cache_dtype=kv, k_scale=float(rng.uniform(0.05, 2.0)), v_scale=float(rng.uniform(0.05, 2.0)))
    if d.bool(0.3):
        kw["scale"] = float(rng.uniform(-2.0, 2.0)) / math.sqrt(D)
    if d.bool(0.3):
        kw["alibi_slopes"] = (2.0 ** (-8.0 * (np.arange(H) + 1) / H)).astype(np.float32) * d.choice([1, -1])
    if d.bool(0.2):  # CUDA-only options are accepted and ignored on the CPU
        kw.update(kernel=d.choice(["auto", "single_pass", "partitioned"]), partition_size=d.choice([0, 256, 512]),
                  check_block_tables=d.bool())  # fmt: skip
    nonfinite = False
    if variants and d.bool(0.4):
        kw.update(_draw_variants(d, H, B, nan_sinks))
        nonfinite = "sinks" in kw and bool(np.isnan(kw["sinks"]).any())
    return DecodeProblem(q, kc, vc, tables, np.asarray(lens, np.int32), kw, dtype, B, N, nonfinite)


def _inject_nonfinite(d: Draw, p: DecodeProblem) -> bool:
    """Puts inf/-inf/NaN into the query, reached cache slots or ALiBi slopes."""
    vals = [np.inf, -np.inf, np.nan]
    S, H, D = p.query.shape
    reached = [(i, t) for i in range(S) for t in range(int(p.seq_lens[i]))]
    where = d.choice(["query", "cache", "alibi"])
    if where == "query" and p.query.size:
        q = p.query.copy()
        q[d.int(0, S - 1), d.int(0, H - 1), d.int(0, D - 1)] = d.choice(vals)
        p.query = q
    elif where == "cache" and reached and p.kw.get("kv_cache_dtype", "auto") == "auto":
        i, t = d.choice(reached)
        b, off = int(p.block_tables[i, t // p.block_size]), t % p.block_size
        cache = p.key_cache if d.bool() else p.value_cache
        idx = [b] + [d.int(0, n - 1) for n in cache.shape[1:]]
        if cache.ndim == 5:  # vllm key: token axis 3
            idx[3] = off
        elif cache is p.value_cache and cache.ndim == 4 and p.key_cache.ndim == 5:  # vllm value: token axis 3
            idx[3] = off
        else:  # nhd: token axis 1
            idx[1] = off
        cache[tuple(idx)] = d.choice(vals)
    elif where == "alibi" and "alibi_slopes" in p.kw and H:
        a = p.kw["alibi_slopes"].copy()
        a[d.int(0, H - 1)] = d.choice(vals)
        p.kw["alibi_slopes"] = a
    else:
        return False
    return True


def _decode_mutations(d: Draw, p: DecodeProblem) -> list:
    """(label, change(args, kw) -> None, expected error types, known issue or None)."""
    S, H, D = p.query.shape
    M = p.block_tables.shape[1]
    B = p.block_size
    fp8 = p.kw.get("kv_cache_dtype", "auto") != "auto"
    m: list = []

    def put(i: int, v: Any) -> Callable:
        def f(a: list, kw: dict) -> None:
            a[i] = v

        return f

    def setkw(**over: Any) -> Callable:
        def f(a: list, kw: dict) -> None:
            kw.update(over)

        return f

    q, kc, vc, bt, sl = p.args()
    m.append(("query ndim", put(0, q.reshape(S, H * D)), (ValueError,), None))
    m.append(("query 9 dims", put(0, q.reshape((S, H, D) + (1,) * 6)), (ValueError,), None))
    m.append(("query float64", put(0, q.astype(np.float64)), (TypeError,), None))
    m.append(("query int32", put(0, q.astype(np.int32)), (TypeError,), None))
    m.append(("query complex", put(0, q.astype(np.complex64)), (TypeError,), None))
    m.append(("query list", put(0, q.tolist()), (TypeError,), None))
    m.append(("query None", put(0, None), (TypeError,), None))
    m.append(("query without heads", put(0, np.empty((S, 0, D), q.dtype)), (ValueError,), None))
    m.append(("query of head size 0", put(0, np.empty((S, H, 0), q.dtype)), (ValueError,), None))
    m.append(("block_tables int64", put(3, bt.astype(np.int64)), (TypeError,), None))
    m.append(("block_tables int16", put(3, bt.astype(np.int16)), (TypeError,), None))
    m.append(("block_tables float32", put(3, bt.astype(np.float32)), (TypeError,), None))
    m.append(("block_tables list", put(3, bt.tolist()), (TypeError,), None))
    m.append(("seq_lens int64", put(4, sl.astype(np.int64)), (TypeError,), None))
    m.append(("seq_lens uint32", put(4, sl.astype(np.uint32)), (TypeError,), None))
    m.append(("seq_lens 2-D", put(4, sl.reshape(S, 1)), (ValueError,), None))
    m.append(("seq_lens extra", put(4, np.append(sl, np.int32(0))), (ValueError,), None))
    m.append(("block_tables extra row", put(3, np.vstack([bt, np.zeros((1, M), np.int32)])), (ValueError,), None))
    m.append(("block_tables 1-D", put(3, bt.reshape(-1)), (ValueError,), None))
    if S > 1 and M > 1:
        m.append(("block_tables transposed view", put(3, np.ascontiguousarray(bt.T).T), (ValueError,), None))
    m.append(("key_cache float64", put(1, kc.astype(np.float64)), (TypeError,), None))
    m.append(("value_cache other dtype", put(2, vc.astype(np.float32 if vc.dtype != np.float32 else np.float16)),
              (TypeError,), None))  # fmt: skip
    if kc.shape[0] > 0:
        m.append(("value_cache fewer blocks", put(2, vc[:-1]), (ValueError,), None))
        m.append(("key_cache rank 3", put(1, kc.reshape(kc.shape[0], -1, kc.shape[-1])), (ValueError,), None))
        if not np.asfortranarray(kc).flags.c_contiguous:
            m.append(("key_cache Fortran order", put(1, np.asfortranarray(kc)), (ValueError,), None))
    if kc.ndim == 5:
        wrong_x = (
            kc.reshape(kc.shape[:3] + (kc.shape[3] * 2, kc.shape[4] // 2)) if kc.shape[4] % 2 == 0 else kc[..., :1]
        )
        m.append(("key_cache wrong x", put(1, wrong_x), (ValueError,), None))
    if kc.shape[2 if kc.ndim == 4 else 1] > 1:
        m.append(("num_heads not a multiple", put(0, np.ascontiguousarray(q[:, : H - 1])), (ValueError,), None))
    m.append(("head_size mismatch", put(0, np.concatenate([q, q[:, :, :1]], axis=2)), (ValueError,), None))
    m.append(("out dtype", setkw(out=np.zeros((S, H, D), np.float64)), (TypeError,), None))
    m.append(("out shape", setkw(out=np.zeros((S, H, D + 1), q.dtype)), (ValueError,), None))
    m.append(("out ndim", setkw(out=np.zeros((S, H * D), q.dtype)), (ValueError,), None))
    if S * H * D > 0:
        zero_stride = np.lib.stride_tricks.as_strided(np.zeros(D, q.dtype), (S, H, D), (0, 0, q.itemsize),
                                                      writeable=True)  # fmt: skip
        if S * H > 1:
            m.append(("out zero strides", setkw(out=zero_stride), (ValueError,), None))
        m.append(("out read-only", setkw(out=_readonly(np.zeros((S, H, D), q.dtype))), (ValueError, TypeError),
                  None))  # fmt: skip
        if not fp8 and kc.size >= S * H * D:
            m.append(("out aliases key_cache", setkw(out=kc.reshape(-1)[: S * H * D].reshape(S, H, D)),
                      (ValueError,), None))  # fmt: skip
            m.append(("out aliases value_cache", setkw(out=vc.reshape(-1)[-S * H * D :].reshape(S, H, D)),
                      (ValueError,), None))  # fmt: skip
        if q.flags.c_contiguous and H > 1:
            shifted = np.zeros((S * H + 1) * D, q.dtype)
            qv = shifted[: S * H * D].reshape(S, H, D)
            qv[...] = q
            m.append(("out overlaps query shifted", lambda a, kw: (a.__setitem__(0, qv),
                      kw.update(out=shifted[D:].reshape(S, H, D))), (ValueError,), None))  # fmt: skip
    m.append(("alibi length", setkw(alibi_slopes=np.ones(H + 1, np.float32)), (ValueError,), None))
    m.append(("alibi float64", setkw(alibi_slopes=np.ones(H, np.float64)), (TypeError,), None))
    m.append(("alibi 2-D", setkw(alibi_slopes=np.ones((H, 1), np.float32)), (ValueError,), None))
    m.append(("scale nan", setkw(scale=float("nan")), (ValueError,), None))
    m.append(("sliding_window negative", setkw(sliding_window=d.choice([-1, -(2**31)])), (ValueError,), None))
    m.append(("sliding_window huge", setkw(sliding_window=d.choice([2**31, 2**63, -(2**63) - 1])), (ValueError,), None))
    m.append(("sliding_window float", setkw(sliding_window=d.choice([1.5, "8", None])), (TypeError,), None))
    m.append(("soft_cap bad", setkw(soft_cap=d.choice([-1.0, -1e-30, float("nan"), float("inf"), -float("inf"), 1e39])),
              (ValueError,), None))  # fmt: skip
    m.append(("soft_cap str", setkw(soft_cap=d.choice(["1", None])), (TypeError,), None))
    m.append(("sinks length", setkw(sinks=np.zeros(H + d.choice([1, -1]) if H else 1, np.float32)), (ValueError,),
              None))  # fmt: skip
    m.append(("sinks float64", setkw(sinks=np.zeros(H, d.choice([np.float64, np.float16, np.int32]))), (TypeError,),
              None))  # fmt: skip
    m.append(("sinks 2-D", setkw(sinks=np.zeros((H, 1), np.float32)), (ValueError,), None))
    if H > 1:
        m.append(("sinks strided", setkw(sinks=np.zeros(2 * H, np.float32)[::2]), (ValueError,), None))
    m.append(("scale inf", setkw(scale=d.choice([float("inf"), -float("inf"), 1e39])), (ValueError,), None))
    m.append(("scale str", setkw(scale="0.1"), (TypeError,), None))
    m.append(("kv_cache_dtype unknown", setkw(kv_cache_dtype=d.choice(["int4", "fp8_e3m4", "", "FP8"])),
              (ValueError,), None))  # fmt: skip
    m.append(("kv_cache_dtype None", setkw(kv_cache_dtype=None), (TypeError,), None))
    if not fp8:
        m.append(("fp8 with float caches", setkw(kv_cache_dtype=d.choice(["fp8", "fp8_e5m2"])), (TypeError,), None))
    else:
        bad = d.choice([0.0, -1.0, float("nan"), float("inf"), 1e-40, 1e39])
        which = d.choice(["k_scale", "v_scale"])
        m.append((f"{which} {bad}", setkw(**{which: bad}), (ValueError,), None))
        m.append(("auto with uint8 caches", setkw(kv_cache_dtype="auto"), (TypeError,), None))
    m.append(("kernel", setkw(kernel=d.choice(["v2", "", "SINGLE_PASS"])), (ValueError,), None))
    m.append(("kernel not a str", setkw(kernel=d.choice([2, None, 1.0])), (TypeError,), None))
    m.append(("partition_size huge", setkw(partition_size=d.choice([2**40, -(2**31) - 1])), (ValueError,), None))
    m.append(("unknown keyword", setkw(version=2), (TypeError,), None))
    m.append(("partition_size negative", setkw(partition_size=-16), (ValueError,), None))
    m.append(("stream str", setkw(stream="default"), (TypeError,), None))
    m.append(("stream negative", setkw(stream=-1), (TypeError,), None))
    # Index contents (the CPU reads them before any work).
    reached = _reached_blocks(p)
    if reached:
        i, b = d.choice(reached)
        bad = d.choice([-1, p.num_blocks, p.num_blocks + 7, 2**31 - 1, -(2**31)])
        bt2 = bt.copy()
        bt2[i, b] = bad
        m.append((f"block id {bad}", put(3, bt2), (IndexError,), None))
    if S:
        i = d.int(0, S - 1)
        sl2 = sl.copy()
        sl2[i] = d.choice([-1, M * B + 1, 2**31 - 1, -(2**31)])
        m.append((f"seq_len {sl2[i]}", put(4, sl2), (IndexError,), None))
    # Huge sizes: refused by validation, never allocated.
    dt = q.dtype
    n_kv = kc.shape[2 if kc.ndim == 4 else 1]

    def empty_batch(a: list, kw: dict, heads: int = H, head_size: int = D, width: int = M) -> None:
        a[0] = np.empty((0, heads, head_size), dt)
        a[3] = np.empty((0, width), np.int32)
        a[4] = np.empty(0, np.int32)
        kw.pop("alibi_slopes", None)
        kw.pop("out", None)

    m.append(("num_heads 2**40 (empty batch)", lambda a, kw: empty_batch(a, kw, heads=n_kv * 2**40), (ValueError,),
              None))  # fmt: skip
    m.append(("max_blocks_per_seq 2**40 (empty batch)", lambda a, kw: empty_batch(a, kw, width=2**40), (ValueError,),
              None))  # fmt: skip
    nhd_big = (np.empty((0, 4, 1, 10**6), dt), np.empty((0, 4, 1, 10**6), dt))
    m.append(("head_size 10**6", lambda a, kw: (a.__setitem__(0, np.empty((0, 1, 10**6), dt)),
              a.__setitem__(1, nhd_big[0]), a.__setitem__(2, nhd_big[1]), a.__setitem__(3, np.empty((0, 1), np.int32)),
              a.__setitem__(4, np.empty(0, np.int32)), kw.pop("alibi_slopes", None),
              kw.update(kv_cache_dtype="auto")), (ValueError,), None))  # fmt: skip
    nhd_bs = (np.empty((0, 2048, 1, 8), dt), np.empty((0, 2048, 1, 8), dt))
    m.append(("block_size 2048", lambda a, kw: (a.__setitem__(0, np.empty((0, 1, 8), dt)),
              a.__setitem__(1, nhd_bs[0]), a.__setitem__(2, nhd_bs[1]), a.__setitem__(3, np.empty((0, 1), np.int32)),
              a.__setitem__(4, np.empty(0, np.int32)), kw.pop("alibi_slopes", None),
              kw.update(kv_cache_dtype="auto")), (ValueError,), None))  # fmt: skip
    if S and H and D:
        huge_q = np.lib.stride_tricks.as_strided(q, (2**31, H, D), (0,) + q.strides[1:], writeable=False)
        m.append(("query broadcast to 2**31 seqs", put(0, huge_q), (ValueError,), None))
        m.append(("query broadcast to 2**31 seqs, out given", lambda a, kw: (a.__setitem__(0, huge_q),
                  kw.update(out=np.zeros((S, H, D), dt))), (ValueError,), None))  # fmt: skip
    return m


def fuzz_paged_attention(d: Draw) -> Outcome:
    p = make_decode_problem(d, variants=True)
    mode = d.choice(["valid", "valid", "nonfinite", "invalid", "invalid", "invalid"])
    args, kw = p.args(), dict(p.kw)
    if mode == "invalid":
        label, change, expected, known = d.choice(_decode_mutations(d, p))
        change(args, kw)
        out = kw.get("out")
        before = out.copy() if isinstance(out, np.ndarray) and out.flags.writeable else None
        caches = [a.copy() if isinstance(a, np.ndarray) else None for a in args[1:3]]
        o = _expect_error(f"paged_attention: {label}", lambda: pagedattn.paged_attention(*args, **kw), expected, known)
        if o.kind == "error":
            if before is not None and not _same(before, out):
                _fail(label, "a call that raised wrote into out")
            for c0, c in zip(caches, args[1:3]):
                if c0 is not None and not _same(c0, c):
                    _fail(label, "a call that raised changed a cache")
        o.target = "paged_attention"
        return o
    nonfinite = (mode == "nonfinite" and _inject_nonfinite(d, p)) or p.nonfinite
    args, kw = p.args(), dict(p.kw)
    label = f"paged_attention: {mode} S={p.query.shape[0]} dtype={p.dtype.name} {kw.get('kv_cache_dtype', 'auto')}"
    omode = d.choice(["new", "new", "given", "inplace", "strided", "reversed"])
    S, H, D = p.query.shape
    if omode == "given":
        kw["out"] = np.full((S, H, D), np.nan, p.dtype)
    elif omode == "inplace":
        args[0] = kw["out"] = p.query.copy()
    elif omode == "strided":
        kw["out"] = np.full((S, 2 * H, D + 3), np.nan, p.dtype)[:, ::2, 1 : D + 1]
    elif omode == "reversed":  # negative strides
        kw["out"] = np.full((S, H, D), np.nan, p.dtype)[::-1, ::-1]
    ref = (
        p.reference()
        if omode != "inplace"
        else reference.paged_attention_ref(
            *args,
            **{k: v for k, v in kw.items() if k in REF_KEYS},
        )
    )
    out = _call_valid(label, lambda: pagedattn.paged_attention(*args, **kw))
    if "out" in kw and out is not kw["out"]:
        _fail(label, "the given out array was not returned")
    if not isinstance(out, np.ndarray) or out.dtype != p.dtype:
        _fail(label, f"returned {type(out).__name__} of dtype {getattr(out, 'dtype', None)}, expected {p.dtype}")
    _check_close(label, out, ref, p.dtype, nonfinite)
    return Outcome("paged_attention", "ok", mode)


def fuzz_prepare_decode(d: Draw) -> Outcome:
    """Validate once, run many times; index contents changed in place are re-checked."""
    p = make_decode_problem(d, variants=True)
    label = f"prepare_decode S={p.query.shape[0]}"
    if d.bool(0.25):
        # The caller drops every array right after preparing: the prepared call must own
        # what it reads (freed memory reused in between must not change the answer).
        label += " outliving its arrays"
        ref = p.reference()
        kw = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in p.kw.items()}
        run = _call_valid(label, lambda: pagedattn.prepare_decode(*(a.copy() for a in p.args()), **kw).run)
        del kw
        for _ in range(d.int(1, 3)):
            gc.collect()
            junk = [np.full(a.shape, np.nan, a.dtype) for a in p.args()]  # reuses freed memory
            _check_close(label, _call_valid(label, run), ref, p.dtype, p.nonfinite)
            del junk
        return Outcome("prepare_decode", "ok", "outliving")
    prepared = _call_valid(label, lambda: pagedattn.prepare_decode(*p.args(), **p.kw))
    for _ in range(d.int(1, 3)):
        S = p.query.shape[0]
        p.query[...] = d.rng().standard_normal(p.query.shape).astype(p.dtype)
        action = d.choice(["run", "bad block", "bad len"]) if S else "run"
        reached = _reached_blocks(p)
        if action == "bad block" and reached:
            i, b = d.choice(reached)
            old = p.block_tables[i, b]
            p.block_tables[i, b] = d.choice([-1, p.num_blocks, 2**31 - 1])
            _expect_error(f"{label}: in-place bad block id", prepared.run, (IndexError,))
            p.block_tables[i, b] = old
        elif action == "bad len":
            i = d.int(0, S - 1)
            old = p.seq_lens[i]
            p.seq_lens[i] = d.choice([-1, p.block_tables.shape[1] * p.block_size + 1])
            _expect_error(f"{label}: in-place bad length", prepared.run, (IndexError,))
            p.seq_lens[i] = old
        out = _call_valid(label, prepared.run)
        _check_close(label, out, p.reference(), p.dtype, p.nonfinite)
    return Outcome("prepare_decode", "ok", "valid")


# ---------------------------------------------------------------------------------------
# reshape_and_cache
# ---------------------------------------------------------------------------------------
def fuzz_reshape_and_cache(d: Draw) -> Outcome:
    rng, dtype, kv, layout, cache_dt, x = _draw_cache_kind(d)
    K = d.int(1, 3)
    D = x * d.int(1, 4) if layout == "vllm" else d.choice([1, 5, 8, 16, 64])
    B = d.choice([1, 2, 3, 8, 16])
    N = d.int(0, 6)
    T = d.choice([0, 1, 2, 5, 9])
    slot_dt = d.choice([np.int32, np.int64])
    nslots = N * B
    if nslots:
        slots = rng.permutation(max(nslots, T))[:T]
        slots = np.where(slots < nslots, slots, -1)
    else:
        slots = np.full(T, -1)
    if T and d.bool(0.3):  # padding entries
        slots[rng.random(T) < 0.4] = d.choice([-1, -7, -(2**31)])
    slots = slots.astype(slot_dt)
    kshape, vshape = pagedattn.kv_cache_shape(N, B, K, D, cache_dt, layout)
    fill = np.nan if kv == "auto" else NAN_CODE
    kc = np.full(kshape, fill, cache_dt)
    vc = np.full(vshape, fill, cache_dt)
    kmode = d.choice(["contig", "contig", "strided", "reversed"])
    if kmode == "strided" and T:
        kbuf = rng.standard_normal((T, 2 * K, D + 2)).astype(dtype)
        key, value = kbuf[:, ::2, :D], kbuf[:, 1::2, 2:]
    elif kmode == "reversed":  # negative strides
        key = rng.standard_normal((T, K, D)).astype(dtype)[::-1, ::-1]
        value = rng.standard_normal((T, K, D)).astype(dtype)[::-1]
    else:
        key = rng.standard_normal((T, K, D)).astype(dtype)
        value = rng.standard_normal((T, K, D)).astype(dtype)
    kw: dict = {}
    if kv != "auto":
        kw = dict(kv_cache_dtype=kv, k_scale=float(rng.uniform(0.05, 2.0)), v_scale=float(rng.uniform(0.05, 2.0)))
    args = [key, value, kc, vc, slots]
    mode = d.choice(["valid", "valid", "duplicates", "invalid", "invalid", "invalid"])
    if mode == "invalid":
        muts: list = [
            ("key float64", lambda a: a.__setitem__(0, a[0].astype(np.float64)), (TypeError,), None),
            ("value other dtype", lambda a: a.__setitem__(1, a[1].astype(np.float32 if dtype != np.float32
                                                                         else np.float16)), (TypeError,), None),
            ("key/value shapes", lambda a: a.__setitem__(1, np.zeros((T + 1, K, D), dtype)), (ValueError,), None),
            ("key 2-D", lambda a: a.__setitem__(0, a[0].reshape(T, K * D)), (ValueError,), None),
            ("slot float", lambda a: a.__setitem__(4, a[4].astype(np.float64)), (TypeError,), None),
            ("slot int16", lambda a: a.__setitem__(4, a[4].astype(np.int16)), (TypeError,), None),
            ("slot length", lambda a: a.__setitem__(4, np.append(a[4], a[4].dtype.type(-1))), (ValueError,), None),
            ("slot list", lambda a: a.__setitem__(4, a[4].tolist()), (TypeError,), None),
            ("cache dtype", lambda a: a.__setitem__(2, a[2].astype(np.float64)), (TypeError,), None),
            ("heads mismatch", lambda a: (a.__setitem__(0, np.concatenate([a[0], a[0]], axis=1)),
                                          a.__setitem__(1, np.concatenate([a[1], a[1]], axis=1))), (ValueError,), None),
            ("cache read-only", lambda a: a.__setitem__(2, _readonly(a[2])), (ValueError, TypeError),
             None),
        ]  # fmt: skip
        if kc.size:
            muts.append(("value_cache is key_cache", lambda a: a.__setitem__(3, a[2].reshape(vc.shape)
                         if kc.size == vc.size else a[2]), (ValueError,), None))  # fmt: skip
        if kv == "auto" and T and kc.size >= T * K * D:
            muts.append(
                (
                    "key aliases key_cache",
                    lambda a: a.__setitem__(0, a[2].reshape(-1)[: T * K * D].reshape(T, K, D)),
                    (ValueError,),
                    None,
                )
            )
        if T and nslots:
            bad = (
                d.choice([nslots, nslots + 1, 2**31 - 1])
                if slot_dt == np.int32
                else d.choice([nslots, 2**40, 2**63 - 1])
            )
            i = d.int(0, T - 1)

            def bad_slot(a: list, i: int = i, bad: int = bad) -> None:
                s = a[4].copy()
                s[i] = bad
                a[4] = s

            muts.append((f"slot {bad}", bad_slot, (IndexError,), None))
        if kv != "auto":
            which = d.choice(["k_scale", "v_scale"])
            bad_scale = d.choice([0.0, -2.0, float("nan"), float("inf"), 1e-40])
            muts.append((f"{which} {bad_scale}", lambda a: kw.update({which: bad_scale}), (ValueError,), None))
        else:
            muts.append(("fp8 with float caches", lambda a: kw.update(kv_cache_dtype="fp8"), (TypeError,), None))
        label, change, expected, known = d.choice(muts)
        change(args)
        snap = [c.copy() for c in (kc, vc)]
        o = _expect_error(f"reshape_and_cache: {label}", lambda: pagedattn.reshape_and_cache(*args, **kw), expected,
                          known)  # fmt: skip
        if o.kind == "error" and not (_same(snap[0], kc) and _same(snap[1], vc)):
            _fail(label, "a call that raised wrote into the caches")
        o.target = "reshape_and_cache"
        return o
    if mode == "duplicates" and T > 1:
        live = np.nonzero(slots >= 0)[0]
        if len(live) >= 1:
            slots[d.int(0, T - 1)] = slots[live[0]]
    label = f"reshape_and_cache: {mode} T={T} {dtype.name} {kv} {layout}"
    _call_valid(label, lambda: pagedattn.reshape_and_cache(*args, **kw))
    # Reference: every slot holds what its token(s) wrote, in float64 / fp8 codes.
    owners: dict = {}
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            owners.setdefault(s, []).append(t)
    for s, ts in owners.items():
        b, off = divmod(s, B)
        got_k = kc[b, :, :, off, :].reshape(K, D) if layout == "vllm" else kc[b, off]
        got_v = vc[b, :, :, off] if layout == "vllm" else vc[b, off]
        cands_k = [c for t in ts for c in _expected_rows(key[t], kv, kw.get("k_scale", 1.0))]
        cands_v = [c for t in ts for c in _expected_rows(value[t], kv, kw.get("v_scale", 1.0))]
        for got, cands, name in ((got_k, cands_k, "key"), (got_v, cands_v, "value")):
            got = np.asarray(got)
            ok = np.zeros(got.shape, bool)
            for c in cands:  # duplicates: every element comes from one of the writers
                ok |= (got.view(np.uint8) if kv != "auto" else _f64(got)) == c
            if not ok.all():
                _fail(label, f"slot {s} {name} does not hold the written values")
    # Slots nobody wrote stay NaN.
    written = np.zeros(N * B, bool)
    written[list(owners)] = True
    for cache, name in ((kc, "key_cache"), (vc, "value_cache")):
        tok_axis = 3 if (layout == "vllm") else 1
        per_slot = np.moveaxis(cache, tok_axis, 1).reshape(N * B, -1) if N else np.zeros((0, 1))
        if kv == "auto":
            poisoned = np.isnan(_f64(per_slot)).all(axis=1)
        else:
            poisoned = (per_slot == NAN_CODE).all(axis=1)
        if N and not poisoned[~written].all():
            _fail(label, f"{name}: a slot that no token maps to was written")
    return Outcome("reshape_and_cache", "ok", mode)


def _fp8_encode(v: np.ndarray, kind: str) -> np.ndarray:
    """float64 -> fp8 codes: round to nearest even, saturating to the largest finite value,
    sign kept (an independent NumPy version of the documented cache-write rounding)."""
    table = reference.fp8_decode(np.arange(128), kind)  # positive codes, increasing values
    codes = np.nonzero(np.isfinite(table))[0]
    vals = table[codes]
    a = np.clip(np.abs(v), 0.0, vals[-1])
    hi = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo = hi - 1
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    mag = np.where(pick_hi, codes[hi], codes[lo]).astype(np.uint8)
    return np.where(np.signbit(v), mag | np.uint8(0x80), mag).astype(np.uint8)


def _expected_rows(row: np.ndarray, kv: str, scale: float) -> list:
    """What a cache slot may hold after writing `row`: the value itself, or for fp8 the
    code of the exact value / scale (a float64 quotient of two float32 values is on the
    same side of every fp8 rounding midpoint as the exact one)."""
    if kv == "auto":
        return [_f64(row)]
    return [_fp8_encode(_f64(row) / np.float64(np.float32(scale)), kv)]


# ---------------------------------------------------------------------------------------
# kv_cache_shape
# ---------------------------------------------------------------------------------------
def _dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype given as a name, a NumPy dtype / scalar type or a torch dtype."""
    if isinstance(dtype, str):
        return dtype.replace("torch.", "")
    if str(dtype).startswith("torch."):
        return str(dtype)[len("torch.") :]
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def fuzz_kv_cache_shape(d: Draw) -> Outcome:
    sizes = [0, 1, 2, 3, 16, 17, 64, 1024, 10**6, 2**31, 2**40, 2**62, -1, -(2**40)]
    n, b, k, h = (d.choice(sizes) for _ in range(4))
    dtype_opts = ["float32", "float16", "bfloat16", "uint8", "fp8", "fp8_e4m3", "fp8_e5m2", np.float16,
                  np.dtype(np.float32), "float64", "int32", "complex", "", None, 5, object()]  # fmt: skip
    dtype = d.choice(dtype_opts)
    layout = d.choice(["vllm", "nhd", "vllm", "hnd", "", None])
    odd = d.choice([None, None, None, "float", "str", "huge", "inf", "nan", "none"])
    if odd == "float":
        n = float(abs(n) % 1000)
    elif odd == "str":
        b = str(b)
    elif odd == "huge":
        h = 2**70
    elif odd == "inf":
        n = float("inf")
    elif odd == "nan":
        k = float("nan")
    elif odd == "none":
        h = None
    label = f"kv_cache_shape({n!r}, {b!r}, {k!r}, {h!r}, {dtype!r}, {layout!r})"
    try:
        res = pagedattn.kv_cache_shape(n, b, k, h, dtype, layout)
    except TYPED:
        return Outcome("kv_cache_shape", "error", label)
    except Exception as e:  # noqa: BLE001
        _fail(label, f"raised {type(e).__name__}: {e}")
    # Accepted: the result must be right.
    ints = [int(v) for v in (n, b, k, h)]
    name = _dtype_name(dtype)
    size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(name, 1)
    if min(ints[1:]) <= 0 or ints[0] < 0 or layout not in ("vllm", "nhd", "hnd"):
        _fail(label, f"accepted bad sizes or layout: {res}")
    key, value = res
    if not all(type(v) is int for v in key + value):
        _fail(label, f"shapes are not plain ints: {res}")
    x = 16 // size
    if layout == "vllm":
        want = ((ints[0], ints[2], ints[3] // x, ints[1], x), (ints[0], ints[2], ints[3], ints[1]))
    elif layout == "hnd":
        want = ((ints[0], ints[2], ints[1], ints[3]),) * 2
    else:
        want = ((ints[0], ints[1], ints[2], ints[3]),) * 2
    if (key, value) != want:
        _fail(label, f"got {res}, expected {want}")
    if math.prod(ints) * size >= 2**63:
        _fail(label, f"accepted a cache of {math.prod(ints) * size} bytes")
    return Outcome("kv_cache_shape", "ok", label)


# ---------------------------------------------------------------------------------------
# copy_blocks / swap_blocks / decode_workspace_size
# ---------------------------------------------------------------------------------------
def _random_array(rng: np.random.Generator, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if np.dtype(dtype) == np.uint8:
        return rng.integers(0, 256, shape).astype(np.uint8)
    return rng.standard_normal(shape).astype(dtype)


def _block_arrays(d: Draw, rng: np.random.Generator, n: int, count: int) -> list:
    dtype = d.choice(FLOAT_DTYPES + [np.dtype(np.uint8)])
    shape = d.choice([(2, 8, 4, 4), (4, 16), (3,), ()])
    return [_random_array(rng, (n,) + shape, dtype) for _ in range(count)]


def _pairs(d: Draw, rng: np.random.Generator, n_src: int, n_dst: int, distinct_roles: bool) -> np.ndarray:
    if n_src == 0 or n_dst == 0:
        return np.zeros((0, 2), np.int64)
    p = d.int(0, min(n_src, n_dst))
    if distinct_roles:  # copy_blocks: destinations are never sources
        perm = rng.permutation(min(n_src, n_dst))
        half = len(perm) // 2
        src, dst = perm[:half], perm[half:]
        p = min(p, len(src), len(dst))
        return np.stack([rng.choice(src, p), rng.permutation(dst)[:p]], axis=1).astype(np.int64)
    return np.stack([rng.choice(n_src, p), rng.permutation(n_dst)[:p]], axis=1).astype(np.int64)


def fuzz_copy_blocks(d: Draw) -> Outcome:
    rng = d.rng()
    n = d.int(0, 8)
    keys = _block_arrays(d, rng, n, d.int(0, 3))
    values = _block_arrays(d, rng, n, d.int(0, 2))
    pairs = _pairs(d, rng, n, n, True)
    form = d.choice(["int64", "int32", "list"])
    mapping: Any = pairs.astype(np.int32) if form == "int32" else pairs.tolist() if form == "list" else pairs
    mode = d.choice(["valid", "valid", "invalid"])
    caches = keys + values
    if mode == "invalid" and caches:
        muts: list = [
            ("mapping float", lambda: pairs.astype(np.float64), (TypeError,)),
            ("mapping [P, 3]", lambda: np.zeros((1, 3), np.int64), (ValueError,)),
            ("mapping 1-D", lambda: np.zeros(2, np.int64), (ValueError,)),
            ("mapping out of range", lambda: np.array([[0, d.choice([-1, n, 2**40])]], np.int64), (IndexError,)),
            ("mapping Fortran", lambda: np.asfortranarray(np.zeros((2, 2), np.int64)), (ValueError,)),
            ("mapping strings", lambda: [("a", "b")], (ValueError, TypeError)),
        ]
        label, make, expected = d.choice(muts)
        snap = [c.copy() for c in caches]
        o = _expect_error(f"copy_blocks: {label}", lambda: pagedattn.copy_blocks(keys, values, make()), expected)
        if not all(_same(a, b) for a, b in zip(snap, caches)):
            _fail(label, "a call that raised changed a cache")
        o.target = "copy_blocks"
        return o
    if mode == "invalid":
        cache_muts: list = [
            ("cache read-only", [_readonly(np.zeros((4, 4), np.float32))], (TypeError, ValueError)),
            ("cache non-contiguous", [np.zeros((4, 8), np.float32)[:, ::2]], (ValueError,)),
            ("cache float64 list", [[1.0, 2.0]], (TypeError,)),
            ("cache scalar", [np.zeros((), np.float32)], (ValueError,)),
        ]
        label, cs, expected = d.choice(cache_muts)
        o = _expect_error(f"copy_blocks: {label}", lambda: pagedattn.copy_blocks(cs, [], [[0, 1]]), expected)
        o.target = "copy_blocks"
        return o
    expect = [c.copy() for c in caches]
    for e in expect:
        for s, t in pairs.tolist():
            e[t] = e[s]
    _call_valid("copy_blocks", lambda: pagedattn.copy_blocks(keys, values, mapping))
    for e, c in zip(expect, caches):
        if not _same(e, c):
            _fail("copy_blocks", f"wrong result for pairs {pairs.tolist()}")
    return Outcome("copy_blocks", "ok", mode)


def fuzz_swap_blocks(d: Draw) -> Outcome:
    rng = d.rng()
    n_src, n_dst = d.int(0, 6), d.int(0, 6)
    (src,) = _block_arrays(d, rng, n_src, 1)
    dst = _random_array(rng, (n_dst,) + src.shape[1:], src.dtype)
    pairs = _pairs(d, rng, n_src, n_dst, False)
    mode = d.choice(["valid", "valid", "invalid"])
    if mode == "invalid":
        muts: list = [
            ("dst dtype", lambda: (src, dst.astype(np.float64), pairs), (TypeError,)),
            ("block shape", lambda: (src, np.zeros((n_dst, 7), src.dtype), pairs), (ValueError,)),
            ("dst read-only", lambda: (src, _readonly(dst), pairs), (TypeError, ValueError)),
            ("mapping out of range", lambda: (src, dst, np.array([[n_src, 0]], np.int64)), (IndexError,)),
            ("mapping dst out of range", lambda: (src, dst, np.array([[0, n_dst + 3]], np.int64)), (IndexError,)),
            ("mapping int16", lambda: (src, dst, pairs.astype(np.int16)), (TypeError,)),
            ("src list", lambda: (src.tolist(), dst, pairs), (TypeError,)),
        ]
        label, make, expected = d.choice(muts)
        snap = dst.copy()
        o = _expect_error(f"swap_blocks: {label}", lambda: pagedattn.swap_blocks(*make()), expected)
        if not _same(snap, dst):
            _fail(label, "a call that raised changed dst")
        o.target = "swap_blocks"
        return o
    expect = dst.copy()
    for s, t in pairs.tolist():
        expect[t] = src[s]
    _call_valid("swap_blocks", lambda: pagedattn.swap_blocks(src, dst, pairs))
    if not _same(expect, dst):
        _fail("swap_blocks", f"wrong result for pairs {pairs.tolist()}")
    return Outcome("swap_blocks", "ok", mode)


def fuzz_decode_workspace_size(d: Draw) -> Outcome:
    vals = [0, 1, 8, 16, 64, 128, 256, -1, 2**31, 3]
    args = [d.choice(vals) for _ in range(6)]
    dtype = d.choice(["float16", "bfloat16", "float32", "float64", "nope"])
    kw = dict(kv_cache_dtype=d.choice(["auto", "fp8", "x"]), layout=d.choice(["vllm", "nhd", "x"]),
              kernel=d.choice(["auto", "single_pass", "partitioned", "v5"]),
              partition_size=d.choice([0, 512, -1]), sliding_window=d.choice([0, 4096, 2**31 - 1, -1]),
              soft_cap=d.choice([0.0, 30.0, 1e-30, -1.0, float("nan")]))  # fmt: skip
    label = f"decode_workspace_size({args}, {dtype}, {kw})"
    try:
        r = pagedattn.decode_workspace_size(*args, dtype, **kw)
    except TYPED:
        return Outcome("decode_workspace_size", "error", label)
    except Exception as e:  # noqa: BLE001
        _fail(label, f"raised {type(e).__name__}: {e}")
    if not isinstance(r, int) or r < 0:
        _fail(label, f"returned {r!r}")
    return Outcome("decode_workspace_size", "ok", label)


# ---------------------------------------------------------------------------------------
# BlockManager: random (often adversarial) call sequences
# ---------------------------------------------------------------------------------------
def _bm_snapshot(m: Any) -> tuple:
    """Everything observable about a manager: the C++ one or the reference model."""
    ids = sorted(m.sequence_ids())
    per = tuple((i, tuple(m.block_table(i)), m.seq_len(i), m.num_computed(i), m.is_swapped(i)) for i in ids)
    return (per, m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks, m.num_free_cpu_blocks,
            m.num_pending_copies)  # fmt: skip


def _stats(m: Any) -> tuple:
    st = m.prefix_cache_stats
    return st["queried_tokens"], st["hit_tokens"], st["evictions"]


def _ints(a: Any) -> list:
    return [int(v) for v in np.asarray(a).reshape(-1).tolist()]


def _pair_list(a: Any) -> list:
    return [tuple(p) for p in np.asarray(a).tolist()]


# The calls that change a manager's state, replayed on the reference model once the C++
# manager took them: (the model's call from the C++ call's arguments, the C++ result as
# the model returns it). Arguments reach the model in its plain form (ints, lists of ints).
def _pool_sized(r: Any, n: int) -> int:
    """A token count the reference model can represent: one beyond every block of its pool
    is refused for want of blocks, as the manager refuses it (without building the list)."""
    if n > (r.num_blocks + 1) * r.bs:
        raise ReferenceOutOfBlocks(f"{n} tokens need more blocks than the pool has")
    return n


_MIRRORED = {
    "add_sequence": (lambda r, a, kw: r.add_sequence(int(a[0]), _ints(a[1]), extra_key=int(kw["extra_key"])),
                     int),
    "append_tokens": (lambda r, a, kw: r.append_tokens(int(a[0]), _ints(a[1])), _ints),
    "append_tokens_batch": (lambda r, a, kw: r.append_tokens_batch(_ints(a[0]), _ints(a[1])), _ints),
    "fork": (lambda r, a, kw: r.fork(int(a[0]), int(a[1])), lambda x: x),
    "free": (lambda r, a, kw: r.free(int(a[0])), lambda x: x),
    "step": (lambda r, a, kw: r.step(_ints(a[0]), None if kw["token_ids"] is None else _ints(kw["token_ids"]),
                                     query_lens=None if kw["query_lens"] is None else _ints(kw["query_lens"])),
             lambda md: {"seq_lens": _ints(md.seq_lens), "context_lens": _ints(md.context_lens),
                         "query_start_loc": _ints(md.query_start_loc), "slot_mapping": _ints(md.slot_mapping),
                         "copy_pairs": _pair_list(md.copy_pairs)}),
    "take_copy_pairs": (lambda r, a, kw: r.take_copy_pairs(), _pair_list),
    "swap_out": (lambda r, a, kw: r.swap_out(_ints(a[0])), _pair_list),
    "swap_in": (lambda r, a, kw: r.swap_in(_ints(a[0])), _pair_list),
    "stats": (lambda r, a, kw: r.reset_prefix_cache_stats(), lambda x: None),
    "add_sequence_by_count": (lambda r, a, kw: r.add_sequence_by_count(int(a[0]), _pool_sized(r, int(a[1]))), int),
    "free_batch": (lambda r, a, kw: r.free_batch(_ints(a[0])), lambda x: x),
    "fork_batch": (lambda r, a, kw: r.fork_batch(a[0] if isinstance(a[0], int) else _ints(a[0]), _ints(a[1])),
                   lambda x: x),
    "peek_prefix": (lambda r, a, kw: r.peek_prefix(_ints(a[0]), extra_key=int(kw["extra_key"])),
                    lambda p: {"cached_tokens": p.cached_tokens, "new_blocks": p.new_blocks,
                               "reused_cached_blocks": p.reused_cached_blocks, "fits": p.fits}),
}  # fmt: skip
# step_into fills the caller's persistent buffers (or none): its effect on the manager is
# compared through the state snapshot after the call, not through its outputs.
_MIRRORED["step_into"] = (lambda r, a, kw: (_MIRRORED["step"][0](r, a, kw), None)[1], lambda md: None)


def _run_bm_call(m: Any, name: str, args: tuple, kwargs: dict) -> Any:
    if name == "stats":
        return m.prefix_cache_stats, len(m), repr(m), m.reset_prefix_cache_stats()
    if name == "contains":
        return args[0] in m
    return getattr(m, name)(*args, **kwargs)


def fuzz_block_manager(d: Draw) -> Outcome:
    """Random, often adversarial, call sequences. Every call either raises a typed error and
    changes nothing, or succeeds; a state-changing call the manager took (or refused for want
    of blocks) is replayed on the reference model, which must decide the same: same result,
    same refusal, same state and counters afterwards."""
    BM = pagedattn.BlockManager
    OOB = pagedattn.OutOfBlocksError
    allowed = TYPED + (KeyError, OOB)
    rng = d.rng()
    if d.bool(0.1):  # constructor arguments
        bad = d.choice([
            ((2**40, 16), {}, (ValueError,), None), ((0, 16), {}, (ValueError,), None),
            ((2**31, 16), {}, (ValueError,), None), ((4, 0), {}, (ValueError,), None),
            ((4, 2**21), {}, (ValueError,), None), ((4, 16), {"watermark": 1.0}, (ValueError,), None),
            ((4, 16), {"watermark": float("nan")}, (ValueError,), None),
            ((4, 16), {"sliding_window": -1}, (ValueError,), None),
            ((4, 16), {"sliding_window": 8, "enable_prefix_caching": True}, (ValueError,), None),
            ((4, 16), {"num_cpu_blocks": -1}, (ValueError,), None), ((4.5, 16), {}, (TypeError,), None),
            (("4", 16), {}, (TypeError,), None),
            ((2**20, 2**20), {"enable_prefix_caching": True}, (ValueError,), None),
        ])  # fmt: skip
        a, kw, expected, known = bad
        o = _expect_error(f"BlockManager{a} {kw}", lambda: BM(*a, **kw), expected, known)
        o.target = "block_manager"
        return o
    caching = d.bool(0.4)
    kw = dict(enable_prefix_caching=caching, num_cpu_blocks=d.choice([0, 0, 4, 16]),
              watermark=d.choice([0.0, 0.0, 0.1, 0.5]))  # fmt: skip
    if not caching and d.bool(0.2):
        kw["sliding_window"] = d.choice([1, 3, 8])
    num_blocks, bs = d.int(1, 24), d.choice([1, 2, 3, 4, 8])
    m = BM(num_blocks, bs, **kw)
    ref = ReferenceBlockManager(num_blocks, bs, **kw)
    known_hit: Optional[str] = None

    def seq_id() -> Any:
        ids = m.sequence_ids()
        if ids and d.bool(0.7):
            return d.choice(ids)
        return d.choice([d.int(0, 20), -1, 2**62, 2**63, -(2**63) - 1, "a", 1.5, None])

    def tokens() -> Any:
        n = d.choice([0, 1, 2, bs - 1, bs, bs + 1, 3 * bs, d.int(0, 40)])
        base = rng.integers(0, 3, max(n, 0))
        kind = d.choice(["list", "list", "int32", "int64", "uint8", "strided", "float", "2d", "str", "huge",
                         "negative", "none", "bool"])  # fmt: skip
        if kind == "int32":
            return base.astype(np.int32)
        if kind == "int64":
            return base.astype(np.int64)
        if kind == "uint8":
            return base.astype(np.uint8)
        if kind == "strided":
            return np.repeat(base, 2).astype(np.int32)[::2]
        if kind == "float":
            return base.astype(np.float32)
        if kind == "2d":
            return base.reshape(1, -1).astype(np.int32)
        if kind == "str":
            return "abc"
        if kind == "huge":
            return [2**40] + base.tolist()
        if kind == "negative":
            return [-5] + base.tolist()
        if kind == "none":
            return None
        if kind == "bool":
            return [True, False]
        return base.tolist()

    def ids_list() -> Any:
        k = d.int(0, 4)
        ids = [seq_id() for _ in range(k)]
        return np.asarray(ids, np.int64) if d.bool(0.3) and all(type(i) is int and -(2**63) <= i < 2**63
                                                                for i in ids) else ids  # fmt: skip

    def out_arr(shape: tuple) -> Any:
        kind = d.choice(["none", "none", "good", "int64", "readonly", "short", "strided", "list"])
        if kind == "good":
            return np.zeros(shape, np.int32)
        if kind == "int64":
            return np.zeros(shape, np.int64)
        if kind == "readonly":
            return _readonly(np.zeros(shape, np.int32))
        if kind == "short":
            return np.zeros(tuple(max(0, s - 1) for s in shape), np.int32)
        if kind == "strided":
            return np.zeros(tuple(2 * s for s in shape), np.int32)[tuple(slice(None, None, 2) for _ in shape)]
        if kind == "list":
            return [0] * (shape[0] if shape else 0)
        return None

    big = [2**40, 2**62]  # absurd sizes: refused before anything is allocated

    def maybe_big() -> list:
        return [d.choice(big)] if big and d.bool(0.1) else []

    def one(*args: Any, **kwargs: Any) -> tuple:
        return args, kwargs

    # name -> the drawn (args, kwargs) of one call
    calls = {
        "add_sequence": lambda: one(seq_id() if d.bool(0.3) else d.int(0, 30), tokens(),
                                    extra_key=d.choice([0, 0, 1, 2**64 - 1])),
        "append_tokens": lambda: one(seq_id(), tokens()),
        "append_tokens_batch": lambda: (lambda ids: one(ids, [1] * len(ids) if d.bool(0.8) else [1]))(ids_list()),
        "fork": lambda: one(seq_id(), d.choice([d.int(0, 40), seq_id()])),
        "free": lambda: one(seq_id()),
        "step": lambda: (lambda ids: one(ids, token_ids=d.choice([None, [2] * len(ids), [2]]),
                         query_lens=d.choice([None, None, [0] * len(ids), [1] * len(ids), [-1] * len(ids),
                                              [2**40] * len(ids)]),
                         max_blocks=d.choice([None, None, 0, 64] + maybe_big()),
                         pad=d.choice([0, -1, 2**31 - 1]),
                         seq_lens=out_arr((len(ids),)) if d.bool(0.3) else None))(ids_list()),
        "step_into": lambda: (lambda ids: one(ids, token_ids=d.choice([None, [2] * len(ids), [2]]),
                              query_lens=d.choice([None, None, [1] * len(ids), [2**40] * len(ids)]),
                              block_tables=d.choice([None, out_arr((len(ids) + d.int(0, 3), d.int(0, 12)))]),
                              seq_lens=d.choice([None, out_arr((len(ids) + d.int(0, 3),))]),
                              slot_mapping=d.choice([None, np.zeros(d.int(0, 80), np.int64),
                                                     np.zeros(4, np.int32)]),
                              pad=d.choice([0, -1]), incremental=d.bool(0.7)))(ids_list()),
        "add_sequence_by_count": lambda: one(d.int(0, 30) if d.bool(0.7) else seq_id(),
                                             d.choice([0, 1, bs, 3 * bs + 1, -1, 2**40])),
        "free_batch": lambda: one(ids_list()),
        "fork_batch": lambda: one(d.choice([seq_id(), ids_list()]), [d.int(0, 40) for _ in range(d.int(0, 3))]),
        "peek_prefix": lambda: one(tokens(), extra_key=d.choice([0, 1])),
        "take_copy_pairs": lambda: one(),
        "swap_out": lambda: one(ids_list()),
        "swap_in": lambda: one(ids_list()),
        "can_allocate": lambda: one(d.choice([tokens(), d.int(-3, 50), 2**62])),
        "can_append": lambda: one(seq_id(), d.choice([1, 0, -1, 2**62])),
        "can_append_batch": lambda: one(ids_list()),
        "can_swap_out": lambda: one(ids_list()),
        "can_swap_in": lambda: one(ids_list()),
        "block_tables": lambda: (lambda ids: one(ids, out=out_arr((len(ids), d.int(0, 8))),
                                 max_blocks=d.choice([None, 0, 3, 16] + maybe_big()),
                                 pad=d.choice([0, -1])))(ids_list()),
        "seq_lens": lambda: (lambda ids: one(ids, out=out_arr((len(ids),))))(ids_list()),
        "csr": lambda: one(ids_list(), pad=d.choice([0, -1])),
        "slots": lambda: one(seq_id(), d.choice([0, 0, 1, -1, 5]), d.choice([None, None, 0, 3, 100] + maybe_big())),
        "block_table": lambda: one(seq_id()),
        "token_ids": lambda: one(seq_id()),
        "seq_len": lambda: one(seq_id()),
        "num_computed": lambda: one(seq_id()),
        "is_swapped": lambda: one(seq_id()),
        "ref_count": lambda: one(d.choice([0, 1, -1, m.num_blocks, 2**40])),
        "cpu_ref_count": lambda: one(d.choice([0, -1, m.num_cpu_blocks, 2**40])),
        "is_cached": lambda: one(d.choice([0, -1, m.num_blocks])),
        "contains": lambda: one(seq_id()),
        "stats": lambda: one(),
    }  # fmt: skip
    names = list(calls)
    for step in range(d.int(5, 40)):
        name = d.choice(names)
        args, kwargs = calls[name]()
        before = _bm_snapshot(m)
        label = f"BlockManager.{name} (op {step})"
        mirror = _MIRRORED.get(name)
        try:
            result = _run_bm_call(m, name, args, kwargs)
        except allowed as e:
            after = _bm_snapshot(m)
            if after != before:
                _fail(label, "a call that raised changed the manager")
            if mirror is not None and isinstance(e, OOB):
                try:
                    mirror[0](ref, args, kwargs)
                except (ReferenceOutOfBlocks, ValueError, KeyError):
                    pass
                else:
                    _fail(label, f"raised {e!r}; the reference model took the call")
        except MemoryError:
            _fail(label, f"MemoryError:\n{traceback.format_exc()}")
        except Exception as e:  # noqa: BLE001
            _fail(label, f"raised {type(e).__name__}: {e}")
        else:
            _check_bm_result(label, m, name, result)
            if mirror is not None:
                try:
                    expected = mirror[0](ref, args, kwargs)
                except (ReferenceOutOfBlocks, ValueError, KeyError) as e:
                    _fail(label, f"succeeded; the reference model raised {e!r}")
                got = mirror[1](result)
                if name == "step":
                    expected = {k: expected[k] for k in got}
                if got != expected:
                    _fail(label, f"returned {got}; the reference model returned {expected}")
        if _bm_snapshot(m) != _bm_snapshot(ref) or _stats(m) != _stats(ref):
            _fail(label, f"state differs from the reference model's:\n  {_bm_snapshot(m)} {_stats(m)}\n"
                         f"  {_bm_snapshot(ref)} {_stats(ref)}")  # fmt: skip
        try:
            m.check_invariants()
        except Exception as e:  # noqa: BLE001
            _fail(label, f"invariant violated after the call: {e}")
    # Drain: everything freed, the pool is whole again.
    for i in m.sequence_ids():
        m.free(i)
    m.take_copy_pairs()
    if m.num_free_blocks + m.num_cached_blocks != m.num_blocks or m.num_free_cpu_blocks != m.num_cpu_blocks:
        _fail("BlockManager drain", f"pool not whole after freeing everything: {m!r}")
    return Outcome("block_manager", "known" if known_hit else "ok", known_hit or "")


def _check_bm_result(label: str, m: Any, name: str, result: Any) -> None:
    """Light semantic checks of successful export calls against the manager's own view."""
    if name == "block_tables":
        arr = np.asarray(result)
        if arr.dtype != np.int32 or arr.ndim != 2:
            _fail(label, f"block_tables returned {arr.dtype} {arr.shape}")
    elif name == "step":
        md = result
        sl = np.asarray(md.seq_lens)
        qs = np.asarray(md.query_start_loc)
        if len(qs) != md.num_seqs + 1 or qs[0] != 0 or np.any(np.diff(qs) < 0) or qs[-1] != md.num_tokens:
            _fail(label, f"query_start_loc {qs.tolist()} inconsistent with num_tokens {md.num_tokens}")
        if len(np.asarray(md.slot_mapping)) != md.num_tokens or len(sl) != md.num_seqs:
            _fail(label, "step outputs have inconsistent lengths")
        slots = np.asarray(md.slot_mapping)
        live = slots[slots >= 0]
        if len(np.unique(live)) != len(live):
            _fail(label, f"step handed out a slot twice: {slots.tolist()}")
        if live.size and (live.max() >= m.num_blocks * m.block_size):
            _fail(label, f"slot {live.max()} outside the pool")
    elif name == "slots":
        s = np.asarray(result)
        if s.size and s.max() >= m.num_blocks * m.block_size:
            _fail(label, f"slot {s.max()} outside the pool")


# ---------------------------------------------------------------------------------------
# Misuse classes: racing threads, fork, shared buffers, mappings inside caches, extreme
# integers, token ids over the int32 range, the command line
# ---------------------------------------------------------------------------------------
EXTREME_INTS = [2**31 - 1, -(2**31), 2**31, 2**63 - 1, -(2**63), 2**64, -1, 0]
RACE_VALUES = [2**31 - 1, -(2**31), -1, 0, 1]
FORK_TIMEOUT_S = 60.0  # a forked child still running after this is a hang


def _race(d: Draw, arrays: list, call: Callable[[], Any], label: str) -> int:
    """Calls `call` a few times while a second thread rewrites `arrays` (each holding valid
    indices) with random values, in and out of range, and puts the valid ones back. A call
    may return or raise IndexError / ValueError; the point is that nothing reads or writes
    out of bounds (AddressSanitizer sees it). Returns how many calls raised."""
    import threading

    rng = d.rng()
    goods = [a.copy() for a in arrays]
    bads = []
    for a in arrays:
        b = rng.choice(np.array(RACE_VALUES + [int(a.max(initial=0)) + 1], np.int64), a.shape)
        bads.append(b.astype(a.dtype))
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            for a, b in zip(arrays, bads):
                a[...] = b
            for a, g in zip(arrays, goods):
                a[...] = g

    t = threading.Thread(target=hammer, daemon=True)
    # A short switch interval: the main thread gets the GIL back soon after each call
    # instead of waiting out the hammering thread's 5 ms slice.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    t.start()
    raised = 0
    try:
        for _ in range(d.int(2, 4)):
            try:
                call()
            except (IndexError, ValueError):
                raised += 1
            except Exception as e:  # noqa: BLE001
                _fail(label, f"racing call raised {type(e).__name__}: {e}")
    finally:
        stop.set()
        t.join(10.0)
        sys.setswitchinterval(interval)
    if t.is_alive():
        _fail(label, "the mutating thread did not stop")
    return raised


def fuzz_index_race(d: Draw) -> Outcome:
    """A second thread mutates the index arrays while the main thread calls."""
    which = d.choice(["paged_attention", "reshape_and_cache", "copy_blocks"])
    label = f"index race: {which}"
    if which == "paged_attention":
        p = make_decode_problem(d)
        arrays = [a for a in (p.block_tables, p.seq_lens) if a.size]
        if not arrays:
            return Outcome("index_race", "ok", which)
        _race(d, arrays, lambda: pagedattn.paged_attention(*p.args(), **p.kw), label)
        # The arrays are valid again: the answer is right.
        _check_close(label, _call_valid(label, lambda: pagedattn.paged_attention(*p.args(), **p.kw)), p.reference(),
                     p.dtype)  # fmt: skip
    elif which == "reshape_and_cache":
        rng = d.rng()
        N, B, K, D, T = d.int(1, 4), d.choice([1, 4, 16]), d.int(1, 2), d.choice([8, 16]), d.int(1, 12)
        kshape, vshape = pagedattn.kv_cache_shape(N, B, K, D, np.float32, d.choice(LAYOUTS))
        kc, vc = np.zeros(kshape, np.float32), np.zeros(vshape, np.float32)
        key = rng.standard_normal((T, K, D)).astype(np.float32)
        value = rng.standard_normal((T, K, D)).astype(np.float32)
        slots = rng.choice(N * B, min(T, N * B), replace=False).astype(d.choice([np.int64, np.int32]))
        key, value = key[: len(slots)], value[: len(slots)]
        _race(d, [slots], lambda: pagedattn.reshape_and_cache(key, value, kc, vc, slots), label)
    else:
        rng = d.rng()
        n = d.int(2, 8)
        caches = [rng.standard_normal((n, 4, 4)).astype(np.float32) for _ in range(d.int(1, 3))]
        mapping = _pairs(d, rng, n, n, True)
        if not mapping.size:
            mapping = np.array([[0, 1]], np.int64)
        half = len(caches) // 2
        _race(d, [mapping], lambda: pagedattn.copy_blocks(caches[:half], caches[half:], mapping), label)
    return Outcome("index_race", "ok", which)


def _asan_runtime_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return "asan" in os.environ.get("LD_PRELOAD", "")


def fuzz_fork(d: Draw) -> Outcome:
    """A forked child makes a small decode call and checks the answer. Only when this is
    the process's only Python thread, and never under AddressSanitizer (its allocator is
    not fork-safe while another thread allocates)."""
    import threading

    p = make_decode_problem(d)
    if not hasattr(os, "fork") or threading.active_count() != 1 or _asan_runtime_loaded():
        return Outcome("fork", "ok", "skipped")
    ref = p.reference()
    if d.bool():  # the parent used the pool before the fork
        _call_valid("fork: parent call", lambda: pagedattn.paged_attention(*p.args(), **p.kw))
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            out = pagedattn.paged_attention(*p.args(), **p.kw)
            _check_close("fork child", out, ref, p.dtype)
            code = 0
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + FORK_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            _fail("fork", f"the forked child hung (killed after {FORK_TIMEOUT_S:g} s)")
        time.sleep(0.0005)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        _fail("fork", f"the forked child failed: wait status {status} (3 = wrong answer or exception)")
    return Outcome("fork", "ok", "child")


def _int_overlap_bufs(d: Draw, n: int) -> np.ndarray:
    return np.zeros(n, d.choice([np.int32, np.int64]))


def _expect_overlap(label: str, call: Callable[[], Any], names: tuple) -> Outcome:
    """A ValueError saying that `names[0]` overlaps `names[1]` (not some other refusal)."""
    try:
        call()
    except ValueError as e:
        msg = str(e)
        if "overlap" not in msg or not all(n in msg for n in names):
            _fail(label, f"refused for another reason: {msg}")
        return Outcome("shared_buffers", "error", label)
    except Exception as e:  # noqa: BLE001
        _fail(label, f"expected ValueError, got {type(e).__name__}: {e}")
    _fail(label, "expected ValueError, but the call returned normally")
    raise AssertionError("unreachable")


def fuzz_shared_buffers(d: Draw) -> Outcome:
    """Outputs sharing memory with inputs or with each other are refused (ValueError) and
    change nothing."""
    which = d.choice(["decode", "decode", "step", "step", "exports"])
    if which == "decode":
        p = make_decode_problem(d)
        S, H, D = p.query.shape
        args, kw = p.args(), dict(p.kw)
        where = d.choice(["query", "key_cache", "value_cache"]) if S else "key_cache"
        if where == "query":
            n = S * H * D
            if n < 2:
                return Outcome("shared_buffers", "ok", "decode: one element cannot overlap partly")
            shift = d.int(1, n - 1)  # 0 would be the allowed in-place call
            flat = np.zeros(n + shift, p.dtype)
            flat[:n] = p.query.reshape(-1)
            args[0] = flat[:n].reshape(S, H, D)
            out = flat[shift : shift + n].reshape(S, H, D)
        else:
            cache = args[1 if where == "key_cache" else 2]
            raw = cache.reshape(-1).view(np.uint8)  # an fp8 cache's bytes hold a float out too
            size = p.dtype.itemsize
            need = S * H * D * size
            if raw.size < need or S == 0:
                return Outcome("shared_buffers", "ok", "decode: no room in the cache")
            start = d.int(0, (raw.size - need) // size) * size
            out = raw[start : start + need].view(p.dtype).reshape(S, H, D)
        kw["out"] = out
        snap = [a.copy() for a in args]
        o = _expect_overlap(f"shared buffers: decode out overlapping {where}",
                            lambda: pagedattn.paged_attention(*args, **kw), ("out", where))  # fmt: skip
        if not all(_same(a, b) for a, b in zip(snap, args)):
            _fail(f"decode out overlapping {where}", "a refused call changed an input")
        o.target = "shared_buffers"
        return o
    B = d.choice([1, 2, 4, 16])
    m = pagedattn.BlockManager(d.int(16, 64), B)  # room for 4 sequences of 3 blocks
    S = d.int(1, 4)
    rng = d.rng()
    for i in range(S):
        m.add_sequence(i, rng.integers(0, 100, d.int(1, 3 * B)).tolist())
    before = _bm_snapshot(m)
    buf = np.zeros(64, np.int64)
    ids = buf[0:S]
    ids[:] = np.arange(S)
    if which == "exports":
        name = d.choice(["block_tables", "seq_lens"])
        off = d.int(0, 2 * S - 1)  # int32 offset inside the ids' bytes
        if name == "block_tables":
            out = buf.view(np.int32)[off : off + S * 3].reshape(S, 3)
            call = lambda: m.block_tables(ids, out=out)  # noqa: E731
        else:
            out = buf.view(np.int32)[off : off + S]
            call = lambda: m.seq_lens(ids, out=out)  # noqa: E731
        label = f"shared buffers: {name} out overlapping seq_ids"
        names = (name, "seq_ids")
    else:
        shapes = {"slot_mapping": (None, np.int64), "seq_lens": (S, np.int32), "context_lens": (S, np.int32),
                  "query_start_loc": (S + 1, np.int32), "block_tables": (S * 8, np.int32)}  # fmt: skip
        out_name = d.choice(sorted(shapes))
        in_name = d.choice(["seq_ids", "query_lens", "output"])
        kwargs: dict = {"query_lens": np.ones(S, np.int64)}
        if in_name == "query_lens":
            ql = buf[S : 2 * S]
            ql[:] = 1
            kwargs["query_lens"] = ql
            start_bytes = S * 8
        else:
            start_bytes = 0
        n = S if out_name == "slot_mapping" else shapes[out_name][0]
        dt = shapes[out_name][1]
        if in_name == "output":
            other = d.choice([k for k in sorted(shapes) if k != out_name])
            on = S if other == "slot_mapping" else shapes[other][0]
            odt = shapes[other][1]
            o0 = 8 * d.int(25, 32)  # aligned: the refusal must be for the overlap alone
            kwargs[other] = buf.view(np.uint8)[o0 : o0 + on * np.dtype(odt).itemsize].view(odt)
            if other == "block_tables":
                kwargs[other] = kwargs[other].reshape(S, 8)
            start_bytes = o0 + d.int(0, on * np.dtype(odt).itemsize - 1)
            start_bytes -= start_bytes % np.dtype(dt).itemsize  # aligned, still inside the other output
        else:
            start_bytes += d.int(0, S - 1) * 8
        o = buf.view(np.uint8)[start_bytes : start_bytes + n * np.dtype(dt).itemsize].view(dt)
        if o.size != n:
            return Outcome("shared_buffers", "ok", "step: no room")
        kwargs[out_name] = o.reshape(S, 8) if out_name == "block_tables" else o
        call = lambda: m.step(ids, **kwargs)  # noqa: E731
        label = f"shared buffers: step {out_name} overlapping {in_name}"
        names = (out_name,) if in_name == "output" else (out_name, in_name)
    ids_before = ids.copy()
    o = _expect_overlap(label, call, names)
    if _bm_snapshot(m) != before:
        _fail(label, "a refused call changed the manager")
    if not _same(ids_before, ids):
        _fail(label, "a refused call wrote into seq_ids")
    m.check_invariants()
    o.target = "shared_buffers"
    return o


def _mapping_inside(cache: np.ndarray, block: int, pairs: list) -> np.ndarray:
    """An int64 [P, 2] array whose memory is block `block` of `cache`, holding `pairs`."""
    flat = cache[block].reshape(-1).view(np.int64)
    m = flat[: 2 * len(pairs)].reshape(len(pairs), 2)
    m[:] = pairs
    return m


def fuzz_cache_mappings(d: Draw) -> Outcome:
    """copy_blocks / swap_blocks with the mapping inside a cache, or with repeated or
    chained destinations: ValueError, caches unchanged."""
    rng = d.rng()
    n = d.int(3, 10)
    dtype = d.choice([np.float32, np.float16, np.uint8])
    which = d.choice(["copy inside", "copy duplicate", "copy chained", "swap inside", "swap duplicate"])
    mk = lambda: _random_array(rng, (n, 4, 8), np.dtype(dtype))  # noqa: E731 - 32+ bytes per block
    P = d.int(1, 2)
    pairs = [[d.int(0, n - 1), d.int(0, n - 1)] for _ in range(P)]
    if which.startswith("copy"):
        keys = [mk() for _ in range(d.int(1, 2))]
        values = [mk() for _ in range(d.int(0, 2))]
        caches = keys + values
        if which == "copy inside":
            holder = d.int(0, len(caches) - 1)
            mapping: Any = _mapping_inside(caches[holder], d.int(0, n - 1), pairs)
        elif which == "copy duplicate":
            dst = d.int(0, n - 1)
            srcs = [s for s in range(n) if s != dst]
            mapping = [[d.choice(srcs), dst], [d.choice(srcs), dst]]
        else:
            a, b, c = (int(v) for v in rng.choice(n, 3, replace=False))
            mapping = d.choice([[[a, b], [b, c]], [[b, c], [a, b]]])
        mapping = np.asarray(mapping, d.choice([np.int64, np.int32])) if which != "copy inside" else mapping
        snap = [c.copy() for c in caches]
        o = _expect_error(f"cache mappings: {which} {np.asarray(mapping).tolist()}",
                          lambda: pagedattn.copy_blocks(keys, values, mapping), (ValueError,))  # fmt: skip
    else:
        src, dst = mk(), mk()
        caches = [src, dst]
        if which == "swap inside":
            mapping = _mapping_inside(d.choice(caches), d.int(0, n - 1), pairs)
        else:
            t = d.int(0, n - 1)
            mapping = np.array([[d.int(0, n - 1), t], [d.int(0, n - 1), t]], np.int64)
        snap = [c.copy() for c in caches]
        o = _expect_error(f"cache mappings: {which} {np.asarray(mapping).tolist()}",
                          lambda: pagedattn.swap_blocks(src, dst, mapping), (ValueError,))  # fmt: skip
    if not all(_same(a, b) for a, b in zip(snap, caches)):
        _fail(f"cache mappings: {which}", "a refused call changed a cache")
    o.target = "cache_mappings"
    return o


def fuzz_extreme_ints(d: Draw) -> Outcome:
    """One integer argument set to an extreme value: a typed error, or a correct answer."""
    v = d.choice(EXTREME_INTS)
    which = d.choice(["kv_cache_shape", "decode_workspace_size", "decode_plan", "partition_size", "block id",
                      "seq_len", "slot", "block_manager", "long_context"])  # fmt: skip
    allowed = TYPED + (OverflowError,)
    if which == "kv_cache_shape":
        args = [4, 16, 2, 64]
        i = d.int(0, 3)
        args[i] = v
        label = f"kv_cache_shape({args})"
        try:
            r = pagedattn.kv_cache_shape(*args, np.float16, d.choice(LAYOUTS))
        except allowed:
            return Outcome("extreme_ints", "error", label)
        except Exception as e:  # noqa: BLE001
            _fail(label, f"raised {type(e).__name__}: {e}")
        n = [math.prod(s) for s in r]
        if any(x < 0 for s in r for x in s) or n[0] != math.prod(args):
            _fail(label, f"returned {r!r}")
        return Outcome("extreme_ints", "ok", label)
    if which in ("decode_workspace_size", "decode_plan"):
        # num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq,
        # then (decode_plan) the device, or partition_size by keyword.
        args: list = [4, 8, 8, 64, 16, 256]
        kw = {}
        slot = d.int(0, 7 if which == "decode_plan" else 6)
        if slot < 6:
            args[slot] = v
        elif slot == 6:
            kw["partition_size"] = v
        else:
            kw["device"] = v
        label = f"{which}({args}, {kw})"
        try:
            r = getattr(pagedattn, which)(*args, "float16", **kw)
        except allowed:
            return Outcome("extreme_ints", "error", label)
        except Exception as e:  # noqa: BLE001
            _fail(label, f"raised {type(e).__name__}: {e}")
        size = r if which == "decode_workspace_size" else r.get("workspace_bytes") if isinstance(r, dict) else None
        if not isinstance(size, int) or size < 0:
            _fail(label, f"returned {r!r}")
        return Outcome("extreme_ints", "ok", label)
    if which == "block_manager":
        return _bm_extreme(d, v)
    if which == "long_context":
        return _long_context(d)
    p = make_decode_problem(d)
    if which == "slot":
        return _slot_extreme(d, v)
    args, kw = p.args(), dict(p.kw)
    label = f"extreme {which} = {v}"
    if which == "partition_size":
        kw["partition_size"] = v
    else:
        S = p.query.shape[0]
        reached = [(i, b) for i in range(S) for b in range(-(-int(p.seq_lens[i]) // p.block_size))]
        if which == "block id" and reached and -(2**31) <= v < 2**31:
            i, b = d.choice(reached)
            args[3] = p.block_tables.copy()
            args[3][i, b] = v
            if 0 <= v < p.num_blocks:  # valid (the slot it reaches may be NaN-poisoned)
                _call_valid(label, lambda: pagedattn.paged_attention(*args, **kw))
                return Outcome("extreme_ints", "ok", label)
            return _retarget(_expect_error(label, lambda: pagedattn.paged_attention(*args, **kw), (IndexError,)))
        if which == "seq_len" and S and v != 0 and -(2**31) <= v < 2**31:
            args[4] = p.seq_lens.copy()
            args[4][d.int(0, S - 1)] = v
            return _retarget(_expect_error(label, lambda: pagedattn.paged_attention(*args, **kw),
                                           (IndexError, ValueError)))  # fmt: skip
    try:
        out = pagedattn.paged_attention(*args, **kw)
    except allowed:
        return Outcome("extreme_ints", "error", label)
    except Exception as e:  # noqa: BLE001
        _fail(label, f"raised {type(e).__name__}: {e}")
    _check_close(label, out, reference.paged_attention_ref(*args, **{k: kw[k] for k in REF_KEYS if k in kw}),
                 p.dtype)  # fmt: skip
    return Outcome("extreme_ints", "ok", label)


def _long_context(d: Draw) -> Outcome:
    """A sequence at, just under or past the context limit (a table of about
    max_context_tokens / B columns, or of 2^31 tokens), read through a small sliding window
    by a decode or a varlen call: the float64 answer over the window's keys (every other
    slot NaN), or past the limit a ValueError. Such lengths once wrapped the CPU kernels'
    32-bit key positions (a crash, and wrong numbers)."""
    limit = SUPPORTED["max_context_tokens"]
    B = d.choice([256, 512, 1024])
    M = d.choice([limit // B, limit // B - 1, limit // B + 1, (2**31 - 1) // B + 1])
    L = min(2**31 - 1, M * B - d.choice([0, 1, B - 1, B, 2 * B + 3]))
    W, q = d.int(1, 48), d.choice([1, 1, 2, 5])
    K, G, D = d.choice([1, 2]), d.choice([1, 2, 4]), d.choice([8, 16, 64])
    layout = d.choice(LAYOUTS)
    varlen = q > 1 or d.bool()
    label = f"long context: {M} blocks of {B}, seq_len {L}, window {W}, {q} rows ({layout})"
    rng = d.rng()
    ks, vs = pagedattn.kv_cache_shape(3, B, K, D, np.float32, layout)
    kc, vc = np.full(ks, np.nan, np.float32), np.full(vs, np.nan, np.float32)
    table = np.zeros((1, M), np.int32)  # block 0: NaN, never read
    first = max(0, L - q - W + 1)  # the first key any row sees
    pos = np.arange(first, L)
    for j, b in enumerate(sorted({int(t) // B for t in pos})):
        table[0, b] = 1 + j  # at most two blocks (W + q - 1 < B)
    k = rng.standard_normal((len(pos), K, D)).astype(np.float32)
    v = rng.standard_normal((len(pos), K, D)).astype(np.float32)
    pagedattn.reshape_and_cache(k, v, kc, vc, (table[0, pos // B].astype(np.int64) * B + pos % B), layout=layout)
    query = rng.standard_normal((q, K * G, D)).astype(np.float32)
    kw = dict(sliding_window=W, layout=layout)
    if varlen:
        kw.update(query_start_loc=np.array([0, q], np.int32), max_query_len=q)
    call = lambda: pagedattn.paged_attention(query, kc, vc, table, np.array([L], np.int32), **kw)  # noqa: E731
    if M * B > limit:
        return _retarget(_expect_error(label, call, (ValueError,)))
    out = _call_valid(label, call)
    # the reference reads only the window's blocks
    ref_kw = {key: val for key, val in kw.items() if key != "max_query_len"}
    ref = reference.paged_attention_ref(query, kc, vc, table, np.array([L], np.int32), **ref_kw)
    _check_close(label, out, ref, np.float32)
    return Outcome("extreme_ints", "ok", label)


def _retarget(o: Outcome) -> Outcome:
    o.target = "extreme_ints"
    return o


def _slot_extreme(d: Draw, v: int) -> Outcome:
    """reshape_and_cache with one slot set to v: a negative slot marks padding (the token
    is skipped); a slot past the pool is an IndexError (caches unchanged); values outside
    the slot dtype cannot be stored."""
    rng = d.rng()
    N, B, K, D, T = d.int(1, 3), d.choice([1, 4, 16]), 1, 8, d.int(1, 4)
    kc, vc = (np.zeros(s, np.float32) for s in pagedattn.kv_cache_shape(N, B, K, D, np.float32, "nhd"))
    key = rng.standard_normal((T, K, D)).astype(np.float32)
    value = rng.standard_normal((T, K, D)).astype(np.float32)
    slot_dt = d.choice([np.int64, np.int32])
    if not np.iinfo(slot_dt).min <= v <= np.iinfo(slot_dt).max:
        return Outcome("extreme_ints", "ok", "slot outside its dtype cannot be stored")
    slots = rng.choice(N * B, min(T, N * B), replace=False).astype(slot_dt)
    key, value = key[: len(slots)], value[: len(slots)]
    j = d.int(0, len(slots) - 1)
    if 0 <= v < N * B and v in slots[np.arange(len(slots)) != j]:
        return Outcome("extreme_ints", "ok", "slot would repeat")
    slots[j] = v
    label = f"reshape_and_cache slot[{j}] = {v}"
    if v < N * B:
        _call_valid(label, lambda: pagedattn.reshape_and_cache(key, value, kc, vc, slots))
        for t, s in enumerate(slots.tolist()):
            if s >= 0 and not np.array_equal(kc.reshape(N * B, K, D)[s], key[t]):
                _fail(label, f"slot {s} does not hold token {t}")
        return Outcome("extreme_ints", "ok", label)
    snap = kc.copy()
    o = _expect_error(label, lambda: pagedattn.reshape_and_cache(key, value, kc, vc, slots), (IndexError, ValueError))
    if not _same(snap, kc):
        _fail(label, "a refused call changed the cache")
    return _retarget(o)


def _bm_extreme(d: Draw, v: int) -> Outcome:
    """A block manager call with one integer argument set to v: a typed error that changes
    nothing, or a normal return; the invariants hold either way."""
    m = pagedattn.BlockManager(16, 4, num_cpu_blocks=4)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.step([1])
    calls = {
        "BlockManager(num_blocks)": lambda: pagedattn.BlockManager(v, 4) if v != 2**31 - 1 else None,
        "BlockManager(block_size)": lambda: pagedattn.BlockManager(4, v),
        "add_sequence(seq_id)": lambda: m.add_sequence(v, [1]),
        "add_sequence(extra_key)": lambda: m.add_sequence(2, [1], extra_key=v),
        "append_tokens(seq_id)": lambda: m.append_tokens(v, [1]),
        "fork(parent_id)": lambda: m.fork(v, 2),
        "fork(child_id)": lambda: m.fork(1, v),
        "free": lambda: m.free(v),
        "step(seq_ids)": lambda: m.step([v]),
        "step(query_lens)": lambda: m.step([1], query_lens=[v]),
        "step(max_blocks)": lambda: m.step([1], max_blocks=v),
        "block_tables(max_blocks)": lambda: m.block_tables([1], max_blocks=v),
        "block_tables(pad)": lambda: m.block_tables([1], pad=v),
        "slots(start)": lambda: m.slots(1, v),
        "slots(stop)": lambda: m.slots(1, 0, v),
        "ref_count": lambda: m.ref_count(v),
        "is_cached": lambda: m.is_cached(v),
        "can_append(num_tokens)": lambda: m.can_append(1, v),
        "can_allocate": lambda: m.can_allocate(v),
        "swap_out": lambda: m.swap_out([v]),
    }
    name = d.choice(sorted(calls))
    label = f"block manager {name} = {v}"
    before = _bm_snapshot(m)
    try:
        calls[name]()
    except TYPED + (KeyError, OverflowError, pagedattn.OutOfBlocksError):
        if _bm_snapshot(m) != before:
            _fail(label, "a refused call changed the manager")
        m.check_invariants()
        return Outcome("extreme_ints", "error", label)
    except Exception as e:  # noqa: BLE001
        _fail(label, f"raised {type(e).__name__}: {e}")
    m.check_invariants()
    return Outcome("extreme_ints", "ok", label)


INT32_EDGES = [2**31 - 1, -(2**31), -1, 0, 1, 2**31 - 2, -(2**31) + 1, 65535, 65536, -65536]


def fuzz_token_ids(d: Draw) -> Outcome:
    """Token ids over the whole int32 range are cached and compared exactly (prompts that
    differ in one far-apart id get no prefix hit from each other); ids outside int32 are a
    ValueError naming token_ids that changes nothing."""
    B = d.choice([1, 2, 4])
    m = pagedattn.BlockManager(64, B, enable_prefix_caching=True)
    rng = d.rng()
    n = d.int(1, 4 * B)
    first = [int(x) for x in rng.choice(np.array(INT32_EDGES, np.int64), n)]
    m.add_sequence(0, first)
    m.step([0])
    if _ints(m.token_ids(0)) != first:
        _fail("token_ids", f"token_ids(0) = {_ints(m.token_ids(0))}, given {first}")
    second = list(first)
    mode = d.choice(["same", "one differs", "outside int32"])
    if mode == "one differs":
        j = d.int(0, n - 1)
        second[j] = d.choice([x for x in INT32_EDGES if x != first[j]])
    elif mode == "outside int32":
        second[d.int(0, n - 1)] = d.choice([2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**32])
        before = _bm_snapshot(m)
        try:
            m.add_sequence(1, second)
        except ValueError as e:
            if "token_ids" not in str(e):
                _fail("token_ids outside int32", f"the error does not name token_ids: {e}")
        except Exception as e:  # noqa: BLE001
            _fail("token_ids outside int32", f"raised {type(e).__name__}: {e}")
        else:
            _fail("token_ids outside int32", f"add_sequence accepted {second}")
        if _bm_snapshot(m) != before:
            _fail("token_ids outside int32", "a refused call changed the manager")
        m.check_invariants()
        return Outcome("token_ids", "error", mode)
    hit = m.add_sequence(1, second)
    # The longest common prefix in whole blocks (the last token is never a hit).
    common = 0
    while common < n and first[common] == second[common]:
        common += 1
    full = min(common, n - 1) // B * B
    if hit > full:
        _fail(f"token_ids {mode}", f"prefix hit of {hit} tokens for prompts sharing only {common}: {first} / {second}")
    if _ints(m.token_ids(1)) != second:
        _fail(f"token_ids {mode}", f"token_ids(1) = {_ints(m.token_ids(1))}, given {second}")
    m.check_invariants()
    return Outcome("token_ids", "ok", mode)


def _bad_command_lines() -> list:
    """(argv, option the error names): each value is outside the option's documented range."""
    from pagedattn.demo import cli

    return [
        (["--requests"], ["0", "-1", str(cli.MAX_REQUESTS + 1), str(2**64), "x", str(-(2**63))]),
        (["--block-size"], ["0", "-1", "2000", "sixteen", str(2**63), "1.5"]),
        (["--memory"], ["-5", "abc", "1e30", "2.5blocks", "12345678901234567890blocks"]),
        (["--cpu-memory"], ["abc", "12345678901234567890blocks", "-1"]),
        (["--rate"], ["nan", "0", "-1"]),
        (["--max-batch"], ["0", "-1", str(-(2**63))]),
        (["--max-num-batched-tokens"], ["0", "-1", str(2**20 + 1), "many", str(2**63)]),
        (["--check"], ["1.5", "-0.5"]),
        (["--seed"], ["-1", "-5", str(2**63), str(2**64), str(-(2**63))]),
        (["--blas-threads"], ["-1", str(-(2**31))]),
        (["--json"], ["/nonexistent-folder-of-pagedattn/r.json"]),
        (["bench", "--reps"], ["0", "-3", str(2**63), "many"]),
        (["selfcheck", "--seed"], ["-1", str(2**64)]),
        (["selfcheck", "--device"], ["tpu"]),
    ]


def fuzz_command_line(d: Draw) -> Outcome:
    """`python -m pagedattn` with one bad option value, in-process: SystemExit(2), one
    stderr line naming the option, nothing on stdout, and fast (no work ran)."""
    import contextlib
    import io

    from pagedattn.__main__ import main as cli_main

    table = _bad_command_lines()
    opts, values = d.choice(table)
    value = d.choice(values)
    option = opts[-1]
    argv = [*opts, value]
    if opts[0] not in ("bench", "selfcheck"):
        argv = d.choice([[], ["serve"]]) + ["--device", "cpu", "--quiet", *argv]
    label = f"command line {argv}"
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    code: Any = None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = cli_main(argv)
    except SystemExit as e:
        code = ("exit", e.code)
    except Exception as e:  # noqa: BLE001
        _fail(label, f"raised {type(e).__name__}: {e}")
    dt = time.perf_counter() - t0
    if code != ("exit", 2):
        _fail(label, f"expected SystemExit(2), got {code!r}; stderr {err.getvalue()!r}")
    lines = err.getvalue().strip().splitlines()
    if len(lines) != 1 or "error:" not in lines[0] or option not in lines[0]:
        _fail(label, f"stderr is not one line naming {option}: {err.getvalue()!r}")
    if out.getvalue():
        _fail(label, f"something ran: stdout {out.getvalue()[:200]!r}")
    if dt > 5.0:
        _fail(label, f"refusing took {dt:.1f} s (work ran before the check?)")
    return Outcome("command_line", "error", label)


# ---------------------------------------------------------------------------------------
# Varlen attention (query_start_loc): valid calls, bad offsets, extreme integers, offsets
# sharing memory with out, offsets changed under a prepared call or by a racing thread
# ---------------------------------------------------------------------------------------
def make_varlen_problem(d: Draw) -> tuple:
    """A decode problem turned varlen: q_i in [0, seq_len] rows per sequence (0, 1, all or
    any), a [T, H, D] query and its query_start_loc. Returns (problem, qsl)."""
    p = make_decode_problem(d, variants=True, nan_sinks=False, long=d.bool(0.1))
    lens = p.seq_lens.tolist()
    q_lens = [d.choice([0, 1, n, d.int(0, n)]) if n else 0 for n in lens]
    qsl = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)
    S, H, D = p.query.shape
    T = int(qsl[-1])
    rng = d.rng()
    if d.bool(0.25) and T:
        p.query = rng.standard_normal((T, 2 * H, D)).astype(p.dtype)[:, ::2]  # strided rows
    else:
        p.query = rng.standard_normal((T, H, D)).astype(p.dtype)
    return p, qsl


def _varlen_ref(p: DecodeProblem, qsl: np.ndarray, args: Optional[list] = None) -> np.ndarray:
    kw = {k: p.kw[k] for k in REF_KEYS if k in p.kw}
    return reference.paged_attention_ref(*(args or p.args()), query_start_loc=qsl, **kw)


def _qsl_valid(qsl: np.ndarray, lens: np.ndarray, T: int) -> bool:
    """The contract of query_start_loc, in Python."""
    q = qsl.astype(np.int64)
    rows = np.diff(q)
    return bool(q[0] == 0 and q[-1] == T and (rows >= 0).all() and (rows <= lens).all())


def _qsl_mutations(d: Draw, p: DecodeProblem, qsl: np.ndarray) -> list:
    """(label, bad query_start_loc or a change of the keywords, expected error types)."""
    S = len(qsl) - 1
    T = int(qsl[-1])
    lens = p.seq_lens
    m: list = []

    def with_entry(i: int, v: int) -> np.ndarray:
        q = qsl.copy()
        q[i] = v
        return q

    m.append(("query_start_loc int64", qsl.astype(np.int64), (TypeError,)))
    m.append(("query_start_loc float32", qsl.astype(np.float32), (TypeError,)))
    m.append(("query_start_loc 2-D", qsl.reshape(1, -1), (ValueError,)))
    m.append(("query_start_loc empty", np.zeros(0, np.int32), (ValueError,)))
    m.append(("query_start_loc one more entry", np.append(qsl, np.int32(T)), (ValueError,)))
    if len(qsl) > 1:
        m.append(("query_start_loc strided", np.repeat(qsl, 2)[::2], (ValueError,)))
    m.append(("query_start_loc[0] != 0", with_entry(0, d.choice([1, -1, T + 1, 2**31 - 1, -(2**31)])),
              (ValueError,)))  # fmt: skip
    m.append(("query_start_loc total != T", with_entry(S, d.choice([T + 1, T - 1, 2**31 - 1, -(2**31)])),
              (ValueError,)))  # fmt: skip
    if S >= 1:
        i = d.int(1, S)
        v = d.choice([v for v in EXTREME_INTS if -(2**31) <= v < 2**31] + [int(qsl[i]) + 1, int(qsl[i]) - 1])
        if not _qsl_valid(with_entry(i, v), lens, T):  # moving a row to a neighbour can be valid
            m.append((f"query_start_loc[{i}] = {v}", with_entry(i, v), (ValueError,)))
        longer = [i for i in range(S) if lens[i] < T]
        if longer and S >= 2:  # one sequence gets more rows than its length (the total kept)
            i = d.choice(longer)
            q_lens = np.diff(qsl.astype(np.int64))
            j = d.choice([j for j in range(S) if j != i])
            extra = int(lens[i]) + 1 - int(q_lens[i])
            q_lens[i] += extra
            q_lens[j] -= extra
            if q_lens[j] >= 0:
                bad = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
                m.append(("query longer than its sequence", bad, (ValueError,)))
    return m


def fuzz_varlen(d: Draw) -> Outcome:
    """paged_attention / prepare_decode with query_start_loc: a valid call matches the
    float64 causal reference; a bad one raises the typed error and writes nothing."""
    p, qsl = make_varlen_problem(d)
    S = len(qsl) - 1
    T = int(qsl[-1])
    H, D = p.query.shape[1:]
    q_max = int(np.diff(qsl).max(initial=0))
    mode = d.choice(["valid", "valid", "bad offsets", "max_query_len", "aliases out", "prepared", "race"])
    label = f"varlen {mode}: S={S} T={T} dtype={p.dtype.name} {p.kw.get('kv_cache_dtype', 'auto')}"
    kw = dict(p.kw)
    if mode == "valid":
        if d.bool():
            kw["max_query_len"] = d.choice([q_max, q_max + d.int(1, 5), 2**31 - 1])
        omode = d.choice(["new", "given", "strided"])
        if omode == "given":
            kw["out"] = np.full((T, H, D), np.nan, p.dtype)
        elif omode == "strided":
            kw["out"] = np.full((T, 2 * H, D + 3), np.nan, p.dtype)[:, ::2, 1 : D + 1]
        out = _call_valid(label, lambda: pagedattn.paged_attention(*p.args(), query_start_loc=qsl, **kw))
        if "out" in kw and out is not kw["out"]:
            _fail(label, "the given out array was not returned")
        _check_close(label, out, _varlen_ref(p, qsl), p.dtype)
        return Outcome("varlen", "ok", mode)
    if mode in ("bad offsets", "max_query_len", "aliases out"):
        out = np.full((T, H, D), -3, p.dtype)
        kw["out"] = out
        bad_qsl = qsl
        if mode == "bad offsets":
            what, bad_qsl, expected = d.choice(_qsl_mutations(d, p, qsl))
        elif mode == "max_query_len":
            v = d.choice([-1, -(2**31), -(2**63), 2**31, 2**63, 2**64] + ([q_max - 1] if q_max else []))
            kw["max_query_len"] = v
            what, expected = f"max_query_len = {v}", (ValueError, TypeError, OverflowError)
        else:  # query_start_loc placed inside out's memory
            if out.nbytes < qsl.nbytes:
                return Outcome("varlen", "ok", "too small to alias")
            bad_qsl = out.reshape(-1).view(np.uint8)[: qsl.nbytes].view(np.int32)
            bad_qsl[...] = qsl
            what, expected = "query_start_loc inside out", (ValueError,)
        before = out.copy()
        o = _expect_error(f"{label}: {what}", lambda: pagedattn.paged_attention(*p.args(), query_start_loc=bad_qsl,
                                                                                **kw), expected)  # fmt: skip
        if not _same(before, out):
            _fail(f"{label}: {what}", "a call that raised wrote into out")
        o.target = "varlen"
        return o
    if mode == "prepared":
        prepared = _call_valid(label, lambda: pagedattn.prepare_decode(*p.args(), query_start_loc=qsl, **kw))
        for _ in range(d.int(1, 3)):
            if S and d.bool():
                same_layout = [
                    m
                    for m in _qsl_mutations(d, p, qsl)
                    if m[1].shape == qsl.shape and m[1].dtype == qsl.dtype and m[1].flags.c_contiguous
                ]
                what, bad, expected = d.choice(same_layout)
                good = qsl.copy()
                qsl[...] = bad
                _expect_error(f"{label}: {what} after preparing", prepared.run, expected)
                qsl[...] = good
            p.query[...] = d.rng().standard_normal(p.query.shape).astype(p.dtype)
            _check_close(label, _call_valid(label, prepared.run), _varlen_ref(p, qsl), p.dtype)
        return Outcome("varlen", "ok", mode)
    # race: a second thread rewrites the offsets (and the other index arrays) during calls
    arrays = [a for a in (qsl, p.block_tables, p.seq_lens) if a.size]
    _race(d, arrays, lambda: pagedattn.paged_attention(*p.args(), query_start_loc=qsl, **kw), label)
    _check_close(label, _call_valid(label, lambda: pagedattn.paged_attention(*p.args(), query_start_loc=qsl, **kw)),
                 _varlen_ref(p, qsl), p.dtype)  # fmt: skip
    return Outcome("varlen", "ok", mode)


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------
def _targets() -> dict:
    t = {
        "paged_attention": fuzz_paged_attention,
        "reshape_and_cache": fuzz_reshape_and_cache,
        "kv_cache_shape": fuzz_kv_cache_shape,
    }
    # Parts written alongside this fuzzer: fuzzed through their public API when present.
    if hasattr(pagedattn, "prepare_decode"):
        t["prepare_decode"] = fuzz_prepare_decode
    if hasattr(pagedattn, "copy_blocks") and hasattr(pagedattn, "swap_blocks"):
        t["copy_blocks"] = fuzz_copy_blocks
        t["swap_blocks"] = fuzz_swap_blocks
    if hasattr(pagedattn, "decode_workspace_size"):
        t["decode_workspace_size"] = fuzz_decode_workspace_size
    if hasattr(pagedattn, "BlockManager"):
        t["block_manager"] = fuzz_block_manager
    # Misuse classes: a second thread rewriting index arrays during calls, fork children,
    # outputs sharing memory with inputs, mappings inside caches, extreme integers, token
    # ids over the int32 range, bad command lines.
    if all(hasattr(pagedattn, n) for n in ("copy_blocks", "swap_blocks", "BlockManager", "decode_plan")):
        t.update(index_race=fuzz_index_race, fork=fuzz_fork, shared_buffers=fuzz_shared_buffers,
                 cache_mappings=fuzz_cache_mappings, extreme_ints=fuzz_extreme_ints, token_ids=fuzz_token_ids,
                 command_line=fuzz_command_line)  # fmt: skip
    # Varlen queries (chunked prefill): bad offsets, extreme integers, offsets inside out,
    # offsets changed under a prepared call or by a racing thread.
    t["varlen"] = fuzz_varlen
    return t


TARGETS = _targets()
# Relative frequency of each target in a mixed run.
# The misuse targets together take about a fifth of the cases; a fork costs a process, so
# it is the rarest.
WEIGHTS = {"paged_attention": 12, "reshape_and_cache": 8, "kv_cache_shape": 4, "prepare_decode": 2,
           "copy_blocks": 2, "swap_blocks": 2, "decode_workspace_size": 2, "block_manager": 6,
           "index_race": 2, "fork": 1, "shared_buffers": 2, "cache_mappings": 1, "extreme_ints": 3,
           "token_ids": 1, "command_line": 1, "varlen": 4}  # fmt: skip


def run_case(d: Draw, target: Optional[str] = None) -> Outcome:
    """Runs one case; raises Failure on a contract violation."""
    if target is None:
        names = [n for n in TARGETS for _ in range(WEIGHTS.get(n, 1))]
        target = d.choice(names)
    out = TARGETS[target](d)
    out.target = target
    return out


def _limit_memory(mb: int) -> None:
    """Caps the address space so an accidental huge allocation fails (MemoryError)
    instead of waking the OOM killer. Skipped under AddressSanitizer (it reserves
    terabytes of shadow memory) and in CUDA builds (initialising CUDA reserves a virtual
    address range far larger than any cap, so calls would fail with out of memory)."""
    if mb <= 0 or "asan" in os.environ.get("LD_PRELOAD", "") or os.environ.get("ASAN_OPTIONS"):
        return
    if pagedattn.built_with_cuda():
        return
    try:
        import resource

        limit = mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not on this platform
        pass


@dataclasses.dataclass
class Stats:
    ran: int = 0
    failures: int = 0
    mismatches: int = 0
    crashes: int = 0
    counts: dict = dataclasses.field(default_factory=dict)  # target -> kind -> n
    known: dict = dataclasses.field(default_factory=dict)  # issue -> n

    def record(self, target: str, kind: str, label: str) -> None:
        self.ran += 1
        per = self.counts.setdefault(target, {})
        per[kind] = per.get(kind, 0) + 1
        if kind == "known":
            self.known[label] = self.known.get(label, 0) + 1


def _replay(seed: int, i: int) -> str:
    return f"python {_SCRIPT} --seed {seed} --first {i} --cases 1"


def _run_inprocess(args: argparse.Namespace, seed: int, st: Stats) -> None:
    for i in range(args.first, args.first + args.cases):
        d = RandomDraw(seed, i)
        target = d.choice(args.target) if args.target else None
        if args.trace:
            print(f"case {i}", file=sys.stderr, flush=True)
        if args.selftest_crash_at == i:
            os.abort()  # checks that the isolating driver counts crashes
        try:
            with np.errstate(all="ignore"):
                o = run_case(d, target)
        except Failure as e:
            st.failures += 1
            st.mismatches += any(w in str(e) for w in ("mismatch", "non-finite", "wrong result", "does not hold"))
            st.ran += 1
            print(f"FAIL case {i}: {e}\n  replay: {_replay(seed, i)}", flush=True)
            kind, label, tgt = "fail", "", "?"
        except Exception:  # noqa: BLE001 - a bug in a generator is a failure too
            st.failures += 1
            st.ran += 1
            print(f"FAIL case {i}: fuzzer error\n{traceback.format_exc()}  replay: {_replay(seed, i)}", flush=True)
            kind, label, tgt = "fail", "", "?"
        else:
            st.record(o.target, o.kind, o.label)
            kind, label, tgt = o.kind, o.label, o.target
            if o.kind == "known" and args.strict_known:
                st.failures += 1
                print(f"FAIL case {i}: known issue {o.label}: {KNOWN_ISSUES.get(o.label, '')}", flush=True)
        if args.trace:
            print(f"done {i} {tgt} {kind} {label if kind == 'known' else ''}", file=sys.stderr, flush=True)
        if st.failures >= args.max_failures:
            break


def _run_isolated(args: argparse.Namespace, seed: int, st: Stats) -> None:
    """Runs batches of cases in child processes; a child killed by a signal is a crash at
    the case it had started, and the run goes on after it."""
    import subprocess

    i, end = args.first, args.first + args.cases
    while i < end and st.failures < args.max_failures:
        n = min(args.isolate, end - i)
        cmd = [sys.executable, os.path.abspath(__file__), "--seed", str(seed), "--first", str(i), "--cases", str(n),
               "--trace", "--no-summary", "--max-memory-mb", str(args.max_memory_mb),
               "--max-failures", str(args.max_failures - st.failures)]  # fmt: skip
        for t in args.target or []:
            cmd += ["--target", t]
        if args.strict_known:
            cmd.append("--strict-known")
        if args.selftest_crash_at is not None:
            cmd += ["--selftest-crash-at", str(args.selftest_crash_at)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        started, finished = None, i - 1
        for line in r.stderr.splitlines():
            parts = line.split(" ", 4)
            if parts[0] == "case" and len(parts) >= 2:
                started = int(parts[1])
            elif parts[0] == "done" and len(parts) >= 4:
                finished = int(parts[1])
                if parts[3] == "fail":
                    st.failures += 1
                    st.ran += 1
                else:
                    st.record(parts[2], parts[3], parts[4].strip() if len(parts) > 4 else "")
                    if parts[3] == "known" and args.strict_known:
                        st.failures += 1
        if r.stdout:
            print(r.stdout, end="", flush=True)  # FAIL reports with their replay commands
        st.mismatches += sum(
            1
            for line in r.stdout.splitlines()
            if line.startswith("FAIL")
            and any(w in line for w in ("mismatch", "non-finite", "wrong result", "does not hold"))
        )
        if r.returncode < 0 or (started is not None and started > finished):
            crash_at = started if started is not None else i
            st.crashes += 1
            st.failures += 1
            st.ran += 1
            tail = "\n".join(line for line in r.stderr.splitlines()[-15:] if not line.startswith(("case", "done")))
            print(f"CRASH case {crash_at}: child exited with status {r.returncode}\n{tail}\n"
                  f"  replay: {_replay(seed, crash_at)}", flush=True)  # fmt: skip
            i = crash_at + 1
        else:
            i += n


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/python/harness/fuzz.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000, help="number of cases to run")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: random, printed)")
    ap.add_argument("--first", type=int, default=0, help="index of the first case (to replay one case)")
    ap.add_argument("--target", action="append", choices=sorted(TARGETS), help="fuzz only these targets")
    ap.add_argument(
        "--isolate",
        type=int,
        default=0,
        metavar="BATCH",
        help="run BATCH cases per child process, counting crashes and going on after them",
    )
    ap.add_argument("--max-failures", type=int, default=10, help="stop after this many failures")
    ap.add_argument("--max-memory-mb", type=int, default=4096, help="address-space cap (0 = none)")
    ap.add_argument("--strict-known", action="store_true", help="count known issues as failures")
    ap.add_argument("--trace", action="store_true", help="print every case to stderr before and after running it")
    ap.add_argument("--selftest-crash-at", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-summary", action="store_true", help=argparse.SUPPRESS)  # children of --isolate
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    faulthandler.enable()
    st = Stats()
    t0 = time.perf_counter()
    if args.isolate > 0:
        _run_isolated(args, seed, st)
    else:
        _limit_memory(args.max_memory_mb)
        _run_inprocess(args, seed, st)
    dt = time.perf_counter() - t0
    if args.no_summary:
        return 1 if st.failures else 0
    for name in sorted(st.counts):
        parts = ", ".join(f"{k} {v}" for k, v in sorted(st.counts[name].items()))
        print(f"  {name}: {parts}")
    for k, v in sorted(st.known.items()):
        print(f"  known issue {k} hit {v} times: {KNOWN_ISSUES.get(k, '')}")
    print(f"fuzz: {st.ran} cases, seed {seed}: {st.crashes} crashes, {st.mismatches} mismatches, "
          f"{st.failures} failures, {sum(st.known.values())} known-issue hits ({dt:.1f} s)", flush=True)  # fmt: skip
    return 1 if st.failures else 0


if __name__ == "__main__":
    sys.exit(main())
