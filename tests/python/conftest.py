"""Shared helpers of the Python tests: random paged problems with NaN-poisoned caches."""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import zlib

import numpy as np
import pytest

import pagedattn

# Test harness that is not part of the package (the API fuzzer, the block-manager soak and
# the reference block manager) lives in harness/: importable from every test module.
HARNESS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness")
if HARNESS_DIR not in sys.path:
    sys.path.insert(0, HARNESS_DIR)

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the test extra
    BF16 = None

# What the library supports, read from pagedattn.supported() (its one list): tests that mean
# "every supported X" iterate these; tests of chosen values keep their own lists.
SUPPORTED = pagedattn.supported()
DTYPE_NAMES = list(SUPPORTED["dtypes"])
# Every layout; LAYOUTS: those the rank tells apart, for the tests whose calls pass no
# layout= ("hnd" has "nhd"'s rank: test_layouts.py and test_cuda_layouts.py run every op
# on it, with layout="hnd").
ALL_LAYOUTS = list(SUPPORTED["layouts"])
LAYOUTS = [name for name in ALL_LAYOUTS if name != "hnd"]
KV_CACHE_DTYPES = list(SUPPORTED["kv_cache_dtypes"])
FP8_KV_CACHE_DTYPES = [k for k in KV_CACHE_DTYPES if k != "auto"]
CUDA_HEAD_SIZES = list(SUPPORTED["cuda_head_sizes"])
CUDA_BLOCK_SIZES = list(SUPPORTED["cuda_block_sizes"])


def np_dtype(name: str):
    """The NumPy dtype of a supported dtype name; None for bfloat16 without ml_dtypes."""
    return BF16 if name == "bfloat16" else np.dtype(name)


# Every supported dtype that NumPy can hold here.
DTYPES = [d for d in map(np_dtype, DTYPE_NAMES) if d is not None]
# (atol, rtol) of an output of this dtype against the float64 reference computed from
# the same (already rounded) inputs: float32 accumulation plus one output rounding.
TOL = {"float32": (2e-5, 2e-5), "float16": (1.5e-3, 1.5e-3), "bfloat16": (1.2e-2, 1.2e-2)}


def dtype_id(dt) -> str:
    return np.dtype(dt).name


@dataclasses.dataclass
class Problem:
    query: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    alibi_slopes: np.ndarray | None = None

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens)


def make_problem(
    rng: np.random.Generator,
    seq_lens,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype=np.float32,
    layout: str = "vllm",
    extra_blocks: int = 3,
    alibi: bool = False,
    block_tables=None,
    num_blocks=None,
    pad_blocks: int = 2,
) -> Problem:
    """A random problem: caches filled with NaN except the slots the sequences use.

    Block ids are a random permutation (so sequences are scattered through the pool)
    and padding entries of the block tables point at NaN blocks, so reading anything
    a sequence does not own shows up as NaN in the output.
    """
    dtype = np.dtype(dtype)
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    need = [-(-int(n) // block_size) for n in seq_lens]
    max_blocks = max(need + [0]) + pad_blocks
    if num_blocks is None:
        num_blocks = sum(need) + extra_blocks
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype, layout)
    key_cache = np.full(kshape, np.nan, dtype=dtype)
    value_cache = np.full(vshape, np.nan, dtype=dtype)
    if block_tables is None:
        perm = rng.permutation(num_blocks).astype(np.int32)
        unused = perm[sum(need):]
        block_tables = np.empty((len(seq_lens), max_blocks), dtype=np.int32)
        pos = 0
        for i, n in enumerate(need):
            block_tables[i, :n] = perm[pos : pos + n]
            pos += n
            # padding points at blocks nobody owns (NaN) when there are any, else block 0
            block_tables[i, n:] = unused[0] if len(unused) else 0
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    # Write random keys/values into exactly the used slots through the reference writer.
    slots = []
    for i, n in enumerate(seq_lens):
        t = np.arange(int(n))
        slots.append(block_tables[i, t // block_size].astype(np.int64) * block_size + t % block_size)
    slots = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    k_new = rng.standard_normal((len(slots), num_kv_heads, head_size)).astype(dtype)
    v_new = rng.standard_normal((len(slots), num_kv_heads, head_size)).astype(dtype)
    pagedattn.reference.reshape_and_cache_ref(k_new, v_new, key_cache, value_cache, slots, layout=layout)
    query = rng.standard_normal((len(seq_lens), num_heads, head_size)).astype(dtype)
    slopes = None
    if alibi:
        slopes = (2.0 ** (-8.0 * (np.arange(num_heads) + 1) / num_heads)).astype(np.float32)
    return Problem(query, key_cache, value_cache, block_tables, seq_lens, slopes)


def assert_close(out, ref, dtype, what=""):
    out = np.asarray(out).astype(np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    assert np.isfinite(out).all(), f"{what}: non-finite output (a wrong index read a NaN slot?)"
    atol, rtol = TOL[dtype if isinstance(dtype, str) else np.dtype(dtype).name]
    np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol, err_msg=what)


# Fresh inputs on every run: a new base seed each session unless PAGEDATTN_TEST_SEED
# pins it (the header of the pytest output prints it, to reproduce a failure).
BASE_SEED = int(os.environ.get("PAGEDATTN_TEST_SEED", secrets.randbelow(2**31)))


def pytest_report_header(config):
    return f"pagedattn test seed: PAGEDATTN_TEST_SEED={BASE_SEED}"


@pytest.fixture
def rng(request):
    # Each test mixes its own name into the session's seed, so tests draw different inputs.
    return np.random.default_rng([BASE_SEED, zlib.crc32(request.node.nodeid.encode())])


class DLPackOnly:
    """An array that offers only the DLPack protocol: no exchange table, no buffer, no
    attributes of its framework (the conversion takes the ``__dlpack__`` path)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, *args, **kwargs):
        return self.a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()
