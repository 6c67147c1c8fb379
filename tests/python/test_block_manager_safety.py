"""pagedattn.BlockManager under hostile and careless use: constructed prefix-cache hash
collisions, extreme integers on every integer argument, very long sequences, and output
arrays that overlap the inputs or each other."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

pagedattn = pytest.importorskip("pagedattn")
BlockManager = pagedattn.BlockManager
OutOfBlocksError = pagedattn.OutOfBlocksError

# ---------------------------------------------------------------------------------------
# Prefix cache: a constructed hash collision never gives a hit
# ---------------------------------------------------------------------------------------
# A replica of the manager's block hash (prefix_cache.cpp), used only to construct two
# different blocks that hash to the same value after the same prefix: a block whose two
# 64-bit words cancel the mixer's keys zeroes both lanes of the hash state, and there are
# two such blocks (one per lane that the second word cancels), with token ids anywhere in
# the int32 range (negative ones included).
_M64 = (1 << 64) - 1
_K0, _K1, _K2 = 0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3
_K3, _K4, _K5 = 0x589965CC75374CC3, 0x1D8E4E27C47D124F, 0x9E3779B97F4A7C15
_ROOT = (0x243F6A8885A308D3, 0x13198A2E03707344)


def _mum(a: int, b: int) -> int:
    r = a * b
    return (r & _M64) ^ (r >> 64)


def _word(t0: int, t1: int) -> int:
    return (t0 & 0xFFFFFFFF) | ((t1 & 0xFFFFFFFF) << 32)


def _halves(w: int) -> list[int]:
    return [int(np.int32(np.uint32(w & 0xFFFFFFFF))), int(np.int32(np.uint32(w >> 32)))]


def _lanes(prev: tuple[int, int], extra: int) -> tuple[int, int]:
    return _mum(prev[0] ^ _K0, extra ^ _K1), _mum(prev[1] ^ _K2, extra ^ _K3)


def _hash4(prev: tuple[int, int], extra: int, t: list[int]) -> tuple[int, int]:
    a, b = _lanes(prev, extra)
    w0, w1 = _word(t[0], t[1]), _word(t[2], t[3])
    a = _mum(w0 ^ _K1 ^ a, w1 ^ _K2)
    b = _mum(w0 ^ _K4 ^ b, w1 ^ _K5)
    return _mum(a ^ _K4, b ^ _K0), _mum(b ^ _K1, a ^ _K3)


def _colliding_blocks(prev: tuple[int, int], extra: int = 0) -> tuple[list[int], list[int]]:
    a, b = _lanes(prev, extra)
    first = _halves(_K4 ^ b) + _halves(_K2)  # second word cancels lane a, first word lane b
    second = _halves(_K1 ^ a) + _halves(_K5)  # second word cancels lane b, first word lane a
    return first, second


def test_constructed_hash_collision_gives_no_false_prefix_hit():
    x, z = [1, 2, 3, 4], [5, 6, 7, 8]
    y, y2 = _colliding_blocks(_hash4(_ROOT, 0, x))
    assert y != y2 and _hash4(_hash4(_ROOT, 0, x), 0, y) == _hash4(_hash4(_ROOT, 0, x), 0, y2)
    m = BlockManager(64, 4, enable_prefix_caching=True)
    # Sequence 1 computes X Y Z: all three blocks are registered, Z after the prefix X Y.
    assert m.add_sequence(1, x + y + z + [9]) == 0
    m.step([1])
    y_block = m.block_table(1)[1]
    assert m.is_cached(y_block)
    # Sequence 2 computes X Y': Y' is registered under the same hash as Y and replaces it.
    assert m.add_sequence(2, x + y2 + [9]) == 4
    m.step([2])
    assert not m.is_cached(y_block), "the constructed blocks must collide for this test to mean anything"
    # Sequence 3 asks for X Y' Z. Only X and Y' are cached after this prefix: Z's keys and
    # values were computed after X Y, and reusing them would answer from another prompt.
    assert m.add_sequence(3, x + y2 + z + [9]) == 8
    # Sequence 4 asks for X Y Z: Y lost its registration to the collision (a miss, not a false hit).
    assert m.add_sequence(4, x + y + z + [9]) == 4
    m.check_invariants()


def test_prefix_chain_survives_an_identical_registration():
    # Two sequences with the same prompt computed chunk by chunk, interleaved: each block is
    # registered twice (the newer wins); a later request still hits the whole prefix.
    m = BlockManager(64, 4, enable_prefix_caching=True)
    prompt = list(range(100, 113))
    m.add_sequence(1, prompt)
    m.add_sequence(2, prompt)
    for _ in range(3):
        m.step([1, 2], query_lens=[4, 4])
    m.step([1, 2])
    assert m.add_sequence(3, prompt) == 12
    m.free(1)
    m.free(2)
    assert m.add_sequence(4, prompt) == 12
    m.check_invariants()


@pytest.mark.parametrize("token", [-1, -(2**31), 2**31 - 1])
def test_extreme_token_ids_are_cached_and_compared_exactly(token):
    m = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = [token, 0, token, 1, token, token, token, token, 5]
    assert m.add_sequence(1, prompt) == 0
    m.step([1])
    assert m.add_sequence(2, prompt) == 8
    other = list(prompt)
    other[6] = token ^ 1
    assert m.add_sequence(3, other) == 4
    assert m.token_ids(2).tolist() == prompt


@pytest.mark.parametrize("token", [2**31, -(2**31) - 1, 2**63 - 1])
def test_token_ids_outside_int32_are_refused(token):
    m = BlockManager(16, 4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="token_ids"):
        m.add_sequence(1, [1, token])
    assert len(m) == 0


# ---------------------------------------------------------------------------------------
# Extreme integers: capacity queries never overflow, every integer argument is checked
# ---------------------------------------------------------------------------------------
EXTREMES = [2**31 - 1, 2**63 - 1, -1, -(2**31), -(2**63)]
OUTSIDE_INT64 = [2**63, -(2**63) - 1, 2**64]


def test_capacity_queries_do_not_overflow():
    m = BlockManager(16, 16)
    m.add_sequence(1, [1, 2, 3])
    for n in (2**31 - 1, 2**62, 2**63 - 1):
        assert not m.can_append(1, n)
        assert not m.can_allocate(n)
    assert m.can_append(1, 16 * 16 - 3) and not m.can_append(1, 16 * 16 - 2)
    assert m.can_allocate(15 * 16) and not m.can_allocate(15 * 16 + 1)
    for n in (-1, -(2**31), -(2**63)):
        with pytest.raises(ValueError, match=r"can_append: num_tokens = -\d+ must be >= 0"):
            m.can_append(1, n)
        with pytest.raises(ValueError, match=r"can_allocate: num_tokens = -\d+ must be >= 0"):
            m.can_allocate(n)
    for n in OUTSIDE_INT64:
        with pytest.raises(ValueError, match="can_allocate: num_tokens = .* outside the int64 range"):
            m.can_allocate(n)
    m.check_invariants()


def _manager():
    m = BlockManager(16, 4, num_cpu_blocks=4)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.step([1])
    return m


def _state(m):
    return (m.num_free_blocks, m.num_free_cpu_blocks, m.num_pending_copies,
            {i: (m.block_table(i), m.seq_len(i), m.num_computed(i)) for i in m.sequence_ids()})  # fmt: skip


# Each entry: (call taking the value v, outcomes for particular values, the outcome for the
# other int64 extremes). Outside int64, a scalar argument is a TypeError and an element of
# a list argument (seq_ids, query_lens) a ValueError, unless listed. "ok" = a valid value;
# "skip" = valid, but its tables take gigabytes.
SCALAR_ERRORS = {v: TypeError for v in OUTSIDE_INT64}
LIST_ERRORS = {v: ValueError for v in OUTSIDE_INT64}
PAD_OK = {2**31 - 1: "ok", -1: "ok", -(2**31): "ok", **SCALAR_ERRORS}
CALLS = {
    "BlockManager(num_blocks)": (lambda m, v: BlockManager(v, 4), {2**31 - 1: "skip", **SCALAR_ERRORS}, ValueError),
    "BlockManager(block_size)": (lambda m, v: BlockManager(4, v), SCALAR_ERRORS, ValueError),
    "BlockManager(num_cpu_blocks)": (
        lambda m, v: BlockManager(4, 4, num_cpu_blocks=v),
        {2**31 - 1: "skip", **SCALAR_ERRORS},
        ValueError,
    ),
    "BlockManager(sliding_window)": (
        lambda m, v: BlockManager(4, 4, sliding_window=v),
        {2**31 - 1: "ok", 2**63 - 1: "ok", **SCALAR_ERRORS},
        ValueError,
    ),
    "add_sequence(seq_id)": (lambda m, v: (m.add_sequence(v, [1]), m.free(v)), SCALAR_ERRORS, "ok"),
    "add_sequence(extra_key)": (
        lambda m, v: (m.add_sequence(2, [1], extra_key=v), m.free(2)),
        {2**31 - 1: "ok", 2**63 - 1: "ok", 2**63: "ok", -(2**63) - 1: TypeError, 2**64: TypeError},
        TypeError,
    ),
    "append_tokens(seq_id)": (lambda m, v: m.append_tokens(v, [1]), SCALAR_ERRORS, KeyError),
    "append_tokens_batch(seq_ids)": (lambda m, v: m.append_tokens_batch([v], [1]), LIST_ERRORS, KeyError),
    "fork(parent_id)": (lambda m, v: m.fork(v, 2), SCALAR_ERRORS, KeyError),
    "fork(child_id)": (lambda m, v: (m.fork(1, v), m.free(v)), SCALAR_ERRORS, "ok"),
    "free(seq_id)": (lambda m, v: m.free(v), SCALAR_ERRORS, KeyError),
    "step(seq_ids)": (lambda m, v: m.step([v]), LIST_ERRORS, KeyError),
    "step(query_lens)": (lambda m, v: m.step([1], query_lens=[v]), LIST_ERRORS, ValueError),
    "step(max_blocks)": (lambda m, v: m.step([1], max_blocks=v), SCALAR_ERRORS, ValueError),
    "step(pad)": (lambda m, v: m.step([1], pad=v), PAD_OK, TypeError),
    "swap_out(seq_ids)": (lambda m, v: m.swap_out([v]), LIST_ERRORS, KeyError),
    "swap_in(seq_ids)": (lambda m, v: m.swap_in([v]), LIST_ERRORS, KeyError),
    "can_append(seq_id)": (lambda m, v: m.can_append(v), SCALAR_ERRORS, KeyError),
    "can_append_batch(seq_ids)": (lambda m, v: m.can_append_batch([v]), LIST_ERRORS, KeyError),
    "can_swap_out(seq_ids)": (lambda m, v: m.can_swap_out([v]), LIST_ERRORS, KeyError),
    "can_swap_in(seq_ids)": (lambda m, v: m.can_swap_in([v]), LIST_ERRORS, KeyError),
    "block_tables(seq_ids)": (lambda m, v: m.block_tables([v]), LIST_ERRORS, KeyError),
    "block_tables(max_blocks)": (lambda m, v: m.block_tables([1], max_blocks=v), SCALAR_ERRORS, ValueError),
    "block_tables(pad)": (lambda m, v: m.block_tables([1], pad=v), PAD_OK, TypeError),
    "seq_lens(seq_ids)": (lambda m, v: m.seq_lens([v]), LIST_ERRORS, KeyError),
    "csr(seq_ids)": (lambda m, v: m.csr([v]), LIST_ERRORS, KeyError),
    "csr(pad)": (lambda m, v: m.csr([1], pad=v), PAD_OK, TypeError),
    "slots(seq_id)": (lambda m, v: m.slots(v), SCALAR_ERRORS, KeyError),
    "slots(start)": (lambda m, v: m.slots(1, v), SCALAR_ERRORS, IndexError),
    "slots(stop)": (lambda m, v: m.slots(1, 0, v), SCALAR_ERRORS, IndexError),
    "block_table": (lambda m, v: m.block_table(v), SCALAR_ERRORS, KeyError),
    "token_ids": (lambda m, v: m.token_ids(v), SCALAR_ERRORS, KeyError),
    "seq_len": (lambda m, v: m.seq_len(v), SCALAR_ERRORS, KeyError),
    "num_computed": (lambda m, v: m.num_computed(v), SCALAR_ERRORS, KeyError),
    "is_swapped": (lambda m, v: m.is_swapped(v), SCALAR_ERRORS, KeyError),
    "contains": (lambda m, v: v in m, SCALAR_ERRORS, "ok"),
    "ref_count": (lambda m, v: m.ref_count(v), SCALAR_ERRORS, IndexError),
    "cpu_ref_count": (lambda m, v: m.cpu_ref_count(v), SCALAR_ERRORS, IndexError),
    "is_cached": (lambda m, v: m.is_cached(v), SCALAR_ERRORS, IndexError),
    "can_append(num_tokens)": (
        lambda m, v: m.can_append(1, v),
        {2**31 - 1: "ok", 2**63 - 1: "ok", **SCALAR_ERRORS},
        ValueError,
    ),
    "can_allocate(num_tokens)": (
        lambda m, v: m.can_allocate(v),
        {2**31 - 1: "ok", 2**63 - 1: "ok", **{u: ValueError for u in OUTSIDE_INT64}},
        ValueError,
    ),  # fmt: skip
    "add_sequence_by_count(seq_id)": (lambda m, v: (m.add_sequence_by_count(v, 1), m.free(v)), SCALAR_ERRORS, "ok"),
    "add_sequence_by_count(num_tokens)": (
        lambda m, v: m.add_sequence_by_count(2, v),
        {2**31 - 1: OutOfBlocksError, 2**63 - 1: OutOfBlocksError, **SCALAR_ERRORS},
        ValueError,
    ),
    "peek_prefix(extra_key)": (
        lambda m, v: m.peek_prefix([1, 2, 3, 4, 5], extra_key=v),
        {2**31 - 1: "ok", 2**63 - 1: "ok", 2**63: "ok", -(2**63) - 1: TypeError, 2**64: TypeError},
        TypeError,
    ),
    "free_batch(seq_ids)": (lambda m, v: m.free_batch([v]), LIST_ERRORS, KeyError),
    "fork_batch(parent_ids)": (lambda m, v: m.fork_batch([v], [2]), LIST_ERRORS, KeyError),
    "fork_batch(child_ids)": (lambda m, v: (m.fork_batch([1], [v]), m.free(v)), LIST_ERRORS, "ok"),
    "step_into(seq_ids)": (lambda m, v: m.step_into([v]), LIST_ERRORS, KeyError),
    "step_into(query_lens)": (lambda m, v: m.step_into([1], query_lens=[v]), LIST_ERRORS, ValueError),
    "step_into(pad)": (lambda m, v: m.step_into([1], pad=v), PAD_OK, TypeError),
}


@pytest.mark.parametrize("value", EXTREMES + OUTSIDE_INT64)
@pytest.mark.parametrize("name", list(CALLS))
def test_extreme_integers_on_every_integer_argument(name, value):
    call, special, default = CALLS[name]
    outcome = special.get(value, default)
    if outcome == "skip":
        pytest.skip("a valid size whose tables take gigabytes")
    m = _manager()
    before = _state(m)
    if outcome == "ok":
        result = call(m, value)
        if name.startswith("can_"):
            assert result is False  # no pool holds 2^31 - 1 more tokens
    else:
        with pytest.raises(outcome):
            call(m, value)
    if not (name.startswith("step") and outcome == "ok"):  # a valid step may advance the schedule
        assert _state(m) == before
    m.check_invariants()


# ---------------------------------------------------------------------------------------
# Outputs that share memory with the inputs or with each other are refused
# ---------------------------------------------------------------------------------------
OVERLAP = r"output {} overlaps (input|output) {} in memory"


def test_step_with_query_lens_and_slot_mapping_in_one_buffer_is_refused_in_a_subprocess():
    # The reported case: slot_mapping's first writes used to overwrite query_lens while
    # the step was using it, writing far past the array (a crash or silent corruption).
    code = textwrap.dedent(
        """
        import numpy as np, pagedattn
        m = pagedattn.BlockManager(4096, 16)
        m.add_sequence(0, list(range(1000)))
        m.add_sequence(1, list(range(1000)))
        buf = np.zeros(8, np.int64)
        buf[0:2] = [1, 2]
        try:
            m.step([0, 1], query_lens=buf[0:2], slot_mapping=buf[0:3])
            print("accepted", m.num_computed(0), m.num_computed(1))
        except ValueError as e:
            print("ValueError:", e)
        m.check_invariants()
        assert (m.num_computed(0), m.num_computed(1)) == (0, 0)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ValueError: step: output slot_mapping overlaps input query_lens in memory" in r.stdout, r.stdout


