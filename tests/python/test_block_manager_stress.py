"""pagedattn.BlockManager under stress.

  * a seeded soak (harness/bm_soak.py) in a subprocess: zero violations;
  * out of blocks at every point of a request: for each kind of request the availability is
    swept from zero up to exactly what the request needs; every short attempt raises
    OutOfBlocksError and leaves the whole observable state unchanged, and the same request
    succeeds once enough blocks are free;
  * full, drained and refilled: the pool returns to its initial state;
  * threads: one manager per thread is the supported pattern (independent, correct results);
    one manager shared by two threads under an external lock stays consistent.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

pagedattn = pytest.importorskip("pagedattn")
import bm_soak  # noqa: E402

BlockManager = pagedattn.BlockManager
OutOfBlocksError = pagedattn.OutOfBlocksError

FILLER = 10_000  # filler sequences use token ids no workload uses (no accidental prefix hits)


def snapshot(m) -> dict:
    """Everything observable about a manager."""
    ids = sorted(m.sequence_ids())
    return {
        "counts": (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks, m.num_available_blocks,
                   m.num_free_cpu_blocks, m.num_sequences, m.num_pending_copies),
        "stats": dict(m.prefix_cache_stats),
        "seqs": {i: (m.block_table(i), m.token_ids(i).tolist(), m.seq_len(i), m.num_computed(i), m.is_swapped(i))
                 for i in ids},
        "refs": [m.ref_count(b) for b in range(m.num_blocks)],
        "cpu_refs": [m.cpu_ref_count(c) for c in range(m.num_cpu_blocks)],
        "cached": [m.is_cached(b) for b in range(m.num_blocks)],
    }


# ---------------------------------------------------------------------------------------
# (a) soak
# ---------------------------------------------------------------------------------------
def test_soak_subprocess():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, bm_soak.__file__, "--ops", "200000", "--seed", "7",
                        "--check-every", "1000"], capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert r.returncode == 0, r.stdout + r.stderr
    line = re.search(r"^bm_soak: (\d+) ops, seed (\d+): (\d+) invariant violations, (\d+) failed-call state "
                     r"changes \(([\d.]+) s\)$", r.stdout, re.M)
    assert line, r.stdout
    assert line.groups()[:4] == ("200000", "7", "0", "0")
    # the run exercised the paths it is meant to stress
    for cfg in ("cache", "plain", "window"):
        stats = re.search(rf"^bm_soak: \[{cfg}\] (\d+) calls, (\d+) failed as predicted; ok: (.*); events: (.*)$",
                          r.stdout, re.M)
        assert stats, r.stdout
        assert int(stats.group(2)) > 0  # out-of-blocks and invalid calls happened
        events = dict((k, int(v)) for k, v in re.findall(r"(\w+) (\d+)", stats.group(4)))
        assert events["copies"] > 0 and events["swap_pairs"] > 0
        if cfg == "cache":
            assert events["evictions"] > 0 and events["hit_tokens"] > 0
        if cfg == "window":
            assert events["window_releases"] > 0


def test_soak_detects_a_broken_manager(monkeypatch):
    """The soak's checks can fail: a manager whose fork shares nothing must be caught."""
    real_fork = BlockManager.fork

    class Broken:
        """Wraps a manager; fork then append breaks the shadow's copy-on-write expectations."""

        def __init__(self, *a, **kw):
            self._m = BlockManager(*a, **kw)

        def __getattr__(self, name):
            return getattr(self._m, name)

        def __contains__(self, sid):
            return sid in self._m

        def fork(self, parent, child):
            real_fork(self._m, parent, child)
            self._m.append_tokens(child, [0])  # an unannounced extra token

    monkeypatch.setattr(bm_soak, "BlockManager", Broken)
    lines = []
    violations, changed, _, _ = bm_soak.run(3000, 1, 500, log=lines.append)
    assert violations + changed > 0, lines


