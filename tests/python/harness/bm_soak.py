"""Long seeded soak of pagedattn.BlockManager against an independent Python shadow.

    python tests/python/harness/bm_soak.py --ops 5000000 --seed 1 [--check-every 2000]

Several managers with small pools (so that running out of blocks, LRU eviction, swapping and
copy-on-write happen all the time) are driven through random operations: add_sequence with
shared prefixes, decode steps, chunked prefill steps, append_tokens(_batch), fork, free,
swap_out / swap_in, preemption by recomputation (free + add_sequence), take_copy_pairs,
deliberately invalid calls and an occasional full drain. Configurations: prefix caching on
and off, a sliding window on one, a watermark, with and without a CPU pool.

The shadow is independent of the C++ manager. It keeps every live sequence's token ids,
computed cursor, swapped flag and block table, and a model of the KV cache itself: the
content of every GPU and CPU cache slot, written by the step's slot mapping, moved by
copy-on-write pairs and by swap pairs. The content of a position is a hash of the whole
prefix up to it (and the sequence's extra key), i.e. what the attention kernel would read.
After every call it checks:
  * the call succeeded or failed exactly as the shadow predicted from pool counts, table
    sharing and (with caching) the registered prefixes, and the can_* queries agree;
  * a failed call (any exception) left the observable state unchanged: tables, lengths,
    token ids, computed cursors, swap flags, every pool count, the prefix-cache stats;
  * lengths, token ids and tables of the touched sequences; every slot handed out (by
    append or by a step) lies in its table's block, in a block held by exactly one
    sequence, and is unique within the step; released (sliding-window) blocks lie entirely
    out of every future query's reach; free + used + cached == num_blocks;
  * with caching: the prefix hits returned are exactly the longest registered prefix,
    evictions and the hit / queried token counters move exactly as the shadow predicts.
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

import pagedattn

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


class Violation(Exception):
    """An invariant the manager broke (counted, then the manager is rebuilt)."""


class FailedCallChanged(Violation):
    """A call raised but the manager's observable state changed."""


class _Seq:
    __slots__ = ("tokens", "ph", "nc", "swapped", "table", "extra")

    def __init__(self, tokens: list, ph: list, nc: int, table: list, extra: int) -> None:
        self.tokens = tokens
        self.ph = ph  # ph[p]: hash of (extra, tokens[0..p]) = the KV content of position p
        self.nc = nc
        self.swapped = False
        self.table = table
        self.extra = extra


def _prefix_hashes(extra: int, tokens: list, start: Optional[list] = None) -> list:
    ph = [] if start is None else start
    h = ph[-1] if ph else hash((0x5EED, extra))
    for t in tokens[len(ph) :] if start is not None else tokens:
        h = hash((h, t))
        ph.append(h)
    return ph