def _two_sequences():
    m = BlockManager(64, 4)
    m.add_sequence(0, list(range(10)))
    m.add_sequence(1, list(range(10)))
    return m


@pytest.mark.parametrize(
    "out_name, in_name",
    [("slot_mapping", "query_lens"), ("seq_lens", "token_ids"), ("block_tables", "seq_ids"),
     ("context_lens", "seq_ids"), ("query_start_loc", "query_lens")],
)  # fmt: skip
def test_step_refuses_an_output_overlapping_an_input(out_name, in_name):
    m = _two_sequences()
    before = _state(m)
    buf = np.zeros(64, np.int64)
    ids = np.array([0, 1], np.int64)
    kwargs = {"query_lens": np.array([1, 1], np.int64)}
    token_ids = None
    if in_name == "seq_ids":
        buf[0:2] = ids
        ids = buf[0:2]
    elif in_name == "query_lens":
        buf[0:2] = [1, 1]
        kwargs["query_lens"] = buf[0:2]
    else:  # token_ids: int32, read in place
        token_ids = buf.view(np.int32)[0:2]
        token_ids[:] = [7, 8]
        del kwargs["query_lens"]
    shapes = {"slot_mapping": (2,), "seq_lens": (2,), "context_lens": (2,), "query_start_loc": (3,),
              "block_tables": (2, 8)}  # fmt: skip
    n = int(np.prod(shapes[out_name]))
    if out_name == "slot_mapping":
        out = buf[0:n]
    else:
        out = buf.view(np.int32)[0:n].reshape(shapes[out_name])
    kwargs[out_name] = out
    with pytest.raises(ValueError, match=OVERLAP.format(out_name, in_name)):
        m.step(ids, token_ids, **kwargs)
    assert _state(m) == before
    m.check_invariants()


