"""Long seeded soak of pagedattn.BlockManager against the reference model and a model of the KV cache.

    python tests/python/harness/bm_soak.py --ops 5000000 --seed 1 [--check-every 2000]

Several managers with small pools (so that running out of blocks, LRU eviction, swapping and
copy-on-write happen all the time) are driven through random operations: add_sequence with
shared prefixes (each first peeked with peek_prefix), decode steps, chunked prefill steps
(through step, or through step_into into one persistent set of buffers per manager with
incremental block tables), append_tokens(_batch), fork and fork_batch, free and free_batch,
swap_out / swap_in, preemption by recomputation (free + add_sequence), take_copy_pairs,
deliberately invalid calls and an occasional full drain. Configurations: prefix caching on
and off, a sliding window on one, a watermark, with and without a CPU pool.

Every call also runs on the reference block manager (reference_block_manager.py, the one
Python model of the manager's policy), which says what the call must do: succeed, or fail
with which error; which hits, blocks, slots, copy pairs and swap pairs it hands out; what
the pool counts and prefix-cache counters become. Beside it the soak keeps a model of the KV
cache itself, which owes nothing to the policy: the content of every GPU and CPU cache slot,
written by the step's slot mapping, moved by copy-on-write pairs and by swap pairs. The
content of a position is a hash of the whole prefix up to it (and the sequence's extra key),
i.e. what the attention kernel would read. After every call it checks:
  * the call succeeded or failed as on the reference model, with the same error type, and
    the can_* queries agree with it;
  * a failed call (any exception) left the observable state unchanged: tables, lengths,
    token ids, computed cursors, swap flags, every pool count, the prefix-cache stats;
  * results (hits, slots, step metadata, copy and swap pairs), the persistent buffers of
    step_into (the batch's rows equal to the reference's full table, nothing written past the
    step), peek_prefix's prediction of the next add_sequence, the touched sequences'
    lengths, computed cursors, swap flags and tables, every pool count and the prefix-cache
    counters equal the reference model's;
  * every slot handed out (by append or by a step) lies in its table's block, in a block
    held by exactly one sequence, and is unique within the step; a prefix hit reuses blocks
    that hold the prompt's KV; released (sliding-window) blocks lie entirely out of every
    future query's reach; free + used + cached == num_blocks.
Every --check-every operations (and at the end) a full audit runs m.check_invariants() plus:
reference counts == number of table entries holding each block (GPU and CPU), used ==
blocks held, a shared block always at the same table index, every computed token's cache
content equal to the expected prefix hash (so shared and cached blocks hold what their
readers expect), uncomputed tokens only in exclusively held blocks, no two registered
blocks with the same prefix. At the end every sequence is freed and the pool must be whole
(free + cached == num_blocks, all cached blocks evictable, the CPU pool free).

Prints `bm_soak: N ops, seed S: V invariant violations, F failed-call state changes (T s)`
and exits 1 if V or F is non-zero. After a violation the affected manager is rebuilt so the
run continues and counts further problems.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Optional

import numpy as np

import pagedattn
from reference_block_manager import ReferenceBlockManager, ReferenceOutOfBlocks

BlockManager = pagedattn.BlockManager
OutOfBlocksError = pagedattn.OutOfBlocksError

# Pool geometries: small pools so that every capacity path is exercised constantly.
CONFIGS = [
    dict(name="cache", num_blocks=24, block_size=4, enable_prefix_caching=True, num_cpu_blocks=16, watermark=0.05),
    dict(name="plain", num_blocks=20, block_size=2, enable_prefix_caching=False, num_cpu_blocks=12),
    dict(name="window", num_blocks=24, block_size=4, enable_prefix_caching=False, num_cpu_blocks=16,
         sliding_window=6),
    dict(name="cache-bs3-nocpu", num_blocks=32, block_size=3, enable_prefix_caching=True, watermark=0.1),
]

# Shared "system prompts" over a tiny vocabulary make prefix hits (and collisions of
# equal blocks at different positions) frequent.
SYSTEM = [[1, 2, 1, 0, 2, 2, 1, 0, 1, 1, 2, 0, 2, 1, 1, 0], [2, 2, 2, 1, 0, 0, 1, 2, 2, 0], [3] * 12, []]

EXPECTED_ERRORS = (OutOfBlocksError, KeyError, ValueError)
# The reference model's error -> the error the C++ manager must raise for the same call.
SAME_ERROR = {ReferenceOutOfBlocks: OutOfBlocksError, ValueError: ValueError, KeyError: KeyError}
REFERENCE_ERRORS = tuple(SAME_ERROR)


class Violation(Exception):
    """An invariant the manager broke (counted, then the manager is rebuilt)."""


class FailedCallChanged(Violation):
    """A call raised but the manager's observable state changed."""


