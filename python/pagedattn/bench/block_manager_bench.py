"""Block-manager benchmark: the C++ manager against a pure-Python manager, and the memory-efficiency
simulation. Run: ``python -m pagedattn.bench.block_manager_bench [--quick]``.

``ReferenceBlockManager`` is a straightforward pure-Python KV block manager with the same policies
as the C++ one, written for two jobs: the benchmark's side-by-side baseline (plain dicts, lists and an
OrderedDict, the way a Python serving engine would write it) and the model the stateful
property tests compare ``pagedattn.BlockManager`` against, decision for decision (block ids,
slots, copy pairs, swap mappings, evictions). Prefix-cache keys are Python's ``hash`` of
(previous key, block token tuple, extra key), as in vLLM.

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

__all__ = ["ReferenceBlockManager", "ReferenceOutOfBlocks", "run_benchmarks", "simulate_memory_efficiency"]


class ReferenceOutOfBlocks(RuntimeError):
    pass


class _Seq:
    __slots__ = ("tokens", "blocks", "computed", "keys", "extra", "swapped", "first_live")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.blocks: list[int] = []
        self.computed = 0
        self.keys: list[int] = []
        self.extra = 0
        self.swapped = False
        self.first_live = 0


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
        for b in c.blocks:
            if b >= 0:
                self.ref[b] += 1
        self.seqs[child_id] = c

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

    def can_append_batch(self, seq_ids: Sequence[int]) -> bool:
        return self._batch_demand(self._resolve(seq_ids)) <= self.num_available_blocks

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


# =========================================================================================
# Benchmark
# =========================================================================================
def _median_us(fn, repeats: int) -> float:
    import time

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    times.sort()
    return times[len(times) // 2] / 1000.0


def _decode_case(make, n_seqs: int, prompt: int, steps: int, out_arrays: bool, reference: bool) -> float:
    import numpy as np

    m = make()
    rng = np.random.default_rng(0)
    ids = np.arange(n_seqs, dtype=np.int64)
    for i in range(n_seqs):
        m.add_sequence(i, rng.integers(0, 32000, prompt).tolist())
    m.step(ids.tolist() if reference else ids)
    toks = rng.integers(0, 32000, n_seqs).astype(np.int32)
    if reference:
        id_list, tok_list = ids.tolist(), toks.tolist()

        def step():
            md = m.step(id_list, tok_list)
            np.asarray(md["block_tables"], dtype=np.int32)
            np.asarray(md["seq_lens"], dtype=np.int32)
            np.asarray(md["slot_mapping"], dtype=np.int64)

    elif out_arrays:
        width = (prompt + steps + 64) // 16 + 1
        bt = np.zeros((n_seqs, width), np.int32)
        sl = np.zeros(n_seqs, np.int32)
        sm = np.zeros(n_seqs, np.int64)
        cl = np.zeros(n_seqs, np.int32)
        qs = np.zeros(n_seqs + 1, np.int32)

        def step():
            m.step(ids, toks, block_tables=bt, seq_lens=sl, slot_mapping=sm, context_lens=cl, query_start_loc=qs)

    else:

        def step():
            m.step(ids, toks)

    return _median_us(step, steps)


def run_benchmarks(quick: bool = False) -> dict:
    """Times the C++ manager (through Python) and the pure-Python reference; returns a dict of µs."""
    import numpy as np

    from .. import BlockManager

    NB, BS = 32768, 16
    steps = 50 if quick else 300
    res = {}
    for caching in (False, True):
        tag = "cache_on" if caching else "cache_off"

        def mk(caching=caching):
            return BlockManager(NB, BS, enable_prefix_caching=caching)

        def mkref(caching=caching):
            return ReferenceBlockManager(NB, BS, enable_prefix_caching=caching)

        res[f"decode256_new_arrays_{tag}"] = _decode_case(mk, 256, 512, steps, False, False)
        res[f"decode256_out_arrays_{tag}"] = _decode_case(mk, 256, 512, steps, True, False)
        res[f"decode256_python_{tag}"] = _decode_case(mkref, 256, 512, max(20, steps // 10), False, True)

    rng = np.random.default_rng(1)
    reps = 20 if quick else 200
    for name, make in (("cpp", lambda c: BlockManager(NB, BS, enable_prefix_caching=c)),
                       ("python", lambda c: ReferenceBlockManager(NB, BS, enable_prefix_caching=c))):
        r = reps if name == "cpp" else max(5, reps // 10)
        prompt = rng.integers(0, 32000, 2048).astype(np.int32)
        arg = prompt if name == "cpp" else prompt.tolist()
        # Allocation, cache off: add + free of a 2048-token prompt (128 blocks).
        m = make(False)
        counter = iter(range(10**9))

        def alloc():
            m.add_sequence(next(counter), arg)  # noqa: B023

        res[f"alloc2048_cache_off_{name}"] = _median_us(alloc, r)
        # Free of a 2048-token request.
        m = make(False)
        for i in range(r):
            m.add_sequence(i, arg)
        it = iter(range(r))
        res[f"free2048_{name}"] = _median_us(lambda: m.free(next(it)), r)  # noqa: B023
        # Allocation with caching on and evictions: the pool is full of cached blocks;
        # add + compute (hash and register 128 blocks) a new unique prompt.
        m = make(True)
        k = 0
        while m.num_free_blocks >= 128:
            m.add_sequence(k, rng.integers(0, 32000, 2048).tolist())
            m.step([k])
            m.free(k)
            k += 1
        prompts = [rng.integers(0, 32000, 2048).astype(np.int32) for _ in range(r)]
        it = iter(range(r))

        def alloc_cached():
            j = next(it)  # noqa: B023
            p = prompts[j] if name == "cpp" else prompts[j].tolist()  # noqa: B023
            m.add_sequence(10**6 + j, p)  # noqa: B023
            m.step([10**6 + j])  # noqa: B023
            m.free(10**6 + j)  # noqa: B023

        res[f"alloc2048_cache_on_evict_{name}"] = _median_us(alloc_cached, r)
        # Prefix hit of a cached 2048-token prompt (hashing included), then free.
        m = make(True)
        m.add_sequence(0, arg)
        m.step([0])
        it = iter(range(1, r + 1))

        def hit():
            j = next(it)  # noqa: B023
            assert m.add_sequence(j, arg) == 2032  # noqa: B023

        res[f"prefix_hit2048_{name}"] = _median_us(hit, r)

    # Fork of a 33-block sequence, first copy-on-write append, swap planning.
    m = BlockManager(NB, BS, num_cpu_blocks=NB)
    m.add_sequence(0, list(range(520)))  # 33 blocks, last one partly filled
    m.step([0])
    it = iter(range(1, reps + 1))
    res["fork33_cpp"] = _median_us(lambda: m.fork(0, next(it)), reps)
    it2 = iter(range(1, reps + 1))
    res["first_cow_append_cpp"] = _median_us(lambda: m.append_tokens(next(it2), [1]), reps)
    m.take_copy_pairs()
    import time

    for nblocks in (66, 660):
        outs, ins = [], []
        for j in range(25):
            sid = 10**6 + j
            m.add_sequence(sid, list(range(nblocks * 16)))
            t0 = time.perf_counter_ns()
            m.swap_out([sid])
            t1 = time.perf_counter_ns()
            m.swap_in([sid])
            t2 = time.perf_counter_ns()
            m.free(sid)
            outs.append(t1 - t0)
            ins.append(t2 - t1)
        res[f"swap_out{nblocks}_cpp"] = sorted(outs)[len(outs) // 2] / 1000.0
        res[f"swap_in{nblocks}_cpp"] = sorted(ins)[len(ins) // 2] / 1000.0
    res["alloc_blocks_per_s_cpp"] = 128 / res["alloc2048_cache_off_cpp"] * 1e6
    res["prefix_lookup_us_per_block_cpp"] = res["prefix_hit2048_cpp"] / 127
    return res


# =========================================================================================
# Memory-efficiency simulation (the PagedAttention paper's headline)
# =========================================================================================
def simulate_memory_efficiency(
    num_requests: int = 2000,
    kv_tokens: int = 65536,
    block_size: int = 16,
    max_len: int = 2048,
    seed: int = 0,
) -> dict:
    """Share of KV memory holding real tokens, and batch size, for paged vs contiguous allocation.

    Workload: prompt and output lengths log-normal, fitted to ShareGPT-like chat traces
    (prompt: median 100, mean ~165 tokens, sigma 1.0; output: median 200, mean ~300, sigma 0.9),
    clipped so prompt + output <= max_len. All requests wait at time 0 (an offline batch); FCFS
    admission whenever the allocator can hold the request; each step every running request
    generates one token. Allocators:
      paged       blocks of block_size on demand (admit if the prompt's blocks fit; a request that
                  cannot grow is preempted and re-queued, as vLLM recomputes);
      max         contiguous reservation of max_len per request;
      pow2        contiguous reservation of the next power of two of prompt + output;
      oracle      contiguous reservation of exactly prompt + output (knows the future).
    Averages are taken over the steps during which requests are still waiting (a saturated server).
    Returns, per allocator, the time-averaged share of the *reserved* KV memory that holds real
    tokens ("utilization"), the share of the whole KV memory holding real tokens, and the mean
    and max number of concurrently running requests.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(100), 1.0, num_requests).astype(int), 1, max_len - 1)
    output = np.clip(rng.lognormal(np.log(200), 0.9, num_requests).astype(int), 1, None)
    output = np.minimum(output, max_len - prompt)
    results = {}
    for policy in ("paged", "max", "pow2", "oracle"):
        queue = list(range(num_requests))[::-1]  # pop() = next request
        running: dict[int, int] = {}  # request -> tokens so far
        reserved: dict[int, int] = {}  # request -> reserved token capacity (contiguous) or blocks*bs
        used = 0
        util_sum = real_sum = batch_sum = 0.0
        batch_max = steps = 0
        while queue or running:
            # Admit.
            while queue:
                r = queue[-1]
                if policy == "paged":
                    need = -(-int(prompt[r]) // block_size) * block_size
                elif policy == "max":
                    need = max_len
                elif policy == "pow2":
                    need = 1 << int(np.ceil(np.log2(prompt[r] + output[r])))
                else:
                    need = int(prompt[r] + output[r])
                if used + need > kv_tokens:
                    break
                queue.pop()
                running[r] = int(prompt[r])
                reserved[r] = need
                used += need
            if not running:
                raise ValueError("a single request does not fit in the KV memory")
            # Generate one token each; paged requests grow by a block when needed.
            for r in list(running):
                if r not in running:
                    continue
                running[r] += 1
                if policy == "paged" and running[r] > reserved[r]:
                    while used + block_size > kv_tokens:  # preempt the newest request
                        victim = max(running)
                        used -= reserved.pop(victim)
                        del running[victim]
                        queue.append(victim)
                        if victim == r:
                            break
                    if r in running:
                        reserved[r] += block_size
                        used += block_size
            if queue:  # measure while the system is saturated (requests waiting), not the drain
                real = sum(running.values())
                util_sum += real / used if used else 0.0
                real_sum += real / kv_tokens
                batch_sum += len(running)
                batch_max = max(batch_max, len(running))
                steps += 1
            for r in [r for r, n in running.items() if n >= prompt[r] + output[r]]:
                used -= reserved.pop(r)
                del running[r]
        results[policy] = {
            "utilization": util_sum / steps,
            "real_share_of_memory": real_sum / steps,
            "mean_batch": batch_sum / steps,
            "max_batch": batch_max,
            "saturated_steps": steps,
        }
    results["workload"] = {
        "num_requests": num_requests,
        "kv_tokens": kv_tokens,
        "block_size": block_size,
        "max_len": max_len,
        "prompt_mean": float(prompt.mean()),
        "output_mean": float(output.mean()),
    }
    return results


def main(argv: Optional[list[str]] = None) -> None:
    import argparse
    import json
    import platform

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args(argv)
    bench = run_benchmarks(args.quick)
    sim = simulate_memory_efficiency(num_requests=500 if args.quick else 2000)
    if args.json:
        print(json.dumps({"bench": bench, "simulation": sim}, indent=2))
        return
    print(f"# block manager benchmark ({platform.machine()}, python {platform.python_version()})")
    for k, v in bench.items():
        print(f"{k:40s} {v:12.2f}")
    print("# memory efficiency")
    for k, v in sim.items():
        print(k, {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()})


if __name__ == "__main__":
    main()