def test_step_refuses_outputs_overlapping_each_other():
    m = _two_sequences()
    before = _state(m)
    buf = np.zeros(16, np.int32)
    with pytest.raises(ValueError, match=OVERLAP.format("seq_lens", "context_lens")):
        m.step([0, 1], seq_lens=buf[0:2], context_lens=buf[1:3])
    with pytest.raises(ValueError, match=OVERLAP.format("block_tables", "query_start_loc")):
        m.step([0, 1], block_tables=buf[0:6].reshape(2, 3), query_start_loc=buf[5:8])
    assert _state(m) == before
    # Disjoint parts of one buffer are fine.
    md = m.step([0, 1], seq_lens=buf[0:2], context_lens=buf[2:4], query_start_loc=buf[4:7])
    assert md.seq_lens is not None and buf[0:2].tolist() == [10, 10] and buf[4:7].tolist() == [0, 10, 20]
    m.check_invariants()


def test_exports_refuse_an_output_overlapping_seq_ids():
    m = _two_sequences()
    buf = np.zeros(16, np.int64)
    buf[0:2] = [0, 1]
    ids = buf[0:2]
    with pytest.raises(ValueError, match=OVERLAP.format("block_tables", "seq_ids")):
        m.block_tables(ids, out=buf.view(np.int32)[2:8].reshape(2, 3))
    with pytest.raises(ValueError, match=OVERLAP.format("seq_lens", "seq_ids")):
        m.seq_lens(ids, out=buf.view(np.int32)[3:5])
    assert buf[0:2].tolist() == [0, 1]
    # Not overlapping: written.
    assert m.seq_lens(ids, out=buf.view(np.int32)[4:6]).tolist() == [10, 10]
    m.check_invariants()
