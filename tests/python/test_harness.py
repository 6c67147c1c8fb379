"""The block-manager harness judges the manager by the one Python model of its policy.

The soak (harness/bm_soak.py) and the fuzzer (harness/fuzz.py) replay the manager's calls on
the reference model (harness/reference_block_manager.py). A manager that keeps every
invariant (reference counts, pool accounting, exclusive writes, cache content) but decides
differently from the model, here one that hands a new sequence other free blocks than the
policy says, must still be caught by both.
"""

from __future__ import annotations

import numpy as np
import pytest

pagedattn = pytest.importorskip("pagedattn")
import bm_soak  # noqa: E402
import fuzz  # noqa: E402
from reference_block_manager import ReferenceBlockManager, ReferenceOutOfBlocks  # noqa: E402

BlockManager = pagedattn.BlockManager
PARKED = -99  # an id neither driver uses
FILLER = 10_000  # a token no workload uses


class OtherBlocks:
    """A correct manager with another allocation order: add_sequence first parks a one-block
    sequence, so the new sequence takes the free blocks below the top of the free list."""

    def __init__(self, *a, **kw):
        self._m = BlockManager(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._m, name)

    def __contains__(self, sid):
        return sid in self._m

    def __len__(self):
        return len(self._m)

    def __repr__(self):
        return repr(self._m)

    def add_sequence(self, sid, tokens, extra_key=0):
        park = self._m.num_free_blocks > 1 and PARKED not in self._m
        if park:
            self._m.add_sequence(PARKED, [FILLER])
        try:
            return self._m.add_sequence(sid, tokens, extra_key=extra_key)
        finally:
            if park:
                self._m.free(PARKED)


def test_other_blocks_keeps_the_invariants():
    """The deviation is one of policy only: the manager's own checker finds nothing."""
    m = OtherBlocks(8, 2, num_cpu_blocks=4)
    ref = ReferenceBlockManager(8, 2, num_cpu_blocks=4)
    assert m.add_sequence(1, [1, 2, 3]) == ref.add_sequence(1, [1, 2, 3]) == 0
    m.check_invariants()
    assert m.num_used_blocks == ref.num_used_blocks == 2
    assert ref.block_table(1) == [0, 1]
    assert m.block_table(1) == [1, 2]


def test_soak_catches_a_policy_deviation(monkeypatch):
    monkeypatch.setattr(bm_soak, "BlockManager", OtherBlocks)
    lines = []
    violations, changed, _, _ = bm_soak.run(2000, 3, 500, log=lines.append)
    assert violations > 0, lines
    assert any("block_table" in line and "!= reference" in line for line in lines), lines


def test_fuzzer_catches_a_policy_deviation(monkeypatch):
    monkeypatch.setattr(pagedattn, "BlockManager", OtherBlocks)
    messages = []
    for i in range(150):
        try:
            with np.errstate(all="ignore"):
                fuzz.run_case(fuzz.RandomDraw(777, i), "block_manager")
        except fuzz.Failure as e:
            messages.append(str(e))
    assert len(messages) > 10, messages
    assert any("reference model" in msg for msg in messages), messages


def test_fuzzer_replays_state_changing_calls_on_the_reference(monkeypatch):
    """Unchanged manager: the replay agrees on every case, and it does run."""
    replayed = []

    class Counting(ReferenceBlockManager):
        def add_sequence(self, *a, **kw):
            replayed.append("add_sequence")
            return super().add_sequence(*a, **kw)

    monkeypatch.setattr(fuzz, "ReferenceBlockManager", Counting)
    for i in range(150):
        with np.errstate(all="ignore"):
            assert fuzz.run_case(fuzz.RandomDraw(778, i), "block_manager").kind in ("ok", "error")
    assert len(replayed) > 20


def test_reference_capacity_queries_match_the_manager():
    """The queries the soak predicts with (can_append, can_swap_out, can_swap_in) on a pool
    walked to its edges."""
    kw = dict(num_cpu_blocks=3, watermark=0.25)
    m, ref = BlockManager(8, 2, **kw), ReferenceBlockManager(8, 2, **kw)
    for mgr in (m, ref):
        mgr.add_sequence(1, [1, 2, 3])  # 2 blocks
        mgr.add_sequence(2, [4, 5, 6, 7])  # 2 blocks
        mgr.step([1, 2])
    for n in range(0, 12):
        assert m.can_append(1, n) == ref.can_append(1, n), n
    assert m.can_swap_out([1]) == ref.can_swap_out([1]) is True
    assert m.can_swap_out([1, 2]) == ref.can_swap_out([1, 2]) is False  # 4 blocks, 3 CPU blocks
    for mgr in (m, ref):
        mgr.swap_out([1])
        mgr.add_sequence(3, list(range(100, 106)))  # 3 blocks: 1 free left, watermark 2
    assert m.can_swap_in([1]) == ref.can_swap_in([1]) is False
    with pytest.raises(ReferenceOutOfBlocks):
        ref.swap_in([1])
    with pytest.raises(pagedattn.OutOfBlocksError):
        m.swap_in([1])
    for mgr in (m, ref):
        mgr.free(3)
    assert m.can_swap_in([1]) == ref.can_swap_in([1]) is True
    assert [tuple(p) for p in m.swap_in([1]).tolist()] == ref.swap_in([1])
    assert m.block_table(1) == ref.block_table(1)
    assert (m.num_free_cpu_blocks, m.num_pending_copies, m.num_sequences) == (
        ref.num_free_cpu_blocks, ref.num_pending_copies, ref.num_sequences)
