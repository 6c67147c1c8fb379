"""pagedattn.BlockManager: the calls a scheduler builds on.

step_into (persistent buffers filled up to their capacity, block tables written
incrementally), admission from array-likes and by count, peek_prefix, free_batch and
fork_batch. Each is checked against what the one-by-one or full-rewrite calls produce.
"""

from __future__ import annotations

import array

import numpy as np
import pytest
from test_block_manager import state  # the manager's observable state, defined once

pagedattn = pytest.importorskip("pagedattn")
BlockManager = pagedattn.BlockManager
OutOfBlocksError = pagedattn.OutOfBlocksError




def full_rows(m, ids, width, pad):
    """The rows a full rewrite of the batch's block tables holds."""
    rows = []
    for i in ids:
        t = [pad if b < 0 else b for b in m.block_table(i)]
        rows.append(t + [pad] * (width - len(t)))
    return rows


class Buffers:
    """One persistent set of step outputs, larger than any step."""

    def __init__(self, rows=8, width=12, tokens=64):
        self.bt = np.full((rows, width), -7, np.int32)
        self.seq_lens = np.full(rows, -7, np.int32)
        self.context_lens = np.full(rows, -7, np.int32)
        self.query_start_loc = np.full(rows + 1, -7, np.int32)
        self.slot_mapping = np.full(tokens, -7, np.int64)

    def kw(self):
        return dict(
            block_tables=self.bt,
            seq_lens=self.seq_lens,
            context_lens=self.context_lens,
            query_start_loc=self.query_start_loc,
            slot_mapping=self.slot_mapping,
        )


def step_both(m, twin, bufs, ids, tokens=None, pad=-1, incremental=True, **kw):
    """step_into on m, step on its twin: same decisions, same metadata, rows as a full rewrite."""
    before = {k: v.copy() for k, v in bufs.kw().items()}
    got = m.step_into(ids, tokens, pad=pad, incremental=incremental, **bufs.kw(), **kw)
    exp = twin.step(ids, tokens, max_blocks=bufs.bt.shape[1], pad=pad, **kw)
    n, t = len(ids), exp.num_tokens
    assert (got.num_seqs, got.num_tokens, got.max_seq_len) == (exp.num_seqs, exp.num_tokens, exp.max_seq_len)
    assert bufs.bt[:n].tolist() == exp.block_tables.tolist() == full_rows(m, ids, bufs.bt.shape[1], pad)
    assert np.array_equal(bufs.bt[n:], before["block_tables"][n:]), "rows past the batch were written"
    for name, length in (("seq_lens", n), ("context_lens", n), ("query_start_loc", n + 1), ("slot_mapping", t)):
        buf = getattr(bufs, name)
        assert buf[:length].tolist() == getattr(exp, name).tolist(), name
        assert np.array_equal(buf[length:], before[name][length:]), f"{name} written past the step"
    assert got.copy_pairs.tolist() == exp.copy_pairs.tolist()
    assert got.block_tables is bufs.bt and got.slot_mapping is bufs.slot_mapping
    return got


# ---- step_into -------------------------------------------------------------------------
def test_incremental_table_equals_full_rewrite_through_every_kind_of_change():
    kw = dict(num_cpu_blocks=32)
    m, twin = BlockManager(64, 4, **kw), BlockManager(64, 4, **kw)
    bufs = Buffers()
    for mgr in (m, twin):
        for i in range(1, 4):
            mgr.add_sequence(i, list(range(6)))
    step_both(m, twin, bufs, [1, 2, 3])  # prefill
    step_both(m, twin, bufs, [1, 2, 3], [7, 7, 7])  # decode: new blocks only
    for mgr in (m, twin):
        mgr.fork(1, 4)  # copy-on-write on the next append of 1 (its last block is shared)
    got = step_both(m, twin, bufs, [1, 2, 3], [7, 7, 7])
    assert len(got.copy_pairs) == 1
    for mgr in (m, twin):
        mgr.free(2)
    step_both(m, twin, bufs, [4, 3, 1], [8, 8, 8])  # rows move, a new sequence, a freed row reused
    for mgr in (m, twin):
        mgr.swap_out([3])
        mgr.swap_in([3])  # every entry of 3 changes
    step_both(m, twin, bufs, [4, 3, 1], [9, 9, 9])
    step_both(m, twin, bufs, [1], [9])  # a smaller batch: rows 1.. keep what they hold
    step_both(m, twin, bufs, [3, 1], [9, 9], pad=0)  # another pad: every row again
    step_both(m, twin, bufs, [3, 1], [9, 9], incremental=False)
    m.check_invariants()


