"""pagedattn.BlockManager: the Python API, argument handling, errors and exports."""

from __future__ import annotations

import numpy as np
import pytest

pagedattn = pytest.importorskip("pagedattn")
BlockManager = pagedattn.BlockManager


def state(m):
    return (
        m.num_free_blocks,
        m.num_cached_blocks,
        m.num_used_blocks,
        m.num_free_cpu_blocks,
        m.num_pending_copies,
        {i: (m.block_table(i), m.seq_len(i), m.num_computed(i)) for i in m.sequence_ids()},
    )


def test_contract_names_and_basic_flow():
    m = BlockManager(8, 4, enable_prefix_caching=False, num_cpu_blocks=0, watermark=0.0)
    assert m.num_free_blocks == 8 and m.block_size == 4 and m.num_blocks == 8
    assert m.add_sequence(1, [1, 2, 3, 4, 5]) == 0
    assert len(m.block_table(1)) == 2 and isinstance(m.block_table(1), list)
    slots = m.append_tokens(1, [6, 7, 8, 9])
    assert slots.dtype == np.int64 and slots.shape == (4,)
    table = m.block_table(1)
    assert slots.tolist() == [table[p // 4] * 4 + p % 4 for p in range(5, 9)]
    m.step([1])
    m.fork(1, 2)
    assert m.block_table(2) == m.block_table(1) and 2 in m and len(m) == 2
    m.free(1)
    m.free(2)
    assert m.num_free_blocks == 8


@pytest.mark.parametrize(
    "tokens",
    [[1, 2, 3], (1, 2, 3), np.array([1, 2, 3], np.int32), np.array([1, 2, 3], np.int64),
     np.array([1, 9, 2, 9, 3], np.int64)[::2], [np.int64(1), np.int32(2), 3], range(1, 4)],
)
def test_token_ids_accepts_ints(tokens):
    m = BlockManager(4, 4)
    m.add_sequence(0, tokens)
    assert m.token_ids(0).tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "tokens, message",
    [(np.array([1.0, 2.0]), "must hold integers"), ([1, 2.5], r"token_ids\[1\] must be an int"),
     ("abc", "sequence of ints"), (7, "sequence of ints"), (np.array([True]), "must hold integers")],
)
def test_token_ids_wrong_dtype_is_type_error(tokens, message):
    m = BlockManager(4, 4)
    m.add_sequence(0, [1])
    before = state(m)
    with pytest.raises(TypeError, match=message):
        m.append_tokens(0, tokens)
    with pytest.raises(TypeError, match=message):
        m.add_sequence(1, tokens)
    assert state(m) == before


def test_token_ids_out_of_range_and_shape_are_value_errors():
    m = BlockManager(4, 4)
    with pytest.raises(ValueError, match="does not fit"):
        m.add_sequence(0, [2**31])
    with pytest.raises(ValueError, match="1-D"):
        m.add_sequence(0, np.zeros((2, 2), np.int32))
    assert len(m) == 0


def test_sequence_id_errors():
    m = BlockManager(4, 4)
    m.add_sequence(5, [1, 2])
    with pytest.raises(ValueError, match="sequence id 5 already exists"):
        m.add_sequence(5, [1])
    with pytest.raises(KeyError, match="unknown sequence id 6"):
        m.append_tokens(6, [1])
    with pytest.raises(KeyError, match="unknown sequence id 6"):
        m.fork(6, 7)
    m.step([5])
    with pytest.raises(ValueError, match="child sequence id 5 already exists"):
        m.fork(5, 5)
    m.free(5)
    with pytest.raises(KeyError, match="already freed"):
        m.free(5)  # double free
    m.add_sequence(1, [1])
    before = state(m)
    with pytest.raises(ValueError, match="more than once"):
        m.step([1, 1])
    assert state(m) == before


def test_out_of_blocks_is_typed_and_atomic():
    m = BlockManager(4, 2, num_cpu_blocks=1)
    assert issubclass(pagedattn.OutOfBlocksError, RuntimeError)
    m.add_sequence(0, [1, 2, 3])
    before = state(m)
    with pytest.raises(pagedattn.OutOfBlocksError, match="needs 3 new block"):
        m.add_sequence(1, [1] * 6)
    with pytest.raises(pagedattn.OutOfBlocksError):
        m.append_tokens(0, [1] * 6)
    with pytest.raises(pagedattn.OutOfBlocksError, match="CPU block"):
        m.swap_out([0])
    assert state(m) == before
    assert not m.can_allocate(6) and m.can_allocate(4) and m.can_allocate([1, 2, 3, 4])
    assert not m.can_append(0, 6) and m.can_append(0, 5)


def test_watermark():
    m = BlockManager(10, 4, watermark=0.3)
    assert m.watermark_blocks == 3
    assert m.can_allocate(28) and not m.can_allocate(29)
    with pytest.raises(pagedattn.OutOfBlocksError, match="watermark"):
        m.add_sequence(0, [0] * 29)
    m.add_sequence(0, [0] * 28)
    m.append_tokens(0, [0] * 12)  # appends may use the reserve
    assert m.num_free_blocks == 0


def test_invalid_construction():
    for kwargs in (dict(num_blocks=0, block_size=4), dict(num_blocks=4, block_size=0),
                   dict(num_blocks=4, block_size=4, watermark=1.0), dict(num_blocks=4, block_size=4, num_cpu_blocks=-1),
                   dict(num_blocks=4, block_size=4, sliding_window=8, enable_prefix_caching=True)):
        with pytest.raises(ValueError):
            BlockManager(**kwargs)


def test_step_decode_writes_caller_arrays():
    m = BlockManager(64, 4)
    ids = np.arange(5, dtype=np.int64)
    for i in ids.tolist():
        m.add_sequence(i, list(range(3 + 2 * i)))
    m.step(ids)
    bt = np.full((5, 10), -1, np.int32)
    sl = np.zeros(5, np.int32)
    sm = np.zeros(5, np.int64)
    md = m.step(ids, np.full(5, 7, np.int32), block_tables=bt, seq_lens=sl, slot_mapping=sm, pad=-3)
    assert md.block_tables is bt and md.seq_lens is sl and md.slot_mapping is sm
    assert sl.tolist() == [4, 6, 8, 10, 12]
    assert md.context_lens.tolist() == [3, 5, 7, 9, 11]
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5]
    for i in range(5):
        t = m.block_table(i)
        assert bt[i, : len(t)].tolist() == t and (bt[i, len(t):] == -3).all()
        assert sm[i] == m.slots(i, sl[i] - 1, sl[i])[0]
    assert md.copy_pairs.shape == (0, 2)
    # A strided output (a column slice) works too; a too-narrow table is rejected unchanged.
    wide = np.zeros((5, 20), np.int32)
    m.step(ids, np.ones(5, np.int32), block_tables=wide[:, ::2])
    before = state(m)
    with pytest.raises(ValueError, match="block_tables must have shape"):
        m.step(ids, np.ones(5, np.int32), block_tables=np.zeros((5, 2), np.int32))
    with pytest.raises(TypeError, match="int32"):
        m.step(ids, np.ones(5, np.int32), seq_lens=np.zeros(5, np.int64))
    with pytest.raises(ValueError, match="token_ids has 4 entries"):
        m.step(ids, np.ones(4, np.int32))
    assert state(m) == before


