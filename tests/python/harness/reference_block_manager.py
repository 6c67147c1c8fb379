"""The one Python model of pagedattn.BlockManager's policy: a plain pure-Python KV block manager.

``ReferenceBlockManager`` makes the same decisions as the C++ manager (block ids, slots, copy
pairs, swap mappings, evictions, prefix hits, refusals) with plain dicts, lists and an
OrderedDict, the way a Python serving engine would write it. It is read by:

- tests/python/test_block_manager_state.py: hypothesis drives both managers, decision for decision;
- tests/python/harness/bm_soak.py: the long seeded soak predicts every call's outcome from it;
- tests/python/harness/fuzz.py: calls the C++ manager accepted are replayed on it and compared;
- benchmarks/block_manager_bench.py: the pure-Python baseline the C++ manager is timed against.

Prefix-cache keys are Python's ``hash`` of (previous key, block token tuple, extra key), as in vLLM.

Policies shared with the C++ manager: the free list is a stack that starts with block 0 on
top; allocation takes the free list first and then evicts the least recently freed cached
block; a freed sequence's blocks are released last block first; a block is registered in the
prefix cache once all of its tokens are computed (newest registration wins); a prefix hit
covers at most ``(n - 1) // block_size`` blocks; admission (add_sequence, swap_in) keeps
``int(watermark * num_blocks)`` blocks available.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Dict, List, Optional, Tuple  # noqa: F401, UP035

__all__ = ["ReferenceBlockManager", "ReferenceOutOfBlocks"]


class ReferenceOutOfBlocks(RuntimeError):
    pass


class _Seq:
    __slots__ = ("tokens", "blocks", "computed", "keys", "extra", "swapped", "first_live", "ids_known")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.blocks: list[int] = []
        self.computed = 0
        self.keys: list[int] = []
        self.extra = 0
        self.swapped = False
        self.first_live = 0
        self.ids_known = True


_ROOT = 0x243F6A8885A308D3


class ReferenceBlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
        watermark: float = 0.0,
        sliding_window: int = 0,
    ) -> None:
        self.bs = block_size
        self.num_blocks = num_blocks
        self.caching = enable_prefix_caching
        self.window = sliding_window
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref = [0] * num_blocks
        self.free_list = list(range(num_blocks - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable cached blocks, oldest first
        self.cache: dict[int, int] = {}  # key -> block
        self.block_key: dict[int, int] = {}  # registered block -> key
        self.cpu_ref = [0] * num_cpu_blocks
        self.cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        self.num_cpu_blocks = num_cpu_blocks
        self.seqs: dict[int, _Seq] = {}
        self.copies: list[tuple[int, int]] = []
        self.queried = 0
        self.hits = 0
        self.evictions = 0

    # ---- pool -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.lru)

    @property
    def num_available_blocks(self) -> int:
        return len(self.free_list) + len(self.lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_available_blocks

    def _take(self) -> int:
        if self.free_list:
            b = self.free_list.pop()
        else:
            b, _ = self.lru.popitem(last=False)
            del self.cache[self.block_key.pop(b)]
            self.evictions += 1
        self.ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.block_key:
                self.lru[b] = None
            else:
                self.free_list.append(b)

    def _uncache(self, b: int) -> None:
        del self.cache[self.block_key.pop(b)]
        if self.ref[b] == 0:
            del self.lru[b]
            self.free_list.append(b)

    def _key(self, prev: int, tokens: Sequence[int], extra: int) -> int:
        return hash((prev, tuple(tokens), extra))

    def _register(self, s: _Seq) -> None:
        if not self.caching:
            return
        full = min(s.computed // self.bs, len(s.blocks))
        while len(s.keys) < full:
            j = len(s.keys)
            prev = s.keys[j - 1] if j else _ROOT
            key = self._key(prev, s.tokens[j * self.bs : (j + 1) * self.bs], s.extra)
            s.keys.append(key)
            b = s.blocks[j]
            if b in self.block_key:
                continue
            old = self.cache.get(key)
            if old is not None:
                self._uncache(old)
            self.cache[key] = b
            self.block_key[b] = key

    def _hits(self, tokens: Sequence[int], extra: int) -> tuple[list[int], list[int], int]:
        keys: list[int] = []
        blocks: list[int] = []
        from_lru = 0
        if not self.caching or not tokens:
            return keys, blocks, 0
        prev = _ROOT
        for j in range((len(tokens) - 1) // self.bs):
            key = self._key(prev, tokens[j * self.bs : (j + 1) * self.bs], extra)
            b = self.cache.get(key)
            if b is None:
                break
            if self.ref[b] == 0:
                from_lru += 1
            keys.append(key)
            blocks.append(b)
            prev = key
        return keys, blocks, from_lru

    def _get(self, seq_id: int, gpu: Optional[bool] = True) -> _Seq:
        s = self.seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id}")
        if gpu is not None and s.swapped == gpu:
            raise ValueError(f"sequence id {seq_id} is {'swapped out' if gpu else 'not swapped out'}")
        return s

    # ---- sequences --------------------------------------------------------------------
    def add_sequence(self, seq_id: int, token_ids: Sequence[int], *, extra_key: int = 0) -> int:
        tokens = [int(t) for t in token_ids]
        if seq_id in self.seqs:
            raise ValueError(f"sequence id {seq_id} already exists")
        keys, hit_blocks, from_lru = self._hits(tokens, extra_key)
        need = -(-len(tokens) // self.bs) - len(hit_blocks)
        if need > self.num_available_blocks - from_lru - self.watermark_blocks:
            raise ReferenceOutOfBlocks(f"add_sequence: {need} blocks needed")
        s = _Seq()
        s.tokens = tokens
        s.extra = extra_key
        s.keys = keys
        for b in hit_blocks:
            if self.ref[b] == 0:
                del self.lru[b]
            self.ref[b] += 1
            s.blocks.append(b)
        for _ in range(need):
            s.blocks.append(self._take())
        s.computed = len(hit_blocks) * self.bs
        self.seqs[seq_id] = s
        if self.caching:
            self.queried += len(tokens)
            self.hits += s.computed
        return s.computed

    def add_sequence_by_count(self, seq_id: int, num_tokens: int) -> int:
        """add_sequence without the ids (caching off): the same admission; token_ids() refuses."""
        if num_tokens < 0:
            raise ValueError("add_sequence_by_count: negative token count")
        if self.caching:
            raise ValueError("add_sequence_by_count: prefix caching is on")
        hits = self.add_sequence(seq_id, [0] * num_tokens)
        self.seqs[seq_id].ids_known = num_tokens == 0
        return hits

    def _append_demand(self, s: _Seq, n: int) -> int:
        if n <= 0:
            return 0
        need = -(-(len(s.tokens) + n) // self.bs) - len(s.blocks)
        if len(s.tokens) % self.bs and self.ref[s.blocks[-1]] > 1:
            need += 1
        return need

    def _append(self, s: _Seq, tokens: Sequence[int]) -> list[int]:
        if not tokens:
            return []
        n0 = len(s.tokens)
        if n0 % self.bs and self.ref[s.blocks[-1]] > 1:
            fresh = self._take()
            self.ref[s.blocks[-1]] -= 1
            self.copies.append((s.blocks[-1], fresh))
            s.blocks[-1] = fresh
        slots = []
        for i, t in enumerate(tokens):
            pos = n0 + i
            if pos % self.bs == 0:
                s.blocks.append(self._take())
            s.tokens.append(int(t))
            slots.append(s.blocks[pos // self.bs] * self.bs + pos % self.bs)
        return slots

    def append_tokens(self, seq_id: int, token_ids: Sequence[int]) -> list[int]:
        s = self._get(seq_id)
        if self._append_demand(s, len(token_ids)) > self.num_available_blocks:
            raise ReferenceOutOfBlocks("append_tokens")
        return self._append(s, token_ids)

    def _batch_demand(self, seqs: list[_Seq]) -> int:
        need = 0
        taken: dict[int, int] = {}
        for s in seqs:
            if len(s.tokens) % self.bs == 0:
                need += 1
                continue
            last = s.blocks[-1]
            if self.ref[last] - taken.get(last, 0) > 1:
                need += 1
                taken[last] = taken.get(last, 0) + 1
        return need

    def _resolve(self, seq_ids: Sequence[int], gpu: bool = True) -> list[_Seq]:
        seqs = [self._get(int(i), gpu) for i in seq_ids]
        if len(set(int(i) for i in seq_ids)) != len(seqs):
            raise ValueError("duplicate sequence id in batch")
        return seqs

    def append_tokens_batch(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        seqs = self._resolve(seq_ids)
        if self._batch_demand(seqs) > self.num_available_blocks:
            raise ReferenceOutOfBlocks("append_tokens_batch")
        return [self._append(s, [t])[0] for s, t in zip(seqs, token_ids)]

    def fork(self, parent_id: int, child_id: int) -> None:
        p = self._get(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"sequence id {child_id} already exists")
        if p.computed != len(p.tokens):
            raise ValueError("fork: parent has uncomputed tokens")
        c = _Seq()
        c.tokens = list(p.tokens)
        c.blocks = list(p.blocks)
        c.keys = list(p.keys)
        c.computed = p.computed
        c.extra = p.extra
        c.first_live = p.first_live
        c.ids_known = p.ids_known
        for b in c.blocks:
            if b >= 0:
                self.ref[b] += 1
        self.seqs[child_id] = c

    def fork_batch(self, parent_ids, child_ids) -> None:
        """fork() for each pair, all or nothing (an int parent: one parent for every child)."""
        children = [int(c) for c in child_ids]
        parents = [int(parent_ids)] * len(children) if isinstance(parent_ids, int) else [int(p) for p in parent_ids]
        if len(parents) != len(children):
            raise ValueError("fork_batch: parent_ids and child_ids differ in length")
        for p, c in zip(parents, children):
            ps = self._get(p)
            if c in self.seqs:
                raise ValueError(f"sequence id {c} already exists")
            if ps.computed != len(ps.tokens):
                raise ValueError("fork_batch: parent has uncomputed tokens")
        if len(set(children)) != len(children):
            raise ValueError("fork_batch: duplicate child id")
        for p, c in zip(parents, children):
            self.fork(p, c)

    def free_batch(self, seq_ids: Sequence[int]) -> None:
        """free() of each (distinct) sequence, in order, all or nothing."""
        ids = [int(i) for i in seq_ids]
        for i in ids:
            self._get(i, None)
        if len(set(ids)) != len(ids):
            raise ValueError("free_batch: duplicate sequence id")
        for i in ids:
            self.free(i)

    def free(self, seq_id: int) -> None:
        s = self._get(seq_id, None)
        if s.swapped:
            for c in s.blocks:
                if c >= 0:
                    self.cpu_ref[c] -= 1
                    if self.cpu_ref[c] == 0:
                        self.cpu_free.append(c)
        else:
            for b in reversed(s.blocks):
                if b >= 0:
                    self._release(b)
        del self.seqs[seq_id]

    # ---- steps ------------------------------------------------------------------------
    def step(
        self,
        seq_ids: Sequence[int],
        token_ids: Optional[Sequence[int]] = None,
        *,
        query_lens: Optional[Sequence[int]] = None,
        max_blocks: Optional[int] = None,
        pad: int = 0,
    ) -> dict:
        seqs = self._resolve(seq_ids)
        add = 1 if token_ids is not None else 0
        qs = []
        for i, s in enumerate(seqs):
            pending = len(s.tokens) + add - s.computed
            q = pending if query_lens is None else int(query_lens[i])
            if q < 0 or q > pending:
                raise ValueError("query length out of range")
            qs.append(q)
        if token_ids is not None and self._batch_demand(seqs) > self.num_available_blocks:
            raise ReferenceOutOfBlocks("step")
        if token_ids is not None:
            for s, t in zip(seqs, token_ids):
                self._append(s, [t])
        width = max([len(s.blocks) for s in seqs], default=0)
        if max_blocks is not None:
            width = max_blocks
        tables, seq_lens, ctx_lens, qsl, slots = [], [], [], [0], []
        for s, q in zip(seqs, qs):
            ctx = s.computed
            self._release_window(s, ctx)
            for pos in range(ctx, ctx + q):
                slots.append(s.blocks[pos // self.bs] * self.bs + pos % self.bs)
            qsl.append(qsl[-1] + q)
            row = [pad if b < 0 else b for b in s.blocks]
            tables.append(row + [pad] * (width - len(row)))
            seq_lens.append(ctx + q)
            ctx_lens.append(ctx)
            s.computed = ctx + q
            self._register(s)
        copies = self.copies
        self.copies = []
        return {
            "block_tables": tables,
            "seq_lens": seq_lens,
            "context_lens": ctx_lens,
            "query_start_loc": qsl,
            "slot_mapping": slots,
            "copy_pairs": copies,
        }

    def _release_window(self, s: _Seq, first_query_pos: int) -> None:
        if self.window <= 0:
            return
        limit = first_query_pos - self.window + 1
        if limit <= 0:
            return
        end = min(limit // self.bs, len(s.blocks))
        for j in range(s.first_live, end):
            if s.blocks[j] >= 0:
                self._release(s.blocks[j])
            s.blocks[j] = -1
        s.first_live = max(s.first_live, end)

    def take_copy_pairs(self) -> list[tuple[int, int]]:
        copies = self.copies
        self.copies = []
        return copies

    # ---- swapping ---------------------------------------------------------------------
    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        if self.num_cpu_blocks == 0 or self.copies:
            raise ValueError("swap_out not possible now")
        seqs = self._resolve(seq_ids)
        distinct = {b for s in seqs for b in s.blocks if b >= 0}
        if len(distinct) > len(self.cpu_free):
            raise ReferenceOutOfBlocks("swap_out")
        mapping: dict[int, int] = {}
        pairs = []
        for s in seqs:
            for b in s.blocks:
                if b < 0:
                    continue
                if b not in mapping:
                    c = self.cpu_free.pop()
                    self.cpu_ref[c] = 0
                    mapping[b] = c
                    pairs.append((b, c))
                self.cpu_ref[mapping[b]] += 1
            for j in range(len(s.blocks) - 1, -1, -1):
                b = s.blocks[j]
                if b >= 0:
                    s.blocks[j] = mapping[b]
                    self._release(b)
            s.swapped = True
        return pairs

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        if self.num_cpu_blocks == 0 or self.copies:
            raise ValueError("swap_in not possible now")
        seqs = self._resolve(seq_ids, gpu=False)
        distinct = {c for s in seqs for c in s.blocks if c >= 0}
        if len(distinct) > self.num_available_blocks - self.watermark_blocks:
            raise ReferenceOutOfBlocks("swap_in")
        mapping: dict[int, int] = {}
        pairs = []
        for s in seqs:
            for j, c in enumerate(s.blocks):
                if c < 0:
                    continue
                if c not in mapping:
                    g = self._take()
                    self.ref[g] = 0
                    mapping[c] = g
                    pairs.append((c, g))
                g = mapping[c]
                self.ref[g] += 1
                self.cpu_ref[c] -= 1
                if self.cpu_ref[c] == 0:
                    self.cpu_free.append(c)
                s.blocks[j] = g
            s.swapped = False
        return pairs

    # ---- queries ----------------------------------------------------------------------
    def can_allocate(self, token_ids: Sequence[int], *, extra_key: int = 0) -> bool:
        _, hit_blocks, from_lru = self._hits(list(token_ids), extra_key)
        need = -(-len(token_ids) // self.bs) - len(hit_blocks)
        return need <= self.num_available_blocks - from_lru - self.watermark_blocks

    def peek_prefix(self, token_ids: Sequence[int], *, extra_key: int = 0) -> dict:
        """What add_sequence would find and take, changing nothing (BlockManager.peek_prefix)."""
        _, hit_blocks, from_lru = self._hits(list(token_ids), extra_key)
        need = -(-len(token_ids) // self.bs) - len(hit_blocks)
        return {
            "cached_tokens": len(hit_blocks) * self.bs,
            "new_blocks": need,
            "reused_cached_blocks": from_lru,
            "fits": need <= self.num_available_blocks - from_lru - self.watermark_blocks,
        }

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return self._append_demand(self._get(seq_id), num_tokens) <= self.num_available_blocks

    def can_append_batch(self, seq_ids: Sequence[int]) -> bool:
        return self._batch_demand(self._resolve(seq_ids)) <= self.num_available_blocks

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        if self.num_cpu_blocks == 0 or self.copies:
            return False
        seqs = self._resolve(seq_ids)
        return len({b for s in seqs for b in s.blocks if b >= 0}) <= len(self.cpu_free)

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        if self.num_cpu_blocks == 0 or self.copies:
            return False
        seqs = self._resolve(seq_ids, gpu=False)
        distinct = {c for s in seqs for c in s.blocks if c >= 0}
        return len(distinct) <= self.num_available_blocks - self.watermark_blocks

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id, None).blocks)

    def block_tables(self, seq_ids: Sequence[int], pad: int = 0) -> list[list[int]]:
        seqs = self._resolve(seq_ids)
        width = max([len(s.blocks) for s in seqs], default=0)
        return [[pad if b < 0 else b for b in s.blocks] + [pad] * (width - len(s.blocks)) for s in seqs]

    def seq_len(self, seq_id: int) -> int:
        return len(self._get(seq_id, None).tokens)

    def num_computed(self, seq_id: int) -> int:
        return self._get(seq_id, None).computed

    def is_cached(self, block: int) -> bool:
        return block in self.block_key

    def is_swapped(self, seq_id: int) -> bool:
        return self._get(seq_id, None).swapped

    def token_ids(self, seq_id: int) -> list[int]:
        s = self._get(seq_id, None)
        if not s.ids_known:
            raise ValueError(f"token_ids: sequence id {seq_id} was admitted by count")
        return list(s.tokens)

    def sequence_ids(self) -> list[int]:
        return list(self.seqs)

    def ref_count(self, block: int) -> int:
        return self.ref[block]

    def cpu_ref_count(self, block: int) -> int:
        return self.cpu_ref[block]

    @property
    def num_sequences(self) -> int:
        return len(self.seqs)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu_free)

    @property
    def num_pending_copies(self) -> int:
        return len(self.copies)

    def reset_prefix_cache_stats(self) -> None:
        self.queried = self.hits = self.evictions = 0

    @property
    def prefix_cache_stats(self) -> dict:
        """The counters of ``BlockManager.prefix_cache_stats`` (without the derived hit rate)."""
        return {"queried_tokens": self.queried, "hit_tokens": self.hits, "evictions": self.evictions}
