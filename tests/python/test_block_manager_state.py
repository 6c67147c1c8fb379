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
  * freeing everything returns the pool to full (teardown);
  * step_into into one persistent set of buffers, incremental or full, with rows moving
    between steps, leaves rows [0, S) exactly as the reference's full table and the rest of
    every buffer untouched; peek_prefix predicts add_sequence; the batch calls equal the
    one-by-one calls.
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
        # One set of persistent buffers for every step_into (rows may move between steps).
        self.rows, self.width = 8, 48
        self.bt = np.full((self.rows, self.width), -9, np.int32)
        self.vecs = {k: np.full(n, -9, np.int32) for k, n in
                     (("seq_lens", self.rows), ("context_lens", self.rows), ("query_start_loc", self.rows + 1))}
        self.slots = np.full(64, -9, np.int64)

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

    @precondition(lambda self: self.gpu_ids())
    @rule(data=st.data(), decode=st.booleans(), incremental=st.sampled_from([True, True, True, False]),
          pad=st.sampled_from([0, -1]))
    def persistent_step(self, data, decode, incremental, pad):
        ids = data.draw(st.lists(st.sampled_from(self.gpu_ids()), min_size=0, max_size=self.rows, unique=True))
        kw = {}
        if decode:
            kw["token_ids"] = data.draw(st.lists(st.integers(0, 2), min_size=len(ids), max_size=len(ids)))
        else:
            kw["query_lens"] = [data.draw(st.integers(0, self.m.seq_len(i) - self.m.num_computed(i))) for i in ids]
        add = 1 if decode else 0
        widest = max([-(-(self.m.seq_len(i) + add) // self.bs) for i in ids], default=0)
        tokens = sum(kw["query_lens"]) if not decode else sum(
            self.m.seq_len(i) + 1 - self.m.num_computed(i) for i in ids)
        if widest > self.width or tokens > len(self.slots):
            return  # the buffers are too small for this step (covered by test_block_manager.py)
        before = {k: v.copy() for k, v in self.vecs.items()}
        bt_before, slots_before = self.bt.copy(), self.slots.copy()
        exp, got, failed = self.both_step_into(ids, kw, incremental, pad)
        if failed:
            assert np.array_equal(self.bt, bt_before) and np.array_equal(self.slots, slots_before)
            return
        n, t = len(ids), got.num_tokens
        assert got.block_tables is self.bt
        assert self.bt[:n].tolist() == exp["block_tables"], "incremental table differs from a full rewrite"
        assert np.array_equal(self.bt[n:], bt_before[n:]), "rows past the batch were written"
        for k, v in self.vecs.items():
            m = len(exp[k])
            assert v[:m].tolist() == exp[k], k
            assert np.array_equal(v[m:], before[k][m:]), k
        assert self.slots[:t].tolist() == exp["slot_mapping"]
        assert np.array_equal(self.slots[t:], slots_before[t:])
        assert [tuple(p) for p in got.copy_pairs.tolist()] == exp["copy_pairs"]
        self.check_written_exclusively(self.slots[:t])

    def both_step_into(self, ids, kw, incremental, pad):
        ref_kw = dict(kw)
        toks = ref_kw.pop("token_ids", None)
        ref_exc = cpp_exc = None
        try:
            exp = self.ref.step(ids, toks, max_blocks=self.width, pad=pad, **ref_kw)
        except (ReferenceOutOfBlocks, ValueError, KeyError) as e:
            ref_exc = e
        try:
            got = self.m.step_into(ids, toks, block_tables=self.bt, slot_mapping=self.slots, pad=pad,
                                   incremental=incremental, **ref_kw, **self.vecs)
        except (OutOfBlocksError, ValueError, KeyError) as e:
            cpp_exc = e
        if ref_exc is not None:
            assert cpp_exc is not None and isinstance(cpp_exc, ERRORS[type(ref_exc)]), (ref_exc, cpp_exc)
            return None, None, True
        assert cpp_exc is None, cpp_exc
        return exp, got, False

    @rule(tokens=prompts, extra=st.sampled_from([0, 0, 7]))
    def peek_then_add(self, tokens, extra):
        stats = self.m.prefix_cache_stats
        peek = self.m.peek_prefix(tokens, extra_key=extra)
        assert self.m.prefix_cache_stats == stats  # a peek counts nothing
        exp = self.ref.peek_prefix(tokens, extra_key=extra)
        assert {k: getattr(peek, k) for k in exp} == exp
        assert peek.fits == self.m.can_allocate(tokens, extra_key=extra)
        sid = self.next_id
        self.next_id += 1
        free_before = self.m.num_available_blocks
        _, got, failed = self.both("add_sequence", sid, tokens, extra_key=extra)
        assert failed == (not peek.fits)
        if not failed:
            assert got == peek.cached_tokens
            assert free_before - self.m.num_available_blocks == peek.new_blocks + peek.reused_cached_blocks

    @rule(n=st.integers(0, 9))
    def add_by_count(self, n):
        sid = self.next_id
        self.next_id += 1
        exp, got, failed = self.both("add_sequence_by_count", sid, n)
        if self.caching:
            assert failed  # the ids are needed for the prefix cache
        elif not failed:
            assert got == exp == 0 and self.m.seq_len(sid) == n

    @precondition(lambda self: self.gpu_ids())
    @rule(data=st.data(), k=st.integers(1, 3), one_parent=st.booleans())
    def fork_batch(self, data, k, one_parent):
        children = list(range(self.next_id, self.next_id + k))
        self.next_id += k
        if one_parent:
            parents = data.draw(st.sampled_from(self.gpu_ids()))
        else:
            parents = data.draw(st.lists(st.sampled_from(self.gpu_ids()), min_size=k, max_size=k))
        if data.draw(st.booleans()) and k > 1:
            children[-1] = children[0]  # a repeated child: refused, nothing changes
        self.both("fork_batch", parents, children)

    @precondition(lambda self: self.m.sequence_ids())
    @rule(data=st.data(), repeat=st.booleans())
    def free_batch(self, data, repeat):
        ids = data.draw(st.lists(st.sampled_from(self.m.sequence_ids()), min_size=1, unique=True))
        if repeat:
            ids.append(ids[0])  # refused: nothing is freed
        _, _, failed = self.both("free_batch", ids)
        assert failed == repeat
        assert all((i in self.m) == repeat for i in ids)

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
            toks = self.m.token_ids(sid).tolist()  # caching on: every sequence has its ids
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
