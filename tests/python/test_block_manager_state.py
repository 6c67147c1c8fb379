"""Stateful property tests of pagedattn.BlockManager.

A hypothesis RuleBasedStateMachine drives the C++ manager and the pure-Python reference
manager (same policies) with long random operation sequences and checks after every step:
  * both managers agree on every result, error type, block table, slot, copy and swap pair;
  * free + used + cached == num_blocks, and the CPU pool adds up;
  * a block's reference count equals the number of block-table entries holding it;
  * no block is written while shared: every slot handed out lies in a block with one holder;
  * every slot is unique among live tokens (shared slots only for the same computed position
    in a shared block);
  * identical prefixes map to identical blocks when caching is on (never two registered
    blocks with the same prefix, and a new sequence reuses the registered prefix);
  * freeing everything returns the pool to full (teardown).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

pagedattn = pytest.importorskip("pagedattn")
from reference_block_manager import ReferenceBlockManager, ReferenceOutOfBlocks  # noqa: E402

BlockManager = pagedattn.BlockManager
OutOfBlocksError = pagedattn.OutOfBlocksError

ERRORS = {ReferenceOutOfBlocks: OutOfBlocksError, ValueError: ValueError, KeyError: KeyError}

# A few shared "system prompts" over a tiny vocabulary make prefix hits frequent.
SYSTEM = [[1, 2, 1, 0, 2, 2, 1, 0, 1, 1, 2, 0], [2, 2, 2, 1, 0, 0, 1, 2], []]
prompts = st.builds(
    lambda sysp, cut, tail: SYSTEM[sysp][:cut] + tail,
    st.integers(0, len(SYSTEM) - 1),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=10),
)


class BlockManagerMachine(RuleBasedStateMachine):
    caching = False
    window = 0

    @initialize(
        num_blocks=st.integers(6, 40),
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_cpu=st.sampled_from([0, 8, 30]),
        watermark=st.sampled_from([0.0, 0.1]),
    )
    def setup(self, num_blocks, block_size, num_cpu, watermark):
        kw = dict(enable_prefix_caching=self.caching, num_cpu_blocks=num_cpu, watermark=watermark)
        if self.window:
            kw["sliding_window"] = self.window
        self.m = BlockManager(num_blocks, block_size, **kw)
        self.ref = ReferenceBlockManager(num_blocks, block_size, **kw)
        self.bs = block_size
        self.next_id = 0

    # ---- helpers -----------------------------------------------------------------------
    def both(self, name, *args, **kwargs):
        """Runs one operation on both managers; they must agree on result or error type."""
        ref_exc = cpp_exc = None
        try:
            expected = getattr(self.ref, name)(*args, **kwargs)
        except (ReferenceOutOfBlocks, ValueError, KeyError) as e:
            ref_exc = e
        try:
            got = getattr(self.m, name)(*args, **kwargs)
        except (OutOfBlocksError, ValueError, KeyError) as e:
            cpp_exc = e
        if ref_exc is not None:
            assert cpp_exc is not None, f"{name}: reference raised {ref_exc!r}, C++ returned"
            assert isinstance(cpp_exc, ERRORS[type(ref_exc)]), f"{name}: {ref_exc!r} vs {cpp_exc!r}"
            return None, None, True
        assert cpp_exc is None, f"{name}: C++ raised {cpp_exc!r}, reference did not"
        return expected, got, False

    def gpu_ids(self):
        return [i for i in self.m.sequence_ids() if not self.m.is_swapped(i)]

    def swapped_ids(self):
        return [i for i in self.m.sequence_ids() if self.m.is_swapped(i)]

    def check_written_exclusively(self, slots):
        for s in np.asarray(slots).tolist():
            assert self.m.ref_count(s // self.bs) == 1, f"slot {s} handed out in a shared block"

    # ---- rules -------------------------------------------------------------------------
    @rule(tokens=prompts, extra=st.sampled_from([0, 0, 7]))
    def add(self, tokens, extra):
        sid = self.next_id
        self.next_id += 1
        exp, got, failed = self.both("add_sequence", sid, tokens, extra_key=extra)
        if not failed:
            assert got == exp
            assert self.m.num_computed(sid) == got and got % self.bs == 0 and got < max(len(tokens), 1)
            # Reused blocks are exactly the registered blocks of the prefix.
            for b in self.m.block_table(sid)[: got // self.bs]:
                assert self.m.is_cached(b)

    @rule(data=st.data())
    def add_duplicate_or_free_unknown(self, data):
        ids = self.m.sequence_ids()
        if ids:
            sid = data.draw(st.sampled_from(ids))
            self.both("add_sequence", sid, [1])
        self.both("free", 10**9)

    @precondition(lambda self: self.gpu_ids())
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=0, max_size=7))
    def append(self, data, tokens):
        sid = data.draw(st.sampled_from(self.gpu_ids()))
        exp, got, failed = self.both("append_tokens", sid, tokens)
        if not failed:
            assert got.dtype == np.int64 and got.tolist() == exp
            self.check_written_exclusively(got)

    @precondition(lambda self: self.gpu_ids())
    @rule(data=st.data())
    def decode_step(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.gpu_ids()), min_size=1, unique=True))
        toks = data.draw(st.lists(st.integers(0, 2), min_size=len(ids), max_size=len(ids)))
        exp, got, failed = self.both("step", ids, np.array(toks, dtype=np.int32))
        if not failed:
            self.compare_step(exp, got)

    @precondition(lambda self: self.gpu_ids())
    @rule(data=st.data())
    def chunk_step(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.gpu_ids()), min_size=1, unique=True))
        qlens = [data.draw(st.integers(0, self.m.seq_len(i) - self.m.num_computed(i))) for i in ids]
        exp, got, failed = self.both("step", ids, query_lens=qlens)
        assert not failed
        self.compare_step(exp, got)
        assert got.num_tokens == sum(qlens)

    def compare_step(self, exp, got):
        for key in ("block_tables", "seq_lens", "context_lens", "query_start_loc", "slot_mapping"):
            assert getattr(got, key).tolist() == exp[key], key
        assert got.slot_mapping.dtype == np.int64 and got.block_tables.dtype == np.int32
        assert [tuple(p) for p in got.copy_pairs.tolist()] == exp["copy_pairs"]
        self.check_written_exclusively(got.slot_mapping)
        assert len(set(got.slot_mapping.tolist())) == got.num_tokens

    @precondition(lambda self: self.gpu_ids())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.gpu_ids()))
        child = self.next_id
        self.next_id += 1
        _, _, failed = self.both("fork", parent, child)
        if not failed:
            assert self.m.block_table(child) == self.m.block_table(parent)

    @precondition(lambda self: self.m.sequence_ids())
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(self.m.sequence_ids()))
        self.both("free", sid)
        assert sid not in self.m
        self.both("free", sid)  # double free: KeyError from both

    @rule()
    def take_copies(self):
        got = self.m.take_copy_pairs()
        assert [tuple(p) for p in got.tolist()] == self.ref.take_copy_pairs()
        assert got.shape[1] == 2

    @precondition(lambda self: self.gpu_ids())
    @rule(data=st.data())
    def swap_out(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.gpu_ids()), min_size=1, unique=True))
        exp, got, failed = self.both("swap_out", ids)
        if not failed:
            assert [tuple(p) for p in got.tolist()] == exp

    @precondition(lambda self: self.swapped_ids())
    @rule(data=st.data())
    def swap_in(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.swapped_ids()), min_size=1, unique=True))
        exp, got, failed = self.both("swap_in", ids)
        if not failed:
            assert [tuple(p) for p in got.tolist()] == exp

    @precondition(lambda self: self.gpu_ids())
    @rule(data=st.data())
    def capacity_queries(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.gpu_ids()), min_size=1, unique=True))
        assert self.m.can_append_batch(ids) == self.ref.can_append_batch(ids)
        tokens = data.draw(prompts)
        assert self.m.can_allocate(tokens) == self.ref.can_allocate(tokens)

    # ---- invariants --------------------------------------------------------------------
    @invariant()
    def pool_accounting(self):
        m, r = self.m, self.ref
        m.check_invariants()
        assert m.num_free_blocks + m.num_used_blocks + m.num_cached_blocks == m.num_blocks
        assert (m.num_free_blocks, m.num_cached_blocks) == (r.num_free_blocks, r.num_cached_blocks)
        assert m.num_free_cpu_blocks == len(r.cpu_free)
        assert sorted(m.sequence_ids()) == sorted(r.seqs)
        holders = defaultdict(int)
        cpu_holders = defaultdict(int)
        for sid in m.sequence_ids():
            table = m.block_table(sid)
            assert table == r.block_table(sid)
            assert m.seq_len(sid) == r.seq_len(sid) and m.num_computed(sid) == r.num_computed(sid)
            for b in table:
                if b >= 0:
                    (cpu_holders if m.is_swapped(sid) else holders)[b] += 1
        for b in range(m.num_blocks):
            assert m.ref_count(b) == holders[b], f"block {b}"
        for c in range(m.num_cpu_blocks):
            assert m.cpu_ref_count(c) == cpu_holders[c]
        assert m.num_pending_copies == len(r.copies)

    @invariant()
    def slots_unique_among_live_tokens(self):
        owner = {}
        for sid in self.gpu_ids():
            slots = self.m.slots(sid).tolist()
            computed = self.m.num_computed(sid)
            for pos, s in enumerate(slots):
                if s < 0:
                    continue  # released by the sliding window
                if s in owner:
                    other, opos = owner[s]
                    # Only a shared (copy-on-write) block holds a slot twice, and only for the
                    # same, already computed position.
                    assert opos == pos and pos < computed and self.m.ref_count(s // self.bs) > 1, (
                        f"slot {s} held by seq {other}@{opos} and seq {sid}@{pos}"
                    )
                else:
                    owner[s] = (sid, pos)

    @invariant()
    def identical_prefixes_identical_blocks(self):
        if not self.caching:
            return
        seen = {}
        for sid in self.gpu_ids():
            toks = self.m.token_ids(sid).tolist()
            extra = self.ref.seqs[sid].extra
            for j, b in enumerate(self.m.block_table(sid)[: self.m.num_computed(sid) // self.bs]):
                if not self.m.is_cached(b):
                    continue
                key = (extra, tuple(toks[: (j + 1) * self.bs]))
                assert seen.setdefault(key, b) == b, "two registered blocks hold the same prefix"

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for sid in self.m.sequence_ids():
            self.m.free(sid)
        m = self.m
        assert m.num_used_blocks == 0 and len(m) == 0
        assert m.num_free_blocks + m.num_cached_blocks == m.num_blocks
        assert m.num_free_cpu_blocks == m.num_cpu_blocks
        m.check_invariants()


class CachingMachine(BlockManagerMachine):
    caching = True


class WindowMachine(BlockManagerMachine):
    window = 5


_settings = settings(
    max_examples=150, stateful_step_count=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _settings
TestBlockManagerCachingStateful = CachingMachine.TestCase
TestBlockManagerCachingStateful.settings = _settings
TestBlockManagerWindowStateful = WindowMachine.TestCase
TestBlockManagerWindowStateful.settings = _settings