def test_step_chunked_prefill_metadata():
    m = BlockManager(64, 4)
    m.add_sequence(0, list(range(484 % 64)))  # 36 tokens
    m.add_sequence(1, list(range(28)))
    md = m.step([1, 0], query_lens=[28, 20])
    assert md.query_start_loc.tolist() == [0, 28, 48]
    assert md.context_lens.tolist() == [0, 0] and md.seq_lens.tolist() == [28, 20]
    assert md.max_query_len == 28 and md.num_tokens == 48
    md = m.step([1, 0], query_lens=[0, 16])
    assert md.context_lens.tolist() == [28, 20] and md.seq_lens.tolist() == [28, 36]
    assert md.slot_mapping.tolist() == m.slots(0, 20, 36).tolist()
    with pytest.raises(ValueError, match=r"query_lens\[0\] = 1"):
        m.step([0], query_lens=[1])


def test_exports_block_tables_seq_lens_csr():
    m = BlockManager(32, 4)
    m.add_sequence(3, list(range(9)))
    m.add_sequence(4, list(range(4)))
    m.add_sequence(5, [])
    bt = m.block_tables([3, 4, 5], pad=-1)
    assert bt.dtype == np.int32 and bt.shape == (3, 3)
    assert bt[1].tolist() == m.block_table(4) + [-1, -1] and bt[2].tolist() == [-1] * 3
    assert m.block_tables([4], max_blocks=6).shape == (1, 6)
    out = np.zeros((2, 4), np.int32)
    assert m.block_tables([3, 4], out=out) is out
    assert m.seq_lens([3, 4, 5]).tolist() == [9, 4, 0]
    indptr, indices, last = m.csr([3, 4, 5])
    assert indptr.tolist() == [0, 3, 4, 4]
    assert indices.tolist() == m.block_table(3) + m.block_table(4)
    assert last.tolist() == [1, 4, 0]