def test_soak_detects_a_failed_call_that_changes_state(monkeypatch):
    """A failing add_sequence that leaves a trace behind must be counted as a state change."""

    class Leaky:
        def __init__(self, *a, **kw):
            self._m = BlockManager(*a, **kw)

        def __getattr__(self, name):
            return getattr(self._m, name)

        def __contains__(self, sid):
            return sid in self._m

        def add_sequence(self, sid, tokens, extra_key=0):
            try:
                return self._m.add_sequence(sid, tokens, extra_key=extra_key)
            except OutOfBlocksError:
                self._m.reset_prefix_cache_stats()
                self._m.add_sequence(-sid - 1, [])  # an empty sequence: takes no block
                raise

    monkeypatch.setattr(bm_soak, "BlockManager", Leaky)
    lines = []
    violations, changed, _, _ = bm_soak.run(3000, 1, 500, log=lines.append)
    assert changed > 0, lines
    assert any("changed the state" in line for line in lines)


# ---------------------------------------------------------------------------------------
# (b) out of blocks at every point of a request
# ---------------------------------------------------------------------------------------
def occupy(m, sid, k):
    """A filler sequence holding exactly k blocks (taken from the free list first)."""
    if k:
        m.add_sequence(sid, [FILLER + i for i in range(k * m.block_size)])