class Soak:
    """One manager and its shadow."""

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
        self.wm = self.m.watermark_blocks
        self.seqs: dict = {}
        self.ids: list = []  # live ids (GPU and swapped), for random choice
        self.gpu = [[None] * self.bs for _ in range(self.nb)]
        self.cpu = [[None] * self.bs for _ in range(self.ncpu)]
        self.next_id = 1
        self.stats = [0, 0, 0]  # queried_tokens, hit_tokens, evictions

    # ---- helpers -----------------------------------------------------------------------
    def counts(self) -> tuple:
        m = self.m
        return (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks, m.num_free_cpu_blocks, m.num_sequences,
                m.num_pending_copies)

    def bad(self, msg: str) -> None:
        raise Violation(f"[{self.name}] {msg}")

    def check_stats(self) -> None:
        st = self.m.prefix_cache_stats
        got = [st["queried_tokens"], st["hit_tokens"], st["evictions"]]
        if got != self.stats:
            self.bad(f"prefix_cache_stats {got} != expected {self.stats}")

    def check_seq(self, sid: int) -> None:
        s = self.seqs[sid]
        m = self.m
        if m.seq_len(sid) != len(s.tokens):
            self.bad(f"seq {sid}: seq_len {m.seq_len(sid)} != {len(s.tokens)}")
        if m.num_computed(sid) != s.nc:
            self.bad(f"seq {sid}: num_computed {m.num_computed(sid)} != {s.nc}")
        if m.is_swapped(sid) != s.swapped:
            self.bad(f"seq {sid}: is_swapped {m.is_swapped(sid)} != {s.swapped}")
        if m.block_table(sid) != s.table:
            self.bad(f"seq {sid}: block table {m.block_table(sid)} != {s.table}")

    def unchanged(self, before: tuple, what: str, err: BaseException) -> None:
        """After a failed call: the observable state must be exactly as before."""
        m = self.m
        try:
            now = self.counts()
            if now != before:
                raise FailedCallChanged(f"counts {before} -> {now}")
            if self.caching:
                self.check_stats()
            if sorted(m.sequence_ids()) != sorted(self.ids):
                raise FailedCallChanged("sequence ids changed")
            for sid, s in self.seqs.items():
                self.check_seq(sid)
                if m.token_ids(sid).tolist() != s.tokens:
                    raise FailedCallChanged(f"seq {sid}: token ids changed")
        except FailedCallChanged as e:
            raise FailedCallChanged(f"[{self.name}] {what} raised {err!r} and changed the state: {e}") from None
        except Violation as e:
            raise FailedCallChanged(f"{what} raised {err!r} and changed the state: {e}") from None

    def expect(self, what: str, predicted_ok: bool, fn, *args, **kwargs):
        """Runs one call; it must succeed iff predicted. Returns (ok, result)."""
        self.calls += 1
        before = self.counts()
        if before[0] + before[1] + before[2] != self.nb:
            self.bad(f"free + cached + used = {before[:3]} != {self.nb}")
        try:
            r = fn(*args, **kwargs)
        except EXPECTED_ERRORS as e:
            self.failed_calls += 1
            self.unchanged(before, what, e)
            if predicted_ok:
                self.bad(f"{what}: raised {e!r}, expected success")
            return False, e
        if not predicted_ok:
            self.bad(f"{what}: succeeded, expected a failure")
        key = what.split("(", 1)[0]
        self.done[key] = self.done.get(key, 0) + 1
        return True, r

    def expect_error(self, what: str, err_type, fn, *args, **kwargs) -> None:
        ok, e = self.expect(what, False, fn, *args, **kwargs)
        if not isinstance(e, err_type):
            self.bad(f"{what}: raised {e!r}, expected {err_type.__name__}")

    def gpu_ids(self, pred=None) -> list:
        return [i for i in self.ids if not self.seqs[i].swapped and (pred is None or pred(self.seqs[i]))]

    def blocks_for(self, n: int) -> int:
        return -(-n // self.bs)

    def avail(self) -> int:
        return self.m.num_available_blocks

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

    def write_slots(self, s: _Seq, start: int, slots) -> None:
        """A step computes positions [start, start + len(slots)): write their cache content."""
        bs, m, tbl = self.bs, self.m, s.table
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
            self.gpu[b][off] = s.ph[pos]

    def check_new_slots(self, s: _Seq, start: int, slots) -> None:
        bs, m = self.bs, self.m
        for k, slot in enumerate(slots.tolist()):
            pos = start + k
            b = s.table[pos // bs]
            if slot != b * bs + pos % bs:
                self.bad(f"append slot {slot} of position {pos} != table block {b}")
            if m.ref_count(b) != 1:
                self.bad(f"append slot {slot} lies in shared block {b} (ref {m.ref_count(b)})")

    def apply_copies(self, pairs) -> None:
        self.events["copies"] += len(pairs)
        for src, dst in pairs.tolist():
            if src == dst:
                self.bad(f"copy pair ({src}, {dst})")
            self.gpu[dst] = self.gpu[src][:]

    def taken(self, old: list, new: list) -> int:
        return sum(1 for j, b in enumerate(new) if b >= 0 and (j >= len(old) or old[j] != b))

    def evict_expect(self, free_before: int, taken: int) -> None:
        if self.caching:
            self.stats[2] += max(0, taken - free_before)
            self.events["evictions"] += max(0, taken - free_before)

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
        ph = _prefix_hashes(extra, tokens)
        hit_blocks = []
        if self.caching and n > 1:
            reg = self.registry()
            for j in range((n - 1) // bs):
                b = reg.get(ph[(j + 1) * bs - 1])
                if b is None:
                    break
                hit_blocks.append(b)
        from_lru = sum(1 for b in hit_blocks if m.ref_count(b) == 0)
        need = self.blocks_for(n) - len(hit_blocks)
        free_before, avail = m.num_free_blocks, self.avail()
        predicted = need <= avail - from_lru - self.wm
        if m.can_allocate(tokens, extra_key=extra) != predicted:
            self.bad(f"can_allocate({n} tokens) != predicted {predicted}")
        sid = self.next_id
        self.next_id += 1
        ok, hits = self.expect(f"add_sequence({sid}, n={n})", predicted, m.add_sequence, sid, tokens, extra_key=extra)
        if not ok:
            if not isinstance(hits, OutOfBlocksError):
                self.bad(f"add_sequence raised {hits!r}")
            return None
        if hits != len(hit_blocks) * bs:
            self.bad(f"add_sequence({n} tokens) hit {hits} tokens, expected {len(hit_blocks) * bs}")
        table = m.block_table(sid)
        if len(table) != self.blocks_for(n) or table[: len(hit_blocks)] != hit_blocks:
            self.bad(f"add_sequence table {table}, expected {self.blocks_for(n)} blocks starting {hit_blocks}")
        for b in table[len(hit_blocks) :]:
            if m.ref_count(b) != 1:
                self.bad(f"fresh block {b} has ref count {m.ref_count(b)}")
        if self.caching:
            self.stats[0] += n
            self.stats[1] += hits
            self.events["hit_tokens"] += hits
            self.evict_expect(free_before, need)
            self.check_stats()
        self.seqs[sid] = _Seq(list(tokens), ph, hits, table, extra)
        self.ids.append(sid)
        return sid

    def op_free(self, sid: Optional[int] = None) -> None:
        if sid is None:
            if not self.ids:
                return
            sid = self.rng.choice(self.ids)
        ok, _ = self.expect(f"free({sid})", True, self.m.free, sid)
        del self.seqs[sid]
        self.ids.remove(sid)
        if sid in self.m:
            self.bad(f"freed sequence {sid} still present")

    def op_preempt(self) -> None:
        """Preemption by recomputation: free, then add again with the tokens so far."""
        ids = self.gpu_ids()
        if not ids:
            return
        sid = self.rng.choice(ids)
        s = self.seqs[sid]
        self.op_free(sid)
        self.op_add(s.tokens, s.extra)

    def op_fork(self) -> None:
        ids = self.gpu_ids(lambda s: s.nc == len(s.tokens))
        if not ids:
            return
        pid = self.rng.choice(ids)
        p = self.seqs[pid]
        cid = self.next_id
        self.next_id += 1
        before = self.counts()
        self.expect(f"fork({pid}, {cid})", True, self.m.fork, pid, cid)
        table = self.m.block_table(cid)
        if table != p.table:
            self.bad(f"fork: child table {table} != parent {p.table}")
        if self.counts()[:3] != before[:3]:
            self.bad("fork changed pool counts")
        self.seqs[cid] = _Seq(list(p.tokens), list(p.ph), p.nc, table, p.extra)
        self.ids.append(cid)

    def op_append(self) -> None:
        ids = self.gpu_ids()
        if not ids:
            return
        rng, m, bs = self.rng, self.m, self.bs
        sid = rng.choice(ids)
        s = self.seqs[sid]
        n = rng.choice((1, 1, 2, bs, 2 * bs + 1, 0))
        toks = [rng.randint(0, 3) for _ in range(n)]
        length = len(s.tokens)
        cow = n > 0 and length % bs != 0 and m.ref_count(s.table[-1]) > 1
        demand = (self.blocks_for(length + n) - len(s.table) + cow) if n > 0 else 0
        predicted = demand <= self.avail()
        if m.can_append(sid, n) != predicted:
            self.bad(f"can_append({sid}, {n}) != predicted {predicted}")
        free_before = m.num_free_blocks
        ok, slots = self.expect(f"append_tokens({sid}, n={n})", predicted, m.append_tokens, sid, toks)
        if not ok:
            return
        old = s.table
        s.table = m.block_table(sid)
        s.tokens.extend(toks)
        _prefix_hashes(s.extra, s.tokens, s.ph)
        if len(s.table) != self.blocks_for(len(s.tokens)):
            self.bad(f"append: {len(s.table)} blocks for {len(s.tokens)} tokens")
        if self.taken(old, s.table) != demand:
            self.bad(f"append took {self.taken(old, s.table)} blocks, expected {demand}")
        self.evict_expect(free_before, demand)
        self.check_new_slots(s, length, slots)

    def batch_demand(self, batch: list) -> int:
        m, bs, need, seen = self.m, self.bs, 0, {}
        for sid in batch:
            s = self.seqs[sid]
            if len(s.tokens) % bs == 0:
                need += 1
                continue
            b = s.table[-1]
            k = seen.get(b, 0)
            if m.ref_count(b) - k > 1:
                need += 1
                seen[b] = k + 1
        return need

    def pick_batch(self, ids: list) -> list:
        rng = self.rng
        return rng.sample(ids, rng.randint(1, min(len(ids), 6)))

    def op_step(self, decode: bool) -> None:
        rng, m = self.rng, self.m
        if decode:
            ids = self.gpu_ids()
        else:
            ids = self.gpu_ids(lambda s: s.nc < len(s.tokens))
        if not ids:
            return
        batch = self.pick_batch(ids)
        new = [rng.randint(0, 3) for _ in batch] if decode else None
        add = 1 if decode else 0
        qlens = None
        if rng.random() < 0.4:
            qlens = [rng.randint(0, len(self.seqs[i].tokens) + add - self.seqs[i].nc) for i in batch]
        demand = self.batch_demand(batch) if decode else 0
        predicted = demand <= self.avail()
        if decode and m.can_append_batch(batch) != predicted:
            self.bad(f"can_append_batch != predicted {predicted}")
        free_before = m.num_free_blocks
        ok, md = self.expect(f"step({batch}, decode={decode})", predicted, m.step, batch, new, query_lens=qlens)
        if not ok:
            return
        self.apply_copies(md.copy_pairs)
        slot_mapping = md.slot_mapping.tolist()
        if len(set(slot_mapping)) != len(slot_mapping):
            self.bad(f"step: duplicate slots {slot_mapping}")
        qsl = md.query_start_loc.tolist()
        ctx_l, sl_l = md.context_lens.tolist(), md.seq_lens.tolist()
        taken = 0
        if qsl[0] != 0 or md.num_tokens != len(slot_mapping):
            self.bad("step: query_start_loc / num_tokens inconsistent")
        for i, sid in enumerate(batch):
            s = self.seqs[sid]
            old = s.table
            if decode:
                s.tokens.append(new[i])
                _prefix_hashes(s.extra, s.tokens, s.ph)
            ctx = s.nc
            q = qlens[i] if qlens is not None else len(s.tokens) - ctx
            if ctx_l[i] != ctx or sl_l[i] != ctx + q or qsl[i + 1] - qsl[i] != q:
                self.bad(f"step metadata of {sid}: ctx {ctx_l[i]} seq_len {sl_l[i]}, expected {ctx}, {ctx + q}")
            s.table = m.block_table(sid)
            taken += self.taken(old, s.table)
            if len(s.table) != self.blocks_for(len(s.tokens)):
                self.bad(f"step: {len(s.table)} blocks for {len(s.tokens)} tokens")
            if self.window:
                self.events["window_releases"] += s.table.count(-1) - old.count(-1)
            self.write_slots(s, ctx, slot_mapping[qsl[i] : qsl[i + 1]])
            s.nc = ctx + q
            if self.window:
                self.check_window(s, ctx)
        if taken != demand:
            self.bad(f"step took {taken} blocks, expected {demand}")
        self.evict_expect(free_before, demand)
        if self.caching and decode:
            self.check_stats()

    def check_window(self, s: _Seq, ctx_before: int) -> None:
        w, bs = self.window, self.bs
        # released only when out of reach of every later query; released once out of reach at the step start
        reach = s.nc - w + 1  # oldest key position the next query can attend to
        limit_blocks = max(0, (ctx_before - w + 1)) // bs
        for j, b in enumerate(s.table):
            if b < 0 and (j + 1) * bs - 1 >= reach:
                self.bad(f"window released block {j} still in reach (num_computed {s.nc}, window {w})")
            if b >= 0 and j < limit_blocks:
                self.bad(f"window kept block {j} (limit {limit_blocks})")

    def op_append_batch(self) -> None:
        ids = self.gpu_ids()
        if not ids:
            return
        rng, m = self.rng, self.m
        batch = self.pick_batch(ids)
        toks = [rng.randint(0, 3) for _ in batch]
        demand = self.batch_demand(batch)
        predicted = demand <= self.avail()
        free_before = m.num_free_blocks
        ok, slots = self.expect(f"append_tokens_batch({batch})", predicted, m.append_tokens_batch, batch, toks)
        if not ok:
            return
        taken = 0
        for i, sid in enumerate(batch):
            s = self.seqs[sid]
            old = s.table
            s.table = m.block_table(sid)
            taken += self.taken(old, s.table)
            s.tokens.append(toks[i])
            _prefix_hashes(s.extra, s.tokens, s.ph)
            self.check_new_slots(s, len(s.tokens) - 1, slots[i : i + 1])
        if taken != demand:
            self.bad(f"append_tokens_batch took {taken} blocks, expected {demand}")
        self.evict_expect(free_before, demand)

    def op_take_copies(self) -> None:
        ok, pairs = self.expect("take_copy_pairs", True, self.m.take_copy_pairs)
        self.apply_copies(pairs)
        if self.m.num_pending_copies != 0:
            self.bad("copies still pending after take_copy_pairs")

    def op_swap_out(self) -> None:
        ids = self.gpu_ids()
        if not ids:
            return
        m = self.m
        batch = self.pick_batch(ids)
        pending = m.num_pending_copies
        distinct = {b for i in batch for b in self.seqs[i].table if b >= 0}
        if self.ncpu == 0 or pending:
            if m.can_swap_out(batch):
                self.bad("can_swap_out true without a CPU pool / with pending copies")
            self.expect_error(f"swap_out({batch})", ValueError, m.swap_out, batch)
            return
        predicted = len(distinct) <= m.num_free_cpu_blocks
        if m.can_swap_out(batch) != predicted:
            self.bad(f"can_swap_out != predicted {predicted}")
        ok, pairs = self.expect(f"swap_out({batch})", predicted, m.swap_out, batch)
        if not ok:
            if not isinstance(pairs, OutOfBlocksError):
                self.bad(f"swap_out raised {pairs!r}")
            return
        mapping = {}
        for g, c in pairs.tolist():
            if g in mapping or g not in distinct:
                self.bad(f"swap_out pair ({g}, {c}) repeated or not of the batch")
            mapping[g] = c
            self.cpu[c] = self.gpu[g][:]
            self.events["swap_pairs"] += 1
        if len(mapping) != len(distinct) or len(set(mapping.values())) != len(mapping):
            self.bad("swap_out pairs do not cover the batch's blocks once each")
        for sid in batch:
            s = self.seqs[sid]
            expect_tbl = [mapping[b] if b >= 0 else -1 for b in s.table]
            s.table = m.block_table(sid)
            s.swapped = True
            if s.table != expect_tbl:
                self.bad(f"swap_out table {s.table} != {expect_tbl}")

    def op_swap_in(self) -> None:
        ids = [i for i in self.ids if self.seqs[i].swapped]
        if not ids:
            return
        m = self.m
        batch = self.pick_batch(ids)
        if m.num_pending_copies:
            self.expect_error(f"swap_in({batch})", ValueError, m.swap_in, batch)
            return
        distinct = {b for i in batch for b in self.seqs[i].table if b >= 0}
        predicted = len(distinct) <= self.avail() - self.wm
        if m.can_swap_in(batch) != predicted:
            self.bad(f"can_swap_in != predicted {predicted}")
        free_before = m.num_free_blocks
        ok, pairs = self.expect(f"swap_in({batch})", predicted, m.swap_in, batch)
        if not ok:
            if not isinstance(pairs, OutOfBlocksError):
                self.bad(f"swap_in raised {pairs!r}")
            return
        mapping = {}
        for c, g in pairs.tolist():
            if c in mapping or c not in distinct:
                self.bad(f"swap_in pair ({c}, {g}) repeated or not of the batch")
            mapping[c] = g
            self.gpu[g] = self.cpu[c][:]
        if len(mapping) != len(distinct) or len(set(mapping.values())) != len(mapping):
            self.bad("swap_in pairs do not cover the batch's blocks once each")
        for sid in batch:
            s = self.seqs[sid]
            expect_tbl = [mapping[b] if b >= 0 else -1 for b in s.table]
            s.table = m.block_table(sid)
            s.swapped = False
            if s.table != expect_tbl:
                self.bad(f"swap_in table {s.table} != {expect_tbl}")
        for g in mapping.values():
            if m.ref_count(g) != sum(1 for i in batch for b in self.seqs[i].table if b == g):
                self.bad(f"swapped-in block {g} ref count {m.ref_count(g)}")
        self.evict_expect(free_before, len(distinct))

    def op_invalid(self) -> None:
        """A call that must fail with a typed error and change nothing."""
        rng, m = self.rng, self.m
        k = rng.randrange(6)
        if k == 0:
            self.expect_error("free(unknown)", KeyError, m.free, -12345)
        elif k == 1 and self.ids:
            sid = rng.choice(self.ids)
            self.expect_error(f"add_sequence(duplicate {sid})", ValueError, m.add_sequence, sid, [1, 2, 3])
        elif k == 2:
            ids = self.gpu_ids(lambda s: s.nc < len(s.tokens))
            if ids:
                self.expect_error("fork(uncomputed parent)", ValueError, m.fork, ids[0], self.next_id)
        elif k == 3:
            ids = self.gpu_ids()
            if ids:
                s = self.seqs[ids[0]]
                self.expect_error("step(query too long)", ValueError, m.step, [ids[0]],
                                  query_lens=[len(s.tokens) - s.nc + 1])
        elif k == 4:
            ids = self.gpu_ids()
            if len(ids) >= 1:
                self.expect_error("step(duplicate ids)", ValueError, m.step, [ids[0], ids[0]], [1, 1])
        else:
            ids = [i for i in self.ids if self.seqs[i].swapped]
            if ids:
                self.expect_error("append to swapped", ValueError, m.append_tokens, ids[0], [1])
                self.expect_error("step on swapped", ValueError, m.step, [ids[0]])

    # ---- audits ------------------------------------------------------------------------
    def audit(self) -> None:
        m, bs = self.m, self.bs
        try:
            m.check_invariants()
        except RuntimeError as e:
            self.bad(f"check_invariants: {e}")
        if m.num_pending_copies:
            self.op_take_copies()  # the caller's copy_blocks before reading the cache
        if sorted(m.sequence_ids()) != sorted(self.ids) or m.num_sequences != len(self.ids):
            self.bad("sequence ids differ from the shadow")
        holders = [0] * self.nb
        cpu_holders = [0] * self.ncpu
        index_of: dict = {}
        for sid in self.ids:
            s = self.seqs[sid]
            self.check_seq(sid)
            if m.token_ids(sid).tolist() != s.tokens:
                self.bad(f"seq {sid}: token ids differ")
            if len(s.table) != self.blocks_for(len(s.tokens)):
                self.bad(f"seq {sid}: {len(s.table)} blocks for {len(s.tokens)} tokens")
            for j, b in enumerate(s.table):
                if b < 0:
                    continue
                if s.swapped:
                    cpu_holders[b] += 1
                    continue
                holders[b] += 1
                if index_of.setdefault(b, j) != j:
                    self.bad(f"block {b} at table index {j} of seq {sid} and index {index_of[b]} elsewhere")
            pool = self.cpu if s.swapped else self.gpu
            for pos in range(s.nc):
                b = s.table[pos // bs]
                if b >= 0 and pool[b][pos % bs] != s.ph[pos]:
                    self.bad(f"seq {sid} position {pos}: cache content of block {b} is not its token's KV")
        for b in range(self.nb):
            if m.ref_count(b) != holders[b]:
                self.bad(f"block {b}: ref count {m.ref_count(b)}, held {holders[b]} times")
        for c in range(self.ncpu):
            if m.cpu_ref_count(c) != cpu_holders[c]:
                self.bad(f"CPU block {c}: ref count {m.cpu_ref_count(c)}, held {cpu_holders[c]} times")
        for sid in self.ids:
            s = self.seqs[sid]
            if not s.swapped:
                for pos in range(s.nc, len(s.tokens)):
                    if holders[s.table[pos // bs]] != 1:
                        self.bad(f"seq {sid}: uncomputed position {pos} in a shared block")
        used = sum(1 for h in holders if h)
        if m.num_used_blocks != used:
            self.bad(f"num_used_blocks {m.num_used_blocks} != {used} blocks held")
        if m.num_free_blocks + m.num_cached_blocks + used != self.nb:
            self.bad("free + cached + used != num_blocks")
        if m.num_free_cpu_blocks + sum(1 for h in cpu_holders if h) != self.ncpu:
            self.bad("CPU pool does not add up")
        if self.caching:
            self.registry()
            self.check_stats()
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
            self.op_step(decode=True)
        elif r < 0.46:
            self.op_step(decode=False)
        elif r < 0.53:
            self.op_append()
        elif r < 0.57:
            self.op_append_batch()
        elif r < 0.62:
            self.op_fork()
        elif r < (0.80 if pressure else 0.70):
            self.op_free()
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
            long_ids = [i for i in self.ids if len(self.seqs[i].tokens) > 8 * self.bs]
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