def test_copy_on_write_pairs_and_take():
    m = BlockManager(16, 4)
    m.add_sequence(0, [1, 2, 3, 4, 5, 6])
    m.step([0])
    m.fork(0, 1)
    shared = m.block_table(0)[1]
    slots = m.append_tokens(1, [9])
    assert m.num_pending_copies == 1
    pairs = m.take_copy_pairs()
    assert pairs.dtype == np.int64 and pairs.tolist() == [[shared, m.block_table(1)[1]]]
    assert slots[0] == m.block_table(1)[1] * 4 + 2
    assert m.take_copy_pairs().shape == (0, 2)
    md = m.step([0, 1], [5, 6])  # seq 0 now owns its block: no copy
    assert md.copy_pairs.shape == (0, 2)


def test_prefix_cache_stats_and_extra_key():
    m = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(13))
    assert m.add_sequence(0, prompt) == 0
    m.step([0])
    assert m.add_sequence(1, prompt) == 12
    assert m.add_sequence(2, prompt, extra_key=99) == 0
    s = m.prefix_cache_stats
    assert s["queried_tokens"] == 39 and s["hit_tokens"] == 12 and s["hit_rate"] == pytest.approx(12 / 39)
    m.reset_prefix_cache_stats()
    assert m.prefix_cache_stats["queried_tokens"] == 0
    prefix = m.block_table(0)[:3]
    assert m.block_table(1)[:3] == prefix and all(m.is_cached(b) for b in prefix)
    assert not any(m.is_cached(b) for b in m.block_table(2))  # not computed yet
    m.free(0)
    m.free(1)
    assert m.num_cached_blocks == 3
    assert m.add_sequence(3, prompt) == 12 and m.block_table(3)[:3] == prefix
    assert m.num_free_blocks + m.num_cached_blocks + m.num_used_blocks == 16


def test_swap_out_in_and_free_swapped():
    m = BlockManager(16, 4, num_cpu_blocks=8)
    m.add_sequence(0, list(range(10)))
    m.step([0])
    m.fork(0, 1)
    gpu = m.block_table(0)
    out = m.swap_out([0, 1])
    assert out.tolist() == [[g, c] for g, c in zip(gpu, m.block_table(0))]
    assert m.is_swapped(0) and m.block_table(1) == m.block_table(0)
    assert m.num_used_blocks == 0 and m.num_free_cpu_blocks == 5
    with pytest.raises(ValueError, match="swapped out"):
        m.append_tokens(0, [1])
    with pytest.raises(ValueError, match="swapped out"):
        m.step([0])
    assert m.can_swap_in([0])
    back = m.swap_in([0])
    assert back[:, 0].tolist() == out[:, 1].tolist() and m.block_table(0) == back[:, 1].tolist()
    m.free(1)
    assert m.num_free_cpu_blocks == 8
    with pytest.raises(ValueError, match="no CPU pool"):
        BlockManager(4, 4).swap_out([])


def test_sliding_window_release():
    m = BlockManager(16, 4, sliding_window=4)
    m.add_sequence(0, list(range(16)))
    m.step([0])
    assert m.num_used_blocks == 4
    md = m.step([0], [1], pad=-1)
    # Query at position 16 attends to keys 13..16: blocks 0-2 (tokens 0..11) are released.
    assert m.block_table(0)[:3] == [-1, -1, -1]
    assert md.block_tables[0].tolist()[:3] == [-1, -1, -1]
    assert m.num_used_blocks == 2
    assert m.slots(0, 0, 1).tolist() == [-1]


def test_torch_outputs_if_available():
    torch = pytest.importorskip("torch")
    m = BlockManager(8, 4)
    m.add_sequence(0, torch.tensor([1, 2, 3], dtype=torch.int64))
    bt = torch.zeros((1, 4), dtype=torch.int32)
    md = m.step(torch.tensor([0]), block_tables=bt)
    assert bt[0, 0].item() == m.block_table(0)[0] and md.block_tables is bt


def test_repr_and_metadata_repr():
    m = BlockManager(8, 4)
    m.add_sequence(0, [1])
    assert "BlockManager(num_blocks=8" in repr(m)
    assert "num_tokens=1" in repr(m.step([0]))