def sweep(build, request, need, *, check=None):
    """build() -> (m, free_for_request): a fresh manager in the request's initial state.
    Availability for the request is swept over 0..need by occupying blocks with a filler;
    returns the number of failing availabilities (must be exactly need)."""
    _, free0 = build()
    assert free0 >= need, "test setup: not enough blocks for the sweep"
    failures = 0
    for avail in range(need + 1):
        m, _ = build()
        occupy(m, -1, free0 - avail)
        before = snapshot(m)
        if avail < need:
            with pytest.raises(OutOfBlocksError):
                request(m)
            assert snapshot(m) == before, f"failed request changed the state (availability {avail} of {need})"
            m.check_invariants()
            failures += 1
            m.free(-1)  # now enough blocks are free: the very same request succeeds
        result = request(m)
        m.check_invariants()
        if check is not None:
            check(m, result)
    return failures


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("n", [1, 4, 5, 13])
def test_oom_add_sequence_no_hit(caching, n):
    bs = 4

    def build():
        m = BlockManager(12, bs, enable_prefix_caching=caching, num_cpu_blocks=4)
        m.add_sequence(1, [5, 6, 7])
        m.step([1])
        return m, m.num_free_blocks

    def check(m, hits):
        assert hits == 0 and len(m.block_table(2)) == -(-n // bs)

    need = -(-n // bs)
    assert sweep(build, lambda m: m.add_sequence(2, list(range(n))), need, check=check) == need


@pytest.mark.parametrize("prefix_live", [True, False])
def test_oom_add_sequence_with_prefix_hit(prefix_live):
    """A hit on 2 cached blocks; with the prefix holder freed those blocks are evictable and
    must not count as available for the rest of the request."""
    bs = 4
    prefix = list(range(8))
    prompt = prefix + [9, 9, 9, 9, 9, 9, 9]  # 15 tokens: 2 hit blocks + 2 new blocks

    def build():
        m = BlockManager(12, bs, enable_prefix_caching=True, num_cpu_blocks=0)
        m.add_sequence(1, prefix + [1])
        m.step([1])  # registers the two prefix blocks
        if not prefix_live:
            m.free(1)
            assert m.num_cached_blocks == 2
        return m, m.num_free_blocks

    def check(m, hits):
        assert hits == 8
        assert m.block_table(2)[:2] == [0, 1]
        assert m.num_computed(2) == 8

    assert sweep(build, lambda m: m.add_sequence(2, prompt), 2, check=check) == 2


def test_oom_add_sequence_watermark_sweep():
    """The watermark as the squeezing knob: admission fails iff need > available - watermark."""
    for wm_blocks in range(0, 9):
        m = BlockManager(10, 2, watermark=wm_blocks / 10 + 1e-9)
        assert m.watermark_blocks == wm_blocks
        m.add_sequence(1, [1, 2, 3])  # 2 blocks
        before = snapshot(m)
        need = 5
        if need > 8 - wm_blocks:
            assert not m.can_allocate(list(range(9)))
            with pytest.raises(OutOfBlocksError):
                m.add_sequence(2, list(range(9)))
            assert snapshot(m) == before
        else:
            assert m.can_allocate(list(range(9)))
            m.add_sequence(2, list(range(9)))
            assert m.num_used_blocks == 7
        m.check_invariants()


@pytest.mark.parametrize("caching", [False, True])
def test_oom_decode_step_with_copy_on_write(caching):
    """Decode over [P, C1, C2, Q]: P, C1, C2 share a partly filled last block (2 copies on
    write, the last appender writes in place) and Q's last block is full (1 new block)."""
    bs = 4

    def build():
        m = BlockManager(16, bs, enable_prefix_caching=caching, num_cpu_blocks=8)
        m.add_sequence(1, [1, 2, 3, 4, 5, 6])
        m.add_sequence(4, [7, 7, 7, 7, 7, 7, 7, 7])
        m.step([1, 4])
        m.fork(1, 2)
        m.fork(1, 3)
        return m, m.num_free_blocks

    def check(m, md):
        assert md.copy_pairs.shape == (2, 2)
        tables = [m.block_table(i) for i in (1, 2, 3)]
        assert len({t[1] for t in tables}) == 3  # the shared block was split three ways
        assert all(m.ref_count(t[1]) == 1 for t in tables)
        assert [m.seq_len(i) for i in (1, 2, 3, 4)] == [7, 7, 7, 9]

    def request_batch(m):
        return m.append_tokens_batch([1, 2, 3, 4], [11, 12, 13, 14])

    def request(m):
        assert m.can_append_batch([1, 2, 3, 4]) == (m.num_available_blocks >= 3)
        return m.step([1, 2, 3, 4], [11, 12, 13, 14])

    assert sweep(build, request, 3, check=check) == 3
    assert sweep(build, request_batch, 3) == 3


@pytest.mark.parametrize("caching", [False, True])
def test_oom_step_into_leaves_the_persistent_table_and_its_row_state_alone(caching):
    """The same copy-on-write decode as above through step_into with persistent buffers,
    written incrementally: a refused step writes nothing, and the next step (the very same
    one, now served) still ends with every row as a full rewrite would leave it."""
    bs = 4
    buffers = {}

    def build():
        m = BlockManager(16, bs, enable_prefix_caching=caching, num_cpu_blocks=8)
        m.add_sequence(1, [1, 2, 3, 4, 5, 6])
        m.add_sequence(4, [7, 7, 7, 7, 7, 7, 7, 7])
        bt = np.full((6, 5), -7, np.int32)
        m.step_into([4, 1], block_tables=bt, pad=-1)  # the table holds rows for 4 and 1
        m.fork(1, 2)
        m.fork(1, 3)
        buffers["bt"], buffers["slots"] = bt, np.full(8, -7, np.int64)
        buffers["before"] = (bt.copy(), buffers["slots"].copy())
        return m, m.num_free_blocks

    def request(m):
        bt, slots = buffers["bt"], buffers["slots"]
        try:
            return m.step_into([1, 2, 3, 4], [11, 12, 13, 14], block_tables=bt, slot_mapping=slots, pad=-1)
        except OutOfBlocksError:
            assert np.array_equal(bt, buffers["before"][0]) and np.array_equal(slots, buffers["before"][1])
            raise

    def check(m, md):
        bt = buffers["bt"]
        assert md.copy_pairs.shape == (2, 2)
        for row, sid in enumerate((1, 2, 3, 4)):
            table = m.block_table(sid)
            assert bt[row].tolist() == table + [-1] * (5 - len(table)), f"row {row}"
        assert (bt[4:] == -7).all()

    assert sweep(build, request, 3, check=check) == 3


def test_oom_chunked_prefill_after_fork():
    """A prefill chunk appended to a forked sequence (copy-on-write + 2 new blocks), then
    scheduled in two partial steps."""
    bs = 4

    def build():
        m = BlockManager(16, bs, num_cpu_blocks=0)
        m.add_sequence(1, [1, 2, 3, 4, 5])
        m.step([1])
        m.fork(1, 2)
        return m, m.num_free_blocks

    def request(m):
        assert m.can_append(2, 8) == (m.num_available_blocks >= 3)
        slots = m.append_tokens(2, list(range(20, 28)))  # 5 + 8 = 13 tokens: CoW + 2 new blocks
        return slots

    def check(m, slots):
        t = m.block_table(2)
        assert slots.tolist() == [t[p // bs] * bs + p % bs for p in range(5, 13)]
        md1 = m.step([2], query_lens=[3])
        md2 = m.step([2])
        assert md1.copy_pairs.tolist() == [[m.block_table(1)[1], t[1]]]
        assert md1.slot_mapping.tolist() + md2.slot_mapping.tolist() == slots.tolist()
        assert m.num_computed(2) == 13

    assert sweep(build, request, 3, check=check) == 3


@pytest.mark.parametrize("watermark", [0.0, 0.2])
def test_oom_swap_in(watermark):
    """Swapping in a parent and its fork (shared blocks move once): 5 distinct blocks."""
    bs = 4

    def build():
        m = BlockManager(10, bs, num_cpu_blocks=8, watermark=watermark)
        m.add_sequence(1, list(range(10)))
        m.step([1])
        m.fork(1, 2)
        m.append_tokens(2, [99, 99, 99])  # CoW of block 2 for the child
        m.step([2])
        m.swap_out([1, 2])
        assert m.num_free_cpu_blocks == 8 - 5
        return m, m.num_free_blocks - m.watermark_blocks

    def request(m):
        return m.swap_in([1, 2])

    def check(m, pairs):
        assert pairs.shape == (5, 2)
        assert m.block_table(1)[:2] == m.block_table(2)[:2]
        assert m.num_free_cpu_blocks == 8 and not m.is_swapped(1)

    assert sweep(build, request, 5, check=check) == 5


def test_oom_swap_out_cpu_pool():
    """Swap-out fails cleanly when the CPU pool is short by any amount."""
    for cpu in range(0, 5):
        m = BlockManager(10, 4, num_cpu_blocks=max(cpu, 1))
        m.add_sequence(1, list(range(14)))  # 4 blocks
        m.step([1])
        if cpu == 0:
            m.add_sequence(2, [1])
            m.step([2])
            m.swap_out([2])  # the single CPU block is taken
        before = snapshot(m)
        if cpu < 4:
            assert not m.can_swap_out([1])
            with pytest.raises(OutOfBlocksError):
                m.swap_out([1])
            assert snapshot(m) == before
        else:
            assert m.swap_out([1]).shape == (4, 2)
        m.check_invariants()


# ---------------------------------------------------------------------------------------
# (c) full, drained, refilled
# ---------------------------------------------------------------------------------------
def workload(m, rng_seed=3):
    """Adds sequences (shared prefixes, decode steps, a fork) until the pool is full.
    Returns the ids in the order they were added and every returned hit count."""
    rng = random.Random(rng_seed)
    bs = m.block_size
    ids, hits = [], []
    sid = 0
    while True:
        prompt = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randint(0, 8)] + [rng.randint(0, 3) for _ in range(rng.randint(1, 9))]
        if not m.can_allocate(prompt):
            break
        hits.append(m.add_sequence(sid, prompt))
        ids.append(sid)
        m.step([sid])
        for _ in range(rng.randint(0, 3)):
            if not m.can_append_batch([sid]):
                break
            m.step([sid], [rng.randint(0, 3)])
        if len(m.token_ids(sid)) % bs and rng.random() < 0.3:
            m.fork(sid, 1000 + sid)
            ids.append(1000 + sid)
        sid += 1
    # top up: single-block sequences until no block is left
    while m.num_available_blocks:
        prompt = [FILLER + sid]
        hits.append(m.add_sequence(sid, prompt))
        ids.append(sid)
        sid += 1
    return ids, hits


def test_full_drained_refilled_no_caching():
    """Without caching the free list is a stack: draining in reverse allocation order
    restores it exactly, so a refill hands out the very same blocks; any drain order gives
    back the whole pool."""
    m = BlockManager(40, 4, num_cpu_blocks=0)
    initial = snapshot(m)
    ids, hits = workload(m)
    full = snapshot(m)
    assert m.num_free_blocks == 0 and m.num_used_blocks == 40 and not any(hits)
    for sid in reversed(ids):
        m.free(sid)
    assert snapshot(m) == initial
    ids2, hits2 = workload(m)
    assert ids2 == ids and snapshot(m) == full  # same blocks in the same order
    # a scrambled drain still returns the whole pool; the refill is a permutation
    random.Random(5).shuffle(ids2)
    for sid in ids2:
        m.free(sid)
    assert snapshot(m)["counts"] == initial["counts"] and m.can_allocate(40 * 4)
    ids3, _ = workload(m)
    assert ids3 == ids
    after = snapshot(m)
    assert after["counts"] == full["counts"]
    assert set().union(*(m.block_table(i) for i in ids3)) == set(range(40))
    m.check_invariants()


def test_full_drained_refilled_with_caching():
    """With caching the pool fills with used and cached blocks; after a drain every block is
    free or evictable; a refill with the same workload hits the cache; from then on every
    drain / refill cycle is identical (a fixed point) and the full capacity stays usable."""
    nb, bs = 40, 4
    m = BlockManager(nb, bs, enable_prefix_caching=True, num_cpu_blocks=0)
    ids, hits = workload(m)
    # make it completely full with cached blocks too: free half, refill with fresh blocks
    for sid in ids[::2]:
        m.free(sid)
    cached_now = m.num_cached_blocks
    assert cached_now > 0
    extra = []
    while m.num_free_blocks:
        m.add_sequence(5000 + len(extra), [FILLER + 5000 + len(extra)])
        extra.append(5000 + len(extra))
    assert m.num_free_blocks == 0 and m.num_cached_blocks == cached_now
    assert m.num_used_blocks + m.num_cached_blocks == nb
    for sid in ids[1::2] + extra:
        m.free(sid)
    drained = snapshot(m)
    assert m.num_used_blocks == 0 and m.num_sequences == 0
    assert m.num_free_blocks + m.num_cached_blocks == nb
    assert sum(drained["cached"]) == m.num_cached_blocks and not any(drained["refs"])  # all evictable

    # Block ids are not reproduced exactly (reused cached blocks stay where they are, so the
    # free list is permuted); what is guaranteed: from the first warm refill on, every cycle
    # gives the same hits, stats and counts, and the same tables up to a renaming of blocks.
    def canonical(ids_r):
        label = {}
        return [[label.setdefault(b, len(label)) for b in m.block_table(i)] for i in ids_r]

    cycles = []
    for _ in range(4):
        m.reset_prefix_cache_stats()
        ids_r, hits_r = workload(m)
        assert m.num_available_blocks == 0
        full = snapshot(m)
        shape = canonical(ids_r)
        for sid in reversed(ids_r):
            m.free(sid)
        drained_now = snapshot(m)
        cycles.append((ids_r, hits_r, full["counts"], full["stats"], shape, drained_now["counts"],
                       sum(drained_now["cached"])))
        m.check_invariants()
        assert m.num_free_blocks + m.num_cached_blocks == nb and not any(drained_now["refs"])
    assert sum(cycles[0][1]) > sum(hits)  # the refill hits the cache more than the cold fill did
    assert cycles[0] == cycles[1] == cycles[2] == cycles[3]  # fixed point
    # the whole capacity is still there: one sequence takes every block, evicting the cache
    evictable = m.num_cached_blocks
    ev0 = m.prefix_cache_stats["evictions"]
    m.add_sequence(1, [FILLER] * (nb * bs))
    assert m.num_used_blocks == nb and m.prefix_cache_stats["evictions"] - ev0 == evictable
    m.free(1)
    m.check_invariants()


# ---------------------------------------------------------------------------------------
# (d) threads
# ---------------------------------------------------------------------------------------
def _soak_result(seed, ops):
    s = bm_soak.Soak(bm_soak.CONFIGS[0], random.Random(seed))
    for _ in range(ops):
        s.one_op()
    s.audit()
    return snapshot(s.m), s.calls, s.failed_calls


def test_one_manager_per_thread():
    """The supported pattern: each thread drives its own manager. Results are correct (the
    soak's checks pass in every thread) and independent (equal to a sequential run)."""
    seeds, ops = [11, 12, 13, 14], 3000
    expected = {seed: _soak_result(seed, ops) for seed in seeds}
    results, errors = {}, []

    def worker(seed):
        try:
            results[seed] = _soak_result(seed, ops)
        except Exception as e:  # a Violation or anything else: the test fails below
            errors.append((seed, e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == expected


def test_shared_manager_under_external_lock():
    """Two threads share one manager (and its shadow) under a lock: every operation keeps the
    invariants and the final state is consistent."""
    s = bm_soak.Soak(bm_soak.CONFIGS[0], random.Random(21))
    lock = threading.Lock()
    errors, done = [], [0, 0]

    def worker(k, ops):
        try:
            for _ in range(ops):
                with lock:
                    s.one_op()
                    done[k] += 1
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k, 2000)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert done == [2000, 2000]
    s.audit()
    s.drain()
    assert s.m.num_sequences == 0
    assert s.m.num_free_blocks + s.m.num_cached_blocks == s.m.num_blocks