def test_incremental_table_with_sliding_window_pads_released_entries():
    m, twin = BlockManager(64, 2, sliding_window=3), BlockManager(64, 2, sliding_window=3)
    bufs = Buffers(rows=2, width=16)
    for mgr in (m, twin):
        mgr.add_sequence(1, [1, 2, 3])
        mgr.add_sequence(2, [1])
    step_both(m, twin, bufs, [1, 2])
    for k in range(12):
        step_both(m, twin, bufs, [1, 2] if k % 3 else [2, 1], [k, k])
    assert bufs.bt[0, 0] == -1  # released by the window
    m.check_invariants()


def test_incremental_step_writes_only_what_changed():
    m = BlockManager(64, 4)
    for i in range(3):
        m.add_sequence(i, list(range(5)))
    bt = np.zeros((4, 6), np.int32)
    m.step_into([0, 1, 2], block_tables=bt, pad=-1)
    full = bt.copy()
    bt[:, 0] = 999  # behind the manager's back: entries that do not change
    m.step_into([0, 1, 2], [1, 1, 1], block_tables=bt, pad=-1)
    assert (bt[:3, 0] == 999).all(), "an unchanged entry was written again"
    assert bt[:3, :2].tolist() == [[999, full[i, 1]] for i in range(3)]
    m.reset_incremental_export()  # after writing the table yourself: every row in full
    m.step_into([0, 1, 2], [1, 1, 1], block_tables=bt, pad=-1)
    assert bt[:3].tolist() == full_rows(m, [0, 1, 2], 6, -1)
    bt[:, 0] = 999
    m.step_into([0, 1, 2], [1, 1, 1], block_tables=bt, pad=-1, incremental=False)
    assert bt[:3].tolist() == full_rows(m, [0, 1, 2], 6, -1)
    # A full export into the remembered table makes the manager forget it.
    bt[:, 0] = 999
    m.step_into([0, 1, 2], block_tables=bt, pad=-1)
    m.block_tables([2, 1, 0], out=bt[:3], pad=-1)
    bt[:, 1] = 555
    m.step_into([0, 1, 2], [1, 1, 1], block_tables=bt, pad=-1)
    assert bt[:3].tolist() == full_rows(m, [0, 1, 2], 6, -1)


def test_step_into_without_outputs_only_advances():
    m = BlockManager(16, 4)
    m.add_sequence(1, list(range(6)))
    md = m.step_into([1])
    assert m.num_computed(1) == 6 and md.num_tokens == 6
    assert md.block_tables is None and md.slot_mapping is None and md.copy_pairs.shape == (0, 2)
    md = m.step_into(np.array([1]), np.array([3], np.int32))
    assert m.seq_len(1) == 7 and m.num_computed(1) == 7 and md.max_seq_len == 7


