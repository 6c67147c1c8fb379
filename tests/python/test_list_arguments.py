"""A Python list where an array is expected: refused with the library's own TypeError naming
the argument (never nanobind's dump of the internal signature), or accepted where a list
is natural (block pairs, id and token lists of the block manager)."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn

Q = np.zeros((1, 4, 64), np.float32)
KC = np.zeros((4, 16, 2, 64), np.float32)
BT = np.zeros((1, 1), np.int32)
SL = np.ones(1, np.int32)
ATTENTION = dict(query=Q, key_cache=KC, value_cache=KC, block_tables=BT, seq_lens=SL)
CACHE_WRITE = dict(key=Q[:, :2], value=Q[:, :2], key_cache=KC, value_cache=KC, slot_mapping=np.zeros(1, np.int64))


def _refused(call, name):
    with pytest.raises(TypeError) as e:
        call()
    text = str(e.value)
    assert "incompatible function arguments" not in text, text
    assert text.startswith(f"{name}: expected an array"), text
    assert "got list" in text


@pytest.mark.parametrize("name", list(ATTENTION))
def test_paged_attention_names_a_list_argument(name):
    args = dict(ATTENTION, **{name: np.asarray(ATTENTION[name]).tolist()})
    _refused(lambda: pagedattn.paged_attention(**args), name)
    _refused(lambda: pagedattn.prepare_decode(**args), name)


@pytest.mark.parametrize("name", ["out", "alibi_slopes", "workspace"])
def test_paged_attention_names_a_list_keyword(name):
    _refused(lambda: pagedattn.paged_attention(Q, KC, KC, BT, SL, **{name: [0.5] * 4}), name)


@pytest.mark.parametrize("name", list(CACHE_WRITE))
def test_reshape_and_cache_names_a_list_argument(name):
    args = dict(CACHE_WRITE, **{name: np.asarray(CACHE_WRITE[name]).tolist()})
    _refused(lambda: pagedattn.reshape_and_cache(**args), name)


def test_block_pairs_may_be_lists_and_caches_may_not():
    caches = [np.arange(4 * 8, dtype=np.float32).reshape(4, 8)]
    pagedattn.copy_blocks(caches, [c.copy() for c in caches], [(0, 3)])  # a list of pairs: accepted
    assert np.array_equal(caches[0][3], caches[0][0])
    host = np.zeros_like(caches[0])
    pagedattn.swap_blocks(caches[0], host, [[1, 2]])
    assert np.array_equal(host[2], caches[0][1])
    with pytest.raises(TypeError, match=r"^key_caches\[0\]: expected a writable array"):
        pagedattn.copy_blocks([caches[0].tolist()], caches, [(0, 1)])
    with pytest.raises(TypeError, match=r"^dst: expected one cache array"):
        pagedattn.swap_blocks(caches[0], host.tolist(), [(0, 1)])


def test_block_manager_takes_lists_of_ids_and_tokens_and_names_bad_ones():
    m = pagedattn.BlockManager(16, 16)
    assert m.add_sequence(0, [1, 2, 3]) == 0
    md = m.step([0])
    assert md.seq_lens.tolist() == [3]
    with pytest.raises(TypeError, match=r"^add_sequence: token_ids\[0\] must be an int, got float"):
        m.add_sequence(1, [1.5])
    with pytest.raises(TypeError, match=r"^step: seq_ids must be a sequence of ints or a 1-D integer array, got str"):
        m.step("ab")