class _Seq:
    """What the KV-cache model knows of a live sequence: the content each position holds."""

    __slots__ = ("ph", "extra")

    def __init__(self, ph: list, extra: int) -> None:
        self.ph = ph  # ph[p]: hash of (extra, tokens[0..p]) = the KV content of position p
        self.extra = extra


def _prefix_hashes(extra: int, tokens: list, start: Optional[list] = None) -> list:
    ph = [] if start is None else start
    h = ph[-1] if ph else hash((0x5EED, extra))
    for t in tokens[len(ph) :] if start is not None else tokens:
        h = hash((h, t))
        ph.append(h)
    return ph


def _pairs(a) -> list:
    return [tuple(p) for p in a.tolist()]


class Soak:
    """One manager, its reference model and the KV-cache model."""

    def __init__(self, cfg: dict, rng: random.Random) -> None:
        self.cfg = dict(cfg)
        self.name = self.cfg.pop("name")
        self.rng = rng
        self.nb = self.cfg["num_blocks"]
        self.bs = self.cfg["block_size"]
        self.caching = self.cfg.get("enable_prefix_caching", False)
        self.ncpu = self.cfg.get("num_cpu_blocks", 0)
        self.window = self.cfg.get("sliding_window", 0)
        self.failed_calls = 0
        self.calls = 0
        self.done: dict = {}  # successful calls per kind
        self.events = {"copies": 0, "swap_pairs": 0, "evictions": 0, "hit_tokens": 0, "window_releases": 0}
        self.reset()

    def reset(self) -> None:
        kw = {k: v for k, v in self.cfg.items() if k not in ("num_blocks", "block_size")}
        self.m = BlockManager(self.nb, self.bs, **kw)
        self.ref = ReferenceBlockManager(self.nb, self.bs, **kw)
        self.wm = self.m.watermark_blocks
        if self.wm != self.ref.watermark_blocks:
            self.bad(f"watermark_blocks {self.wm} != {self.ref.watermark_blocks}")
        self.seqs: dict = {}
        self.ids: list = []  # live ids (GPU and swapped), for random choice
        self.gpu = [[None] * self.bs for _ in range(self.nb)]
        self.cpu = [[None] * self.bs for _ in range(self.ncpu)]
        self.next_id = 1
        # Persistent step_into buffers, sized for the largest batch (pick_batch: 6) and kept
        # across steps so that the incremental block tables see rows move and change.
        self.rows, self.width, self.max_tokens = 6, 48, 256
        self.buf = {
            "block_tables": np.full((self.rows, self.width), -9, np.int32),
            "seq_lens": np.full(self.rows, -9, np.int32),
            "context_lens": np.full(self.rows, -9, np.int32),
            "query_start_loc": np.full(self.rows + 1, -9, np.int32),
            "slot_mapping": np.full(self.max_tokens, -9, np.int64),
        }

    # ---- helpers -----------------------------------------------------------------------
    @staticmethod
    def counts(m) -> tuple:
        return (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks, m.num_free_cpu_blocks, m.num_sequences,
                m.num_pending_copies)

    def bad(self, msg: str) -> None:
        raise Violation(f"[{self.name}] {msg}")

    def check_stats(self) -> None:
        st = self.m.prefix_cache_stats
        got = {k: st[k] for k in ("queried_tokens", "hit_tokens", "evictions")}
        if got != self.ref.prefix_cache_stats:
            self.bad(f"prefix_cache_stats {got} != reference {self.ref.prefix_cache_stats}")

    def check_seq(self, sid: int) -> None:
        m, r = self.m, self.ref
        for what in ("seq_len", "num_computed", "is_swapped", "block_table"):
            got, want = getattr(m, what)(sid), getattr(r, what)(sid)
            if got != want:
                self.bad(f"seq {sid}: {what} {got} != reference {want}")

    def unchanged(self, before: tuple, what: str, err: BaseException) -> None:
        """After a failed call: the observable state must be exactly as before (the reference
        model, which refused the call too, holds it)."""
        m = self.m
        try:
            now = self.counts(m)
            if now != before:
                raise FailedCallChanged(f"counts {before} -> {now}")
            self.check_stats()
            if sorted(m.sequence_ids()) != sorted(self.ids):
                raise FailedCallChanged("sequence ids changed")
            for sid in self.ids:
                self.check_seq(sid)
                if m.token_ids(sid).tolist() != self.ref.token_ids(sid):
                    raise FailedCallChanged(f"seq {sid}: token ids changed")
        except FailedCallChanged as e:
            raise FailedCallChanged(f"[{self.name}] {what} raised {err!r} and changed the state: {e}") from None
        except Violation as e:
            raise FailedCallChanged(f"{what} raised {err!r} and changed the state: {e}") from None

    def call(self, what: str, name: str, *args, ref_call=None, **kwargs) -> tuple:
        """Runs one call on the reference model, then on the manager: both succeed, or both fail
        with the same error type. Returns (ok, the manager's result or error, the model's).
        ref_call: the reference's side, when it is not the same call (step_into)."""
        self.calls += 1
        m, ref = self.m, self.ref
        before = self.counts(m)
        if before[0] + before[1] + before[2] != self.nb:
            self.bad(f"free + cached + used = {before[:3]} != {self.nb}")
        evictions = ref.evictions
        try:
            expected = ref_call() if ref_call is not None else getattr(ref, name)(*args, **kwargs)
        except REFERENCE_ERRORS as e:
            expected = e
        try:
            r = getattr(m, name)(*args, **kwargs)
        except EXPECTED_ERRORS as e:
            self.failed_calls += 1
            if not isinstance(expected, REFERENCE_ERRORS):
                self.bad(f"{what}: raised {e!r}, the reference model succeeded")
            if not isinstance(e, SAME_ERROR[type(expected)]):
                self.bad(f"{what}: raised {e!r}, the reference model raised {expected!r}")
            self.unchanged(before, what, e)
            return False, e, expected
        if isinstance(expected, REFERENCE_ERRORS):
            self.bad(f"{what}: succeeded, the reference model raised {expected!r}")
        after, want = self.counts(m), self.counts(ref)
        if after != want:
            self.bad(f"{what}: counts (free, cached, used, free cpu, seqs, pending copies) {after} != reference {want}")
        self.check_stats()
        self.events["evictions"] += ref.evictions - evictions
        key = what.split("(", 1)[0]
        self.done[key] = self.done.get(key, 0) + 1
        return True, r, expected

    def expect_error(self, what: str, err_type, name: str, *args, **kwargs) -> None:
        """A call that must fail with err_type (on both) and change nothing."""
        ok, e, _ = self.call(what, name, *args, **kwargs)
        if ok or not isinstance(e, err_type):
            self.bad(f"{what}: {'succeeded' if ok else f'raised {e!r}'}, expected {err_type.__name__}")

    def gpu_ids(self, pred=None) -> list:
        r = self.ref
        return [i for i in self.ids if not r.is_swapped(i) and (pred is None or pred(i))]

    def uncomputed(self, sid: int) -> bool:
        return self.ref.num_computed(sid) < self.ref.seq_len(sid)

    def avail(self) -> int:
        return self.m.num_available_blocks

    def extend_content(self, sid: int) -> None:
        """The sequence got tokens: extend the content its positions will hold."""
        s = self.seqs[sid]
        _prefix_hashes(s.extra, self.ref.token_ids(sid), s.ph)

    def registry(self) -> dict:
        """Prefix hash of each registered block -> block (from the cache content model)."""
        m, reg = self.m, {}
        for b in range(self.nb):
            if m.is_cached(b):
                key = self.gpu[b][-1]
                if key is None:
                    self.bad(f"registered block {b} holds no computed content")
                if key in reg:
                    self.bad(f"blocks {reg[key]} and {b} are both registered for the same prefix")
                reg[key] = b
        return reg

    def write_slots(self, sid: int, start: int, slots) -> None:
        """A step computes positions [start, start + len(slots)): write their cache content."""
        bs, m, tbl, ph = self.bs, self.m, self.m.block_table(sid), self.seqs[sid].ph
        last_b = -1
        for k, slot in enumerate(slots):
            pos = start + k
            b, off = divmod(int(slot), bs)
            if tbl[pos // bs] != b or off != pos % bs:
                self.bad(f"slot {slot} of position {pos} is not in table entry {tbl[pos // bs]}")
            if b != last_b:
                if m.ref_count(b) != 1:
                    self.bad(f"slot {slot} handed out in block {b} with ref count {m.ref_count(b)}")
                last_b = b
            self.gpu[b][off] = ph[pos]

    def check_new_slots(self, sid: int, start: int, slots, expected: list) -> None:
        if slots.tolist() != expected:
            self.bad(f"seq {sid}: slots {slots.tolist()} != reference {expected}")
        bs, m, tbl = self.bs, self.m, self.m.block_table(sid)
        for k, slot in enumerate(expected):
            pos = start + k
            b = tbl[pos // bs]
            if slot != b * bs + pos % bs:
                self.bad(f"append slot {slot} of position {pos} != table block {b}")
            if m.ref_count(b) != 1:
                self.bad(f"append slot {slot} lies in shared block {b} (ref {m.ref_count(b)})")

    def apply_copies(self, pairs) -> None:
        self.events["copies"] += len(pairs)
        for src, dst in pairs:
            if src == dst:
                self.bad(f"copy pair ({src}, {dst})")
            self.gpu[dst] = self.gpu[src][:]

    # ---- operations --------------------------------------------------------------------
    def prompt(self) -> list:
        rng = self.rng
        sysp = rng.choice(SYSTEM)
        p = sysp[: rng.randint(0, len(sysp))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 2 * self.bs + 2))]
        return p

    def op_add(self, tokens: Optional[list] = None, extra: Optional[int] = None) -> Optional[int]:
        rng, m, bs = self.rng, self.m, self.bs
        if tokens is None:
            tokens = self.prompt()
        if extra is None:
            extra = rng.choice((0, 0, 0, 1)) if self.caching else 0
        n = len(tokens)
        predicted = self.ref.can_allocate(tokens, extra_key=extra)
        if m.can_allocate(tokens, extra_key=extra) != predicted:
            self.bad(f"can_allocate({n} tokens) != reference {predicted}")
        peek = m.peek_prefix(tokens, extra_key=extra)
        want = self.ref.peek_prefix(tokens, extra_key=extra)
        if {k: getattr(peek, k) for k in want} != want:
            self.bad(f"peek_prefix({n} tokens) {peek!r} != reference {want}")
        avail = m.num_available_blocks
        sid = self.next_id
        self.next_id += 1
        ok, hits, expected = self.call(f"add_sequence({sid}, n={n})", "add_sequence", sid, tokens, extra_key=extra)
        if not ok:
            if not isinstance(hits, OutOfBlocksError):
                self.bad(f"add_sequence raised {hits!r}")
            return None
        if hits != expected:
            self.bad(f"add_sequence({n} tokens) hit {hits} tokens, reference {expected}")
        if hits != peek.cached_tokens or avail - m.num_available_blocks != peek.new_blocks + peek.reused_cached_blocks:
            self.bad(f"add_sequence({n} tokens) hit {hits} and took {avail - m.num_available_blocks} blocks; "
                     f"peek_prefix said {peek!r}")
        ph = _prefix_hashes(extra, tokens)
        self.seqs[sid] = _Seq(ph, extra)
        self.ids.append(sid)
        self.check_seq(sid)
        table = m.block_table(sid)
        for pos in range(hits):  # a hit reuses blocks that hold exactly this prompt's KV
            b = table[pos // bs]
            if self.gpu[b][pos % bs] != ph[pos]:
                self.bad(f"add_sequence: prefix hit block {b} does not hold position {pos} of the prompt")
        for b in table[hits // bs :]:
            if m.ref_count(b) != 1:
                self.bad(f"fresh block {b} has ref count {m.ref_count(b)}")
        self.events["hit_tokens"] += hits
        return sid

    def op_free(self, sid: Optional[int] = None) -> None:
        if sid is None:
            if not self.ids:
                return
            sid = self.rng.choice(self.ids)
        ok, e, _ = self.call(f"free({sid})", "free", sid)
        if not ok:
            self.bad(f"free({sid}) of a live sequence raised {e!r}")
        del self.seqs[sid]
        self.ids.remove(sid)
        if sid in self.m:
            self.bad(f"freed sequence {sid} still present")

    def op_free_batch(self) -> None:
        if not self.ids:
            return
        batch = self.rng.sample(self.ids, self.rng.randint(1, min(len(self.ids), 4)))
        ok, e, _ = self.call(f"free_batch({batch})", "free_batch", batch)
        if not ok:
            self.bad(f"free_batch({batch}) of live sequences raised {e!r}")
        for sid in batch:
            del self.seqs[sid]
            self.ids.remove(sid)
            if sid in self.m:
                self.bad(f"freed sequence {sid} still present")

    def op_fork_batch(self) -> None:
        ids = self.gpu_ids(lambda i: not self.uncomputed(i))
        if not ids:
            return
        k = self.rng.randint(1, 3)
        parents = [self.rng.choice(ids) for _ in range(k)]
        children = list(range(self.next_id, self.next_id + k))
        self.next_id += k
        ok, e, _ = self.call(f"fork_batch({parents}, {children})", "fork_batch", parents, children)
        if not ok:
            self.bad(f"fork_batch of computed sequences raised {e!r}")
        for pid, cid in zip(parents, children):
            p = self.seqs[pid]
            self.seqs[cid] = _Seq(list(p.ph), p.extra)
            self.ids.append(cid)
            self.check_seq(cid)

    def op_preempt(self) -> None:
        """Preemption by recomputation: free, then add again with the tokens so far."""
        ids = self.gpu_ids()
        if not ids:
            return
        sid = self.rng.choice(ids)
        tokens, extra = self.ref.token_ids(sid), self.seqs[sid].extra
        self.op_free(sid)
        self.op_add(tokens, extra)

    def op_fork(self) -> None:
        ids = self.gpu_ids(lambda i: not self.uncomputed(i))
        if not ids:
            return
        pid = self.rng.choice(ids)
        cid = self.next_id
        self.next_id += 1
        ok, e, _ = self.call(f"fork({pid}, {cid})", "fork", pid, cid)
        if not ok:
            self.bad(f"fork({pid}, {cid}) of a computed sequence raised {e!r}")
        p = self.seqs[pid]
        self.seqs[cid] = _Seq(list(p.ph), p.extra)
        self.ids.append(cid)
        self.check_seq(cid)

    def op_append(self) -> None:
        ids = self.gpu_ids()
        if not ids:
            return
        rng, m, bs = self.rng, self.m, self.bs
        sid = rng.choice(ids)
        n = rng.choice((1, 1, 2, bs, 2 * bs + 1, 0))
        toks = [rng.randint(0, 3) for _ in range(n)]
        length = self.ref.seq_len(sid)
        predicted = self.ref.can_append(sid, n)
        if m.can_append(sid, n) != predicted:
            self.bad(f"can_append({sid}, {n}) != reference {predicted}")
        ok, slots, expected = self.call(f"append_tokens({sid}, n={n})", "append_tokens", sid, toks)
        if not ok:
            return
        self.extend_content(sid)
        self.check_seq(sid)
        self.check_new_slots(sid, length, slots, expected)

    def pick_batch(self, ids: list) -> list:
        rng = self.rng
        return rng.sample(ids, rng.randint(1, min(len(ids), 6)))

    def op_append_batch(self) -> None:
        ids = self.gpu_ids()
        if not ids:
            return
        rng, m = self.rng, self.m
        batch = self.pick_batch(ids)
        toks = [rng.randint(0, 3) for _ in batch]
        predicted = self.ref.can_append_batch(batch)
        if m.can_append_batch(batch) != predicted:
            self.bad(f"can_append_batch != reference {predicted}")
        ok, slots, expected = self.call(f"append_tokens_batch({batch})", "append_tokens_batch", batch, toks)
        if not ok:
            return
        for i, sid in enumerate(batch):
            self.extend_content(sid)
            self.check_seq(sid)
            self.check_new_slots(sid, self.ref.seq_len(sid) - 1, slots[i : i + 1], expected[i : i + 1])

    def op_step(self, decode: bool, into: bool = False) -> None:
        """A step through step(), or (into) through step_into with the persistent buffers."""
        rng, m, r = self.rng, self.m, self.ref
        ids = self.gpu_ids() if decode else self.gpu_ids(self.uncomputed)
        if not ids:
            return
        batch = self.pick_batch(ids)
        new = [rng.randint(0, 3) for _ in batch] if decode else None
        add = 1 if decode else 0
        qlens = None
        if rng.random() < 0.4:
            qlens = [rng.randint(0, r.seq_len(i) + add - r.num_computed(i)) for i in batch]
        if decode and m.can_append_batch(batch) != r.can_append_batch(batch):
            self.bad(f"can_append_batch != reference {r.can_append_batch(batch)}")
        ctx = {i: r.num_computed(i) for i in batch}
        released = {i: r.block_table(i).count(-1) for i in batch}
        widest = max(-(-(r.seq_len(i) + add) // self.bs) for i in batch)
        tokens = sum(qlens) if qlens is not None else sum(r.seq_len(i) + add - r.num_computed(i) for i in batch)
        into = into and widest <= self.width and tokens <= self.max_tokens
        if into:
            pad = -1 if rng.random() < 0.95 else 0
            incremental = rng.random() < 0.9
            before = {k: v.copy() for k, v in self.buf.items()}
            ok, md, expected = self.call(
                f"step_into({batch}, decode={decode}, incremental={incremental})", "step_into", batch, new,
                query_lens=qlens, pad=pad, incremental=incremental, **self.buf,
                ref_call=lambda: r.step(batch, new, query_lens=qlens, max_blocks=self.width, pad=pad),
            )
            if not ok:
                for k, v in self.buf.items():
                    if not np.array_equal(v, before[k]):
                        self.bad(f"a refused step_into wrote {k}")
                return
            for key, buf in self.buf.items():
                n = len(expected[key])
                if buf[:n].tolist() != expected[key]:
                    self.bad(f"step_into {key} {buf[:n].tolist()} != reference {expected[key]}")
                if not np.array_equal(buf[n:], before[key][n:]):
                    self.bad(f"step_into wrote {key} past the step ({n} entries)")
        else:
            ok, md, expected = self.call(f"step({batch}, decode={decode})", "step", batch, new, query_lens=qlens)
            if not ok:
                return
            for key in ("block_tables", "seq_lens", "context_lens", "query_start_loc", "slot_mapping"):
                if getattr(md, key).tolist() != expected[key]:
                    self.bad(f"step {key} {getattr(md, key).tolist()} != reference {expected[key]}")
        copies = _pairs(md.copy_pairs)
        if copies != expected["copy_pairs"]:
            self.bad(f"step copy pairs {copies} != reference {expected['copy_pairs']}")
        self.apply_copies(copies)
        slot_mapping = expected["slot_mapping"]
        if len(set(slot_mapping)) != len(slot_mapping) or md.num_tokens != len(slot_mapping):
            self.bad(f"step: duplicate slots {slot_mapping} or num_tokens {md.num_tokens}")
        qsl = expected["query_start_loc"]
        for i, sid in enumerate(batch):
            if decode:
                self.extend_content(sid)
            self.check_seq(sid)
            self.write_slots(sid, ctx[sid], slot_mapping[qsl[i] : qsl[i + 1]])
            if self.window:
                self.events["window_releases"] += r.block_table(sid).count(-1) - released[sid]
                self.check_window(sid)

    def check_window(self, sid: int) -> None:
        """Released blocks lie entirely out of reach of the next query."""
        w, bs = self.window, self.bs
        reach = self.ref.num_computed(sid) - w + 1  # oldest key position the next query can attend to
        for j, b in enumerate(self.m.block_table(sid)):
            if b < 0 and (j + 1) * bs - 1 >= reach:
                self.bad(f"window released block {j} still in reach (num_computed {reach + w - 1}, window {w})")

    def op_take_copies(self) -> None:
        ok, pairs, expected = self.call("take_copy_pairs", "take_copy_pairs")
        if not ok:
            self.bad(f"take_copy_pairs raised {pairs!r}")
        pairs = _pairs(pairs)
        if pairs != expected:
            self.bad(f"take_copy_pairs {pairs} != reference {expected}")
        self.apply_copies(pairs)

    def op_swap_out(self) -> None:
        ids = self.gpu_ids()
        if not ids:
            return
        m = self.m
        batch = self.pick_batch(ids)
        predicted = self.ref.can_swap_out(batch)
        if m.can_swap_out(batch) != predicted:
            self.bad(f"can_swap_out != reference {predicted}")
        ok, pairs, expected = self.call(f"swap_out({batch})", "swap_out", batch)
        if not ok:
            return
        pairs = _pairs(pairs)
        if pairs != expected:
            self.bad(f"swap_out pairs {pairs} != reference {expected}")
        for g, c in pairs:
            self.cpu[c] = self.gpu[g][:]
        self.events["swap_pairs"] += len(pairs)
        for sid in batch:
            self.check_seq(sid)

    def op_swap_in(self) -> None:
        ids = [i for i in self.ids if self.ref.is_swapped(i)]
        if not ids:
            return
        m = self.m
        batch = self.pick_batch(ids)
        if not m.num_pending_copies and m.can_swap_in(batch) != self.ref.can_swap_in(batch):
            self.bad(f"can_swap_in != reference {self.ref.can_swap_in(batch)}")
        ok, pairs, expected = self.call(f"swap_in({batch})", "swap_in", batch)
        if not ok:
            return
        pairs = _pairs(pairs)
        if pairs != expected:
            self.bad(f"swap_in pairs {pairs} != reference {expected}")
        for c, g in pairs:
            self.gpu[g] = self.cpu[c][:]
        for sid in batch:
            self.check_seq(sid)

    def op_invalid(self) -> None:
        """A call that must fail with a typed error and change nothing."""
        rng, r = self.rng, self.ref
        k = rng.randrange(6)
        if k == 0:
            self.expect_error("free(unknown)", KeyError, "free", -12345)
        elif k == 1 and self.ids:
            sid = rng.choice(self.ids)
            self.expect_error(f"add_sequence(duplicate {sid})", ValueError, "add_sequence", sid, [1, 2, 3])
        elif k == 2:
            ids = self.gpu_ids(self.uncomputed)
            if ids:
                self.expect_error("fork(uncomputed parent)", ValueError, "fork", ids[0], self.next_id)
        elif k == 3:
            ids = self.gpu_ids()
            if ids:
                too_long = r.seq_len(ids[0]) - r.num_computed(ids[0]) + 1
                self.expect_error("step(query too long)", ValueError, "step", [ids[0]], query_lens=[too_long])
        elif k == 4:
            ids = self.gpu_ids()
            if len(ids) >= 1:
                self.expect_error("step(duplicate ids)", ValueError, "step", [ids[0], ids[0]], [1, 1])
        else:
            ids = [i for i in self.ids if r.is_swapped(i)]
            if ids:
                self.expect_error("append to swapped", ValueError, "append_tokens", ids[0], [1])
                self.expect_error("step on swapped", ValueError, "step", [ids[0]])

    # ---- audits ------------------------------------------------------------------------
    def audit(self) -> None:
        m, r, bs = self.m, self.ref, self.bs
        try:
            m.check_invariants()
        except RuntimeError as e:
            self.bad(f"check_invariants: {e}")
        if m.num_pending_copies:
            self.op_take_copies()  # the caller's copy_blocks before reading the cache
        if sorted(m.sequence_ids()) != sorted(self.ids) or m.num_sequences != len(self.ids):
            self.bad("sequence ids differ from the soak's")
        if self.counts(m) != self.counts(r):
            self.bad(f"counts {self.counts(m)} != reference {self.counts(r)}")
        holders = [0] * self.nb
        cpu_holders = [0] * self.ncpu
        index_of: dict = {}
        for sid in self.ids:
            s = self.seqs[sid]
            self.check_seq(sid)
            if m.token_ids(sid).tolist() != r.token_ids(sid):
                self.bad(f"seq {sid}: token ids differ")
            table, swapped = m.block_table(sid), m.is_swapped(sid)
            for j, b in enumerate(table):
                if b < 0:
                    continue
                if swapped:
                    cpu_holders[b] += 1
                    continue
                holders[b] += 1
                if index_of.setdefault(b, j) != j:
                    self.bad(f"block {b} at table index {j} of seq {sid} and index {index_of[b]} elsewhere")
            pool = self.cpu if swapped else self.gpu
            for pos in range(m.num_computed(sid)):
                b = table[pos // bs]
                if b >= 0 and pool[b][pos % bs] != s.ph[pos]:
                    self.bad(f"seq {sid} position {pos}: cache content of block {b} is not its token's KV")
        for b in range(self.nb):
            if m.ref_count(b) != holders[b]:
                self.bad(f"block {b}: ref count {m.ref_count(b)}, held {holders[b]} times")
        for c in range(self.ncpu):
            if m.cpu_ref_count(c) != cpu_holders[c]:
                self.bad(f"CPU block {c}: ref count {m.cpu_ref_count(c)}, held {cpu_holders[c]} times")
        for sid in self.ids:
            if not m.is_swapped(sid):
                table = m.block_table(sid)
                for pos in range(m.num_computed(sid), m.seq_len(sid)):
                    if holders[table[pos // bs]] != 1:
                        self.bad(f"seq {sid}: uncomputed position {pos} in a shared block")
        used = sum(1 for h in holders if h)
        if m.num_used_blocks != used:
            self.bad(f"num_used_blocks {m.num_used_blocks} != {used} blocks held")
        if m.num_free_blocks + m.num_cached_blocks + used != self.nb:
            self.bad("free + cached + used != num_blocks")
        if m.num_free_cpu_blocks + sum(1 for h in cpu_holders if h) != self.ncpu:
            self.bad("CPU pool does not add up")
        self.check_stats()
        if self.caching:
            self.registry()
        elif m.num_cached_blocks:
            self.bad("cached blocks without prefix caching")

    def drain(self) -> None:
        """Frees everything; the pool must be whole again."""
        for sid in list(self.ids):
            self.op_free(sid)
        m = self.m
        if m.num_pending_copies:
            self.op_take_copies()
        if m.num_sequences or m.num_used_blocks:
            self.bad("sequences or used blocks left after freeing everything")
        if m.num_free_blocks + m.num_cached_blocks != self.nb or m.num_free_cpu_blocks != self.ncpu:
            self.bad(f"pool not whole after the drain: {m!r}")
        full = (self.nb - self.wm) * self.bs
        if not m.can_allocate(full):  # every cached block is evictable
            self.bad("a full-pool allocation is refused after the drain")
        probe = self.op_add([7] * full, 0)  # takes every admissible block, evicting cached ones
        if probe is None:
            self.bad("a full-pool allocation failed after the drain")
        if m.num_used_blocks != self.nb - self.wm or m.num_available_blocks != self.wm:
            self.bad(f"full-pool allocation did not take every admissible block: {m!r}")
        self.op_free(probe)
        self.audit()

    # ---- driver ------------------------------------------------------------------------
    def one_op(self) -> None:
        rng = self.rng
        n = len(self.ids)
        pressure = self.avail() < 3 or n > 14
        r = rng.random()
        if n == 0 or r < 0.14:
            self.op_add()
        elif r < 0.36:
            self.op_step(decode=True, into=rng.random() < 0.5)
        elif r < 0.46:
            self.op_step(decode=False, into=rng.random() < 0.5)
        elif r < 0.53:
            self.op_append()
        elif r < 0.57:
            self.op_append_batch()
        elif r < 0.60:
            self.op_fork()
        elif r < 0.62:
            self.op_fork_batch()
        elif r < (0.77 if pressure else 0.67):
            self.op_free()
        elif r < (0.80 if pressure else 0.70):
            self.op_free_batch()
        elif r < 0.84:
            self.op_swap_out()
        elif r < 0.89:
            self.op_swap_in()
        elif r < 0.92:
            self.op_preempt()
        elif r < 0.95:
            self.op_take_copies()
        elif r < 0.98:
            self.op_invalid()
        elif r < 0.9805:
            self.drain()
        else:
            long_ids = [i for i in self.ids if self.ref.seq_len(i) > 8 * self.bs]
            self.op_free(rng.choice(long_ids) if long_ids else None)


def run(ops: int, seed: int, check_every: int = 2000, log=print) -> tuple:
    """Runs the soak; returns (violations, failed_call_state_changes, calls, failed_calls)."""
    rng = random.Random(seed)
    soaks = [Soak(c, random.Random(rng.getrandbits(64))) for c in CONFIGS]
    violations = changed = 0
    shown = 0

    def report(s: Soak, e: Violation) -> None:
        nonlocal violations, changed, shown
        if isinstance(e, FailedCallChanged):
            changed += 1
        else:
            violations += 1
        if shown < 10:
            log(f"bm_soak: VIOLATION at op {i} (seed {seed}): {e}")
            shown += 1
        s.reset()

    i = 0
    pick = rng.randrange
    ns = len(soaks)
    for i in range(1, ops + 1):
        s = soaks[pick(ns)]
        try:
            s.one_op()
        except Violation as e:
            report(s, e)
        if check_every and i % check_every == 0:
            for t in soaks:
                try:
                    t.audit()
                except Violation as e:
                    report(t, e)
    for s in soaks:
        try:
            s.audit()
            s.drain()
        except Violation as e:
            report(s, e)
    for s in soaks:
        log(f"bm_soak: [{s.name}] {s.calls} calls, {s.failed_calls} failed as predicted; ok: "
            + ", ".join(f"{k} {v}" for k, v in sorted(s.done.items()))
            + "; events: " + ", ".join(f"{k} {v}" for k, v in s.events.items()))
    return violations, changed, sum(s.calls for s in soaks), sum(s.failed_calls for s in soaks)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/python/harness/bm_soak.py", description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=200_000, help="random operations (default 200000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=int, default=2000, help="full audit + check_invariants() every K ops")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    violations, changed, calls, failed = run(args.ops, args.seed, args.check_every)
    dt = time.perf_counter() - t0
    print(f"bm_soak: {calls} manager calls, {failed} failed as predicted, "
          f"{args.ops / dt:,.0f} ops/s", flush=True)
    print(f"bm_soak: {args.ops} ops, seed {args.seed}: {violations} invariant violations, "
          f"{changed} failed-call state changes ({dt:.1f} s)", flush=True)
    return 1 if violations or changed else 0


if __name__ == "__main__":
    sys.exit(main())