def test_step_into_checks_buffer_sizes_and_types_before_changing_anything():
    m = BlockManager(16, 4)
    m.add_sequence(1, list(range(9)))  # 3 blocks, 9 tokens to compute
    m.add_sequence(2, [1])
    before = state(m)
    cases = [
        (
            dict(block_tables=np.zeros((1, 4), np.int32)),
            ValueError,
            r"block_tables must have shape \[R, M\] with R >= 2",
        ),
        (dict(block_tables=np.zeros((4, 2), np.int32)), ValueError, "M >= 3"),
        (dict(block_tables=np.zeros((4, 4), np.int64)), TypeError, "block_tables must be int32"),
        (dict(seq_lens=np.zeros(1, np.int32)), ValueError, r"seq_lens must have shape \[L\] with L >= 2"),
        (dict(query_start_loc=np.zeros(2, np.int32)), ValueError, "query_start_loc"),
        (dict(slot_mapping=np.zeros(9, np.int64)), ValueError, r"slot_mapping must have shape \[L\] with L >= 10"),
        (dict(context_lens=np.zeros((4, 1), np.int32)), ValueError, "context_lens"),
        (dict(seq_lens=[0, 0, 0]), TypeError, "seq_lens must be a writable"),
        (dict(seq_lens=np.zeros(4, np.float32)), TypeError, "seq_lens must be int32"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            m.step_into([1, 2], **kw)
        assert state(m) == before, kw
    ro = np.zeros((4, 4), np.int32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="block_tables"):
        m.step_into([1, 2], block_tables=ro)
    shared = np.zeros(20, np.int32)
    with pytest.raises(ValueError, match="overlaps"):
        m.step_into([1, 2], seq_lens=shared[:4], context_lens=shared[2:8])
    # Rows that share memory cannot be tracked: refused for incremental writes only.
    rows_alias = np.lib.stride_tricks.as_strided(np.zeros(8, np.int32), shape=(4, 4), strides=(0, 4))
    with pytest.raises(ValueError, match="overlapping rows"):
        m.step_into([1, 2], block_tables=rows_alias)
    assert state(m) == before
    m.step_into([1, 2], block_tables=rows_alias, incremental=False)
    assert m.num_computed(1) == 9


def test_step_into_strided_and_column_major_tables():
    m, twin = BlockManager(32, 4), BlockManager(32, 4)
    for mgr in (m, twin):
        mgr.add_sequence(1, list(range(9)))
        mgr.add_sequence(2, list(range(3)))
    wide = np.full((6, 16), -7, np.int32)
    view = wide[::2, ::2]  # strides (2 * 16, 2) elements
    m.step_into([2, 1], block_tables=view, pad=-1)
    twin.step([2, 1])
    assert view[:2].tolist() == full_rows(twin, [2, 1], 8, -1)
    assert (wide[1::2] == -7).all() and (wide[:, 1::2] == -7).all()
    col = np.asfortranarray(np.full((3, 5), -7, np.int32))
    m.step_into([1, 2], [4, 4], block_tables=col, pad=-1)
    twin.step([1, 2], [4, 4])
    assert col[:2].tolist() == full_rows(twin, [1, 2], 5, -1) and (col[2] == -7).all()


def test_step_into_drains_copy_pairs_like_step():
    m = BlockManager(16, 4)
    m.add_sequence(1, [1, 2])
    m.step([1])
    m.fork(1, 2)
    bt = np.zeros((2, 4), np.int32)
    md = m.step_into([1, 2], [5, 6], block_tables=bt)
    assert md.copy_pairs.tolist() == [[m.block_table(2)[0], m.block_table(1)[0]]]
    assert m.num_pending_copies == 0


# ---- admission -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens",
    [
        array.array("i", [5, 6, 7]),
        array.array("q", [5, 6, 7]),
        memoryview(np.array([5, 6, 7], np.int32)),
        np.array([5, 6, 7], np.int64),
        np.array([5, 9, 6, 9, 7], np.int64)[::2],
        np.array([5, 6, 7], np.uint16),
    ],
)
def test_admission_accepts_array_likes(tokens):
    m = BlockManager(8, 2, enable_prefix_caching=True)
    m.add_sequence(0, tokens)
    assert m.token_ids(0).tolist() == [5, 6, 7]
    m.step([0])
    assert m.peek_prefix(tokens).cached_tokens == 2


@pytest.mark.parametrize("tokens", [np.array([1, 2**31], np.int64), [1, -(2**31) - 1], array.array("q", [2**40])])
def test_token_ids_outside_int32_are_value_errors_naming_the_element(tokens):
    m = BlockManager(8, 2)
    with pytest.raises(ValueError, match=r"token_ids\[\d\].*does not fit"):
        m.add_sequence(0, tokens)
    with pytest.raises(ValueError, match="does not fit"):
        m.peek_prefix(tokens)
    assert len(m) == 0 and m.num_free_blocks == 8


def test_token_list_of_large_and_negative_ints():
    m = BlockManager(8, 4)
    ids = [0, -1, 2**30 - 1, 2**30, -(2**30), -(2**31), 2**31 - 1, np.int64(3), True]
    m.add_sequence(0, ids)
    assert m.token_ids(0).tolist() == [int(v) for v in ids]


def test_add_sequence_by_count_is_add_sequence_without_ids():
    m, twin = BlockManager(16, 4), BlockManager(16, 4)
    assert m.add_sequence_by_count(1, 9) == 0
    twin.add_sequence(1, list(range(9)))
    assert m.block_table(1) == twin.block_table(1) and m.seq_len(1) == 9 and m.num_computed(1) == 0
    with pytest.raises(ValueError, match="admitted by count"):
        m.token_ids(1)
    m.step([1])
    m.fork(1, 2)
    with pytest.raises(ValueError, match="admitted by count"):
        m.token_ids(2)
    m.append_tokens(2, [4])
    assert m.seq_len(2) == 10
    before = state(m)
    with pytest.raises(ValueError, match="already exists"):
        m.add_sequence_by_count(1, 2)
    with pytest.raises(ValueError, match="negative"):
        m.add_sequence_by_count(3, -1)
    with pytest.raises(OutOfBlocksError):
        m.add_sequence_by_count(3, 100)
    with pytest.raises(TypeError):
        m.add_sequence_by_count(3, [1, 2])
    assert state(m) == before
    assert m.add_sequence_by_count(3, 0) == 0 and m.token_ids(3).tolist() == []
    c = BlockManager(16, 4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="prefix caching is on"):
        c.add_sequence_by_count(1, 4)
    assert len(c) == 0
    m.check_invariants()


# ---- peek_prefix -----------------------------------------------------------------------
def test_peek_prefix_predicts_add_sequence_and_changes_nothing():
    def build():
        m = BlockManager(12, 4, enable_prefix_caching=True, watermark=0.1)
        m.add_sequence(0, list(range(13)))
        m.step([0])
        m.free(0)  # 3 registered blocks, evictable
        m.add_sequence(1, list(range(100, 105)))
        m.step([1])
        return m

    m, twin = build(), build()
    stats = m.prefix_cache_stats
    p = m.peek_prefix(list(range(10)))
    assert (p.cached_tokens, p.new_blocks, p.reused_cached_blocks, p.fits) == (8, 1, 2, True)
    assert "cached_tokens=8" in repr(p)
    assert m.peek_prefix(list(range(10)), extra_key=3).cached_tokens == 0
    assert m.peek_prefix([]).new_blocks == 0 and m.peek_prefix(list(range(60))).fits is False
    assert m.prefix_cache_stats == stats and state(m) == state(twin)
    # The LRU order is untouched: the next evictions take the same blocks as in the twin.
    for mgr in (m, twin):
        mgr.add_sequence(5, list(range(200, 220)))
    assert m.block_table(5) == twin.block_table(5)
    avail = m.num_available_blocks
    p = m.peek_prefix(list(range(10)))
    if p.fits:
        assert m.add_sequence(6, list(range(10))) == p.cached_tokens
        assert avail - m.num_available_blocks == p.new_blocks + p.reused_cached_blocks
    else:
        with pytest.raises(OutOfBlocksError):
            m.add_sequence(6, list(range(10)))
    with pytest.raises(TypeError):
        m.peek_prefix(5)


# ---- batch free / fork -----------------------------------------------------------------
def test_free_batch_equals_free_one_by_one_and_is_all_or_nothing():
    def build():
        m = BlockManager(32, 4, enable_prefix_caching=True, num_cpu_blocks=16)
        for i in range(5):
            m.add_sequence(i, [1, 2, 3, 4, 5, i])
        m.step(list(range(5)))
        m.swap_out([3])
        return m

    m, twin = build(), build()
    before = state(m)
    with pytest.raises(KeyError):
        m.free_batch([0, 1, 99])
    with pytest.raises(ValueError, match="more than once"):
        m.free_batch(np.array([0, 1, 0]))
    assert state(m) == before
    m.free_batch([4, 3, 0])  # one swapped out
    for i in (4, 3, 0):
        twin.free(i)
    assert state(m) == state(twin) and m.num_cached_blocks == twin.num_cached_blocks
    # The LRU order matches too: a new prompt evicts the same blocks.
    for mgr in (m, twin):
        mgr.add_sequence(9, list(range(50, 110)))
    assert m.block_table(9) == twin.block_table(9)
    m.free_batch([])
    m.check_invariants()


def test_fork_batch_equals_fork_one_by_one_and_is_all_or_nothing():
    def build():
        m = BlockManager(32, 4)
        m.add_sequence(1, list(range(6)))
        m.add_sequence(2, list(range(3)))
        m.step([1, 2])
        return m

    m, twin = build(), build()
    before = state(m)
    for parents, children, exc in (
        ([1, 2], [10, 10], ValueError),  # repeated child
        ([1, 99], [10, 11], KeyError),  # unknown parent
        ([1, 2], [10, 2], ValueError),  # child exists
        ([1], [10, 11], ValueError),  # lengths differ
    ):
        with pytest.raises(exc):
            m.fork_batch(parents, children)
        assert state(m) == before
    m.add_sequence(3, [1])
    with pytest.raises(ValueError, match="not yet computed"):
        m.fork_batch([1, 3], [10, 11])
    m.free(3)
    m.fork_batch(1, np.array([10, 11]))  # one parent for every child
    m.fork_batch([2, 1], [12, 13])
    for p, c in ((1, 10), (1, 11), (2, 12), (1, 13)):
        twin.fork(p, c)
    assert state(m) == state(twin)
    assert m.ref_count(m.block_table(1)[0]) == 4
    m.check_invariants()


@pytest.mark.parametrize("parent", [2**63, -(2**63) - 1, 2**64])
def test_fork_batch_parent_outside_int64_is_a_typed_error(parent):
    m = pagedattn.BlockManager(8, 4)
    m.add_sequence(0, [1, 2, 3])
    m.step([0])
    with pytest.raises(ValueError, match="parent_ids"):
        m.fork_batch(parent, [1])
    assert m.num_sequences == 1
