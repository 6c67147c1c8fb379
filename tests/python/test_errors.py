"""Bad input gets a typed error whose message names the argument, what it got and what is allowed."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import make_problem


@pytest.fixture
def prob(rng):
    return make_problem(rng, [5, 20], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)


def call(p, **over):
    args = dict(query=p.query, key_cache=p.key_cache, value_cache=p.value_cache, block_tables=p.block_tables,
                seq_lens=p.seq_lens)  # fmt: skip
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    return pagedattn.paged_attention(*args.values(), **kw)


@pytest.mark.parametrize(
    "change,exc,words",
    [
        (lambda p: dict(query=p.query[0]), ValueError, ["query", "3 dimensions", "got 2"]),
        (lambda p: dict(query=p.query.astype(np.float64)), TypeError,
         ["query", "float64", "float32, float16, bfloat16"]),
        (lambda p: dict(query=p.query.astype(np.float16)), TypeError, ["key_cache", "float32", "float16"]),
        (lambda p: dict(block_tables=p.block_tables.astype(np.int64)), TypeError, ["block_tables", "int32", "int64"]),
        (lambda p: dict(seq_lens=p.seq_lens.astype(np.int64)), TypeError, ["seq_lens", "int32", "int64"]),
        (lambda p: dict(seq_lens=p.seq_lens.astype(np.float32)), TypeError, ["seq_lens", "int32", "float32"]),
        (lambda p: dict(seq_lens=p.seq_lens[:1]), ValueError, ["seq_lens", "num_seqs", "2", "got 1"]),
        (lambda p: dict(block_tables=p.block_tables[:1]), ValueError, ["block_tables", "num_seqs"]),
        (lambda p: dict(block_tables=p.block_tables[:, ::2]), ValueError, ["block_tables", "C-contiguous"]),
        (lambda p: dict(query=np.ascontiguousarray(p.query[:, :3])), ValueError, ["num_heads 3", "multiple", "2"]),
        (lambda p: dict(query=np.ascontiguousarray(p.query[:, :, :32])), ValueError, ["head_size", "64", "32"]),
        (lambda p: dict(query=np.asfortranarray(p.query)), ValueError, ["query", "last dimension", "contiguous"]),
        (lambda p: dict(key_cache=p.key_cache[..., 0]), ValueError, ["value_cache", "key_cache's shape", "nhd"]),
        (lambda p: dict(key_cache=p.key_cache[..., 0, 0]), ValueError, ["key_cache", "5 dimensions", "got 3"]),
        (lambda p: dict(key_cache=p.key_cache[:, :, :, :, :2].copy()), ValueError, ["key_cache", "x = 16", "4"]),
        (lambda p: dict(key_cache=p.key_cache[:, :, :, :, 0:1].squeeze(-1)), ValueError, ["value_cache"]),
        (lambda p: dict(value_cache=p.value_cache[:-1]), ValueError, ["value_cache", "num_blocks"]),
        (lambda p: dict(key_cache=p.key_cache[:, :, :, ::2]), ValueError, ["key_cache"]),
        (lambda p: dict(value_cache=np.asfortranarray(p.value_cache)), ValueError, ["value_cache", "C-contiguous"]),
        (lambda p: dict(out=np.empty((2, 4, 64), np.float16)), TypeError, ["out", "float16", "float32"]),
        (lambda p: dict(out=np.empty((2, 4, 32), np.float32)), ValueError, ["out", "shape"]),
        (lambda p: dict(alibi_slopes=np.ones(3, np.float32)), ValueError, ["alibi_slopes", "num_heads", "4"]),
        (lambda p: dict(alibi_slopes=np.ones(4, np.float64)), TypeError, ["alibi_slopes", "float32", "float64"]),
        (lambda p: dict(scale=float("nan")), ValueError, ["scale", "finite"]),
        (lambda p: dict(kernel="v3"), ValueError, ["kernel", "v3", "single_pass", "partitioned"]),
        (lambda p: dict(kv_cache_dtype="int4"), ValueError, ["kv_cache_dtype", "int4", "fp8_e4m3"]),
        (lambda p: dict(kv_cache_dtype="fp8_e4m3"), TypeError, ["key_cache", "uint8", "float32"]),
    ],
)
def test_decode_bad_arguments(prob, change, exc, words):
    with pytest.raises(exc) as info:
        call(prob, **change(prob))
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_seq_len_too_long(prob):
    prob.seq_lens[1] = prob.block_tables.shape[1] * 16 + 1
    with pytest.raises(IndexError, match=r"seq_lens\[1\] = \d+ is outside \[0, max_blocks_per_seq \* block_size"):
        call(prob)


def test_negative_seq_len(prob):
    prob.seq_lens[0] = -1
    with pytest.raises(IndexError, match=r"seq_lens\[0\] = -1"):
        call(prob)


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_block_id_out_of_range(prob, bad):
    prob.block_tables[1, 1] = bad
    n = prob.key_cache.shape[0]
    with pytest.raises(IndexError, match=rf"block_tables\[1, 1\] = {bad} is outside \[0, num_blocks = {n}\)"):
        call(prob)


def test_fp8_scale_must_be_positive(rng):
    kshape, vshape = pagedattn.kv_cache_shape(4, 16, 2, 64, "fp8_e4m3")
    kc, vc = np.zeros(kshape, np.uint8), np.zeros(vshape, np.uint8)
    q = rng.standard_normal((1, 4, 64)).astype(np.float16)
    with pytest.raises(ValueError, match="k_scale: must be a finite positive number, got 0"):
        pagedattn.paged_attention(q, kc, vc, np.zeros((1, 1), np.int32), np.ones(1, np.int32),
                                  kv_cache_dtype="fp8_e4m3", k_scale=0.0)  # fmt: skip


class TestCacheWriteErrors:
    def setup(self, layout="vllm", dtype=np.float16):
        kshape, vshape = pagedattn.kv_cache_shape(4, 16, 2, 64, dtype, layout)
        self.kc, self.vc = np.zeros(kshape, dtype), np.zeros(vshape, dtype)
        self.k = np.ones((3, 2, 64), dtype)
        self.v = np.ones((3, 2, 64), dtype)
        self.slots = np.array([0, 5, 63], np.int64)

    def run(self, **over):
        a = dict(key=self.k, value=self.v, key_cache=self.kc, value_cache=self.vc, slot_mapping=self.slots)
        a.update(over)
        pagedattn.reshape_and_cache(*a.values())

    def test_slot_out_of_range(self):
        self.setup()
        with pytest.raises(IndexError, match=r"slot_mapping\[2\] = 64 is outside \[0, num_blocks \* block_size = 64\)"):
            self.run(slot_mapping=np.array([0, 5, 64], np.int64))

    def test_slot_dtype(self):
        self.setup()
        with pytest.raises(TypeError, match="slot_mapping: expected dtype int32 or int64, got float32"):
            self.run(slot_mapping=self.slots.astype(np.float32))

    def test_value_shape(self):
        self.setup()
        with pytest.raises(ValueError, match="value: shape"):
            self.run(value=self.v[:2])

    def test_value_dtype(self):
        self.setup()
        with pytest.raises(TypeError, match="value: dtype float32 must equal key's dtype float16"):
            self.run(value=self.v.astype(np.float32))

    def test_heads_mismatch(self):
        self.setup()
        with pytest.raises(ValueError, match="key: num_kv_heads 1 does not match the caches' num_kv_heads 2"):
            self.run(key=self.k[:, :1], value=self.v[:, :1])

    def test_cache_dtype(self):
        self.setup()
        with pytest.raises(TypeError, match="key_cache: dtype float32 does not match"):
            self.run(key_cache=self.kc.astype(np.float32))

    def test_slot_length(self):
        self.setup()
        with pytest.raises(ValueError, match="slot_mapping: dimension 0 .num_tokens, as in key. must be 3, got 2"):
            self.run(slot_mapping=self.slots[:2])

    def test_state_unchanged_on_error(self):
        self.setup()
        before = self.kc.copy()
        with pytest.raises(IndexError):
            self.run(slot_mapping=np.array([0, 5, 10**9], np.int64))
        assert np.array_equal(before, self.kc), "a failed call must not write anything"


@pytest.mark.parametrize(
    "args,exc,words",
    [
        ((4, 16, 2, 60, "float16"), ValueError, ["head_size", "x = 16 / element size = 8", "60", "nhd"]),
        ((4, 0, 2, 64, "float16"), ValueError, ["block_size", "positive", "0"]),
        ((4, 16, 2, 64, "float64"), TypeError, ["dtype", "float64"]),
        ((4, 16, 2, 64, "complex"), ValueError, ["dtype", "complex"]),
        ((-1, 16, 2, 64, "float16"), ValueError, ["num_blocks", "-1"]),
    ],
)
def test_kv_cache_shape_errors(args, exc, words):
    with pytest.raises(exc) as info:
        pagedattn.kv_cache_shape(*args)
    for w in words:
        assert w in str(info.value)


def test_kv_cache_shape_layout_error():
    with pytest.raises(ValueError, match='layout: got "hdn", expected "vllm", "nhd" or "hnd"'):
        pagedattn.kv_cache_shape(4, 16, 2, 64, "float16", layout="hdn")


@pytest.mark.parametrize("dtype,x", [(np.float32, 4), (np.float16, 8), ("bfloat16", 8), ("fp8_e4m3", 16),
                                     (np.dtype("float16"), 8), ("uint8", 16)])  # fmt: skip
def test_kv_cache_shape_dtype_spellings(dtype, x):
    k, v = pagedattn.kv_cache_shape(3, 16, 2, 64, dtype)
    assert k == (3, 2, 64 // x, 16, x) and v == (3, 2, 64, 16)
    assert all(type(i) is int for i in k + v)


def test_not_an_array(prob):
    with pytest.raises(TypeError, match="query: expected an array .*got list"):
        pagedattn.paged_attention([[1.0]], prob.key_cache, prob.value_cache, prob.block_tables, prob.seq_lens)
    with pytest.raises(TypeError):
        call(prob, block_tables=prob.block_tables.tolist())
