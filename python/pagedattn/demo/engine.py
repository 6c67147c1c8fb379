"""The continuous-batching serving loop.

Each iteration of :meth:`Engine.run`:

1. **Arrivals**: requests whose arrival step has come join the waiting queue.
2. **Decode** every running sequence: if the pool cannot give each of them one more
   slot (``BlockManager.can_append_batch``), preempt the most recently admitted
   sequences until it can: swap them out to the host pool (``swap_out`` +
   ``swap_blocks``) while it has room, else free them for recomputation. Then one
   ``BlockManager.step`` appends each sequence's pending token and exports the block
   tables, lengths, slots and copy-on-write pairs (run with ``copy_blocks``), and the
   model runs one batched ``paged_attention`` per layer. A token is sampled for each
   sequence; sequences that reached their output length are freed.
3. **Swap in** preempted sequences (oldest first) when they fit, before anything new.
4. **Admit** waiting sequences (recomputations first, then new requests, in arrival
   order) while the pool can hold their prompt (``can_allocate``, watermark kept), the
   batch has room and the step's prefill-token budget lasts: ``add_sequence`` reuses
   the longest cached prefix, one ``step`` schedules the rest, the model prefills it
   (``reshape_and_cache`` + dense causal attention) and samples each first token. A
   request asking for n samples is forked n - 1 times right after its prefill.

Nothing is admitted or swapped in during an iteration that preempted (no thrashing).
Every attention output is checked by :class:`~pagedattn.demo.checker.Checker`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional

import numpy as np

import pagedattn

from .backend import Backend
from .checker import Checker
from .kvcache import PagedKVCache
from .model import ModelConfig, TinyDecoder
from .workload import Request, WorkloadConfig, make_workload

__all__ = ["ServeConfig", "Engine", "SeqState", "ConfigError", "itemsize_of"]


class ConfigError(ValueError):
    """Settings that cannot serve the workload (e.g. a pool smaller than one sequence)."""


def itemsize_of(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


@dataclasses.dataclass
class ServeConfig:
    dtype: str = "float16"
    block_size: int = 16
    num_blocks: int = 256  # device KV pool
    num_cpu_blocks: int = 128  # host pool for swapped-out blocks (0: preempt by recomputation only)
    max_batch: int = 128  # running sequences at most
    max_prefill_tokens: int = 2048  # new prompt tokens per iteration (at least one sequence is admitted)
    watermark: float = 0.01
    prefix_caching: bool = True
    preempt: str = "auto"  # auto: swap while the host pool has room, else recompute; or "swap" / "recompute"
    check_sample: float = 1.0  # share of sequences whose outputs are checked at each step
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    workload: WorkloadConfig = dataclasses.field(default_factory=WorkloadConfig)


@dataclasses.dataclass
class SeqState:
    sid: int
    request: Request
    sample: int  # index among the request's samples
    tokens: list  # every token with a cache slot (prompt + appended outputs)
    pending: Optional[int] = None  # sampled, not yet appended (the next decode step's input)
    generated: int = 0  # tokens sampled so far
    forks_left: int = 0  # children to fork after the prefill (n - 1 for a new request)
    state: str = "waiting"  # waiting | running | swapped | finished


class Engine:
    def __init__(
        self,
        cfg: ServeConfig,
        backend: Backend,
        *,
        progress: Optional[Callable[[Engine], None]] = None,
        requests: Optional[list[Request]] = None,
    ) -> None:
        self.cfg = cfg
        self.be = backend
        mc, bs = cfg.model, cfg.block_size
        longest = cfg.workload.max_tokens()
        if longest > mc.max_len:
            raise ConfigError(f"the workload's longest sequence ({longest} tokens) exceeds max_len {mc.max_len}")
        need = -(-mc.max_len // bs)
        reserve = int(cfg.watermark * cfg.num_blocks)
        if cfg.num_blocks < need + reserve + 1:
            raise ConfigError(
                f"a KV pool of {cfg.num_blocks} blocks cannot hold one sequence of the maximum length "
                f"({mc.max_len} tokens = {need} blocks of {bs}, plus a watermark of {reserve}): raise --memory"
            )
        if cfg.max_batch < max(cfg.workload.n_choices):
            most = max(cfg.workload.n_choices)
            raise ConfigError(f"max_batch {cfg.max_batch} is smaller than a request's {most} samples")
        if cfg.preempt not in ("auto", "swap", "recompute"):
            raise ConfigError(f"preempt must be auto, swap or recompute, got {cfg.preempt!r}")
        if cfg.preempt == "swap" and cfg.num_cpu_blocks < need:
            raise ConfigError(f"--preempt swap needs a host pool of at least {need} blocks (one longest sequence)")
        self.manager = pagedattn.BlockManager(
            cfg.num_blocks, bs, enable_prefix_caching=cfg.prefix_caching,
            num_cpu_blocks=cfg.num_cpu_blocks if cfg.preempt != "recompute" else 0, watermark=cfg.watermark,
        )  # fmt: skip
        self.model = TinyDecoder(mc, backend, cfg.dtype, cfg.seed)
        self.kv = PagedKVCache(
            backend, num_layers=mc.num_layers, num_blocks=cfg.num_blocks, num_cpu_blocks=cfg.num_cpu_blocks,
            block_size=bs, num_kv_heads=mc.num_kv_heads, head_size=mc.head_size, dtype=cfg.dtype,
        )  # fmt: skip
        self.checker = Checker(
            backend, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_size=mc.head_size,
            block_size=bs, scale=self.model.scale, dtype=cfg.dtype, sample=cfg.check_sample, seed=cfg.seed,
            prefix_caching=cfg.prefix_caching,
        )  # fmt: skip
        self.requests = requests if requests is not None else make_workload(cfg.workload, mc.vocab, cfg.seed)
        self.sample_rng = np.random.default_rng([cfg.seed, 3])
        self.progress = progress

        self.step_no = 0  # the workload clock: one per iteration
        self.arrived = 0  # requests[:arrived] have arrived
        self.waiting: collections.deque[SeqState] = collections.deque()
        self.running: list[SeqState] = []  # in admission order (the last is preempted first)
        self.swapped: collections.deque[SeqState] = collections.deque()
        self.next_sid = 0
        self.open_samples: dict[int, int] = {}  # request id -> samples not finished
        self.finished_requests = 0

        # Statistics.
        self.generated = 0
        self.prompt_tokens = 0
        self.prefill_computed = 0  # prompt tokens run through the model (hits excluded)
        self.decode_steps = 0
        self.peak_batch = 0
        self.batch_sum = 0
        self.swaps = 0
        self.recomputes = 0
        self.swap_ins = 0
        self.forks = 0
        self.timeline: list[tuple[int, int, int, int, int]] = []  # (step, used blocks, tokens held, logical, seqs)
        self.wall = 0.0

    # -- helpers ------------------------------------------------------------------------
    def _new_seq(self, req: Request, sample: int, tokens: list) -> SeqState:
        s = SeqState(self.next_sid, req, sample, tokens)
        self.next_sid += 1
        return s

    def _sample(self, logits: np.ndarray) -> np.ndarray:
        """Temperature-1 sampling by the Gumbel-max trick: int32 [S]."""
        g = self.sample_rng.gumbel(size=logits.shape)
        return np.argmax(logits.astype(np.float64) + g, axis=-1).astype(np.int32)

    def _finish_if_done(self, s: SeqState) -> bool:
        if s.generated < s.request.output_len:
            return False
        self.manager.free(s.sid)
        self.checker.drop(s.sid)
        s.state = "finished"
        self.open_samples[s.request.rid] -= 1
        if self.open_samples[s.request.rid] == 0:
            self.finished_requests += 1
        return True

    def _record(self, seqs: list[SeqState]) -> None:
        m = self.manager
        for s in seqs:
            if s.state == "running":
                self.checker.record_blocks(s.sid, np.asarray(s.tokens, np.int32), lambda sid=s.sid: m.block_table(sid))

    # -- preemption ---------------------------------------------------------------------
    def _preempt(self, s: SeqState) -> None:
        m = self.manager
        if self.cfg.preempt != "recompute" and m.can_swap_out([s.sid]):
            self.kv.swap_out(m.swap_out([s.sid]))
            s.state = "swapped"
            self.swapped.append(s)
            self.swaps += 1
            return
        if self.cfg.preempt == "swap":
            raise ConfigError("--preempt swap: the host pool is full; raise --cpu-memory or use --preempt auto")
        m.free(s.sid)
        self.checker.drop(s.sid)
        s.state = "waiting"
        self.waiting.appendleft(s)  # recomputed before any new request
        self.recomputes += 1

    # -- phases -------------------------------------------------------------------------
    def _decode(self) -> bool:
        """One decode step for the running batch; returns whether something was preempted."""
        m = self.manager
        preempted = False
        ids = [s.sid for s in self.running]
        while self.running and not m.can_append_batch(ids):
            if len(self.running) == 1:
                raise ConfigError("the KV pool cannot grow even a single running sequence: raise --memory")
            self._preempt(self.running.pop())
            ids.pop()
            preempted = True
        if not self.running:
            return preempted
        batch = self.running
        new = np.fromiter((s.pending for s in batch), np.int32, len(batch))
        md = m.step(ids, new)
        self.kv.copy(md.copy_pairs)  # copy-on-write before anything writes into the copies
        for s, t in zip(batch, new.tolist()):
            s.tokens.append(t)
        positions = md.seq_lens.astype(np.int64) - 1
        self.checker.begin_decode(ids)
        logits = self.model.decode(
            self.kv, new, positions, md.block_tables, md.seq_lens, md.slot_mapping, self.checker.observe
        )
        self.checker.end_step()
        self._record(batch)
        nxt = self._sample(logits)
        self.decode_steps += 1
        self.peak_batch = max(self.peak_batch, len(batch))
        self.batch_sum += len(batch)
        still = []
        for s, t in zip(batch, nxt.tolist()):
            s.pending = t
            s.generated += 1
            self.generated += 1
            if not self._finish_if_done(s):
                still.append(s)
        self.running = still
        return preempted

    def _swap_in(self) -> None:
        m = self.manager
        while self.swapped and len(self.running) < self.cfg.max_batch:
            s = self.swapped[0]
            if not m.can_swap_in([s.sid]):
                break
            self.kv.swap_in(m.swap_in([s.sid]))
            self.swapped.popleft()
            s.state = "running"
            self.running.append(s)
            self.swap_ins += 1

    def _admit(self) -> None:
        m, cfg = self.manager, self.cfg
        budget = cfg.max_prefill_tokens
        batch: list[SeqState] = []
        hits: list[int] = []
        while self.waiting:
            s = self.waiting[0]
            width = max(1, s.forks_left + 1)
            if len(self.running) + len(batch) + width > cfg.max_batch:
                break
            if batch and len(s.tokens) > budget:
                break
            toks = np.asarray(s.tokens, np.int32)
            if not m.can_allocate(toks):
                break
            hit = m.add_sequence(s.sid, toks)
            self.checker.start(s.sid, toks, hit)
            self.waiting.popleft()
            batch.append(s)
            hits.append(hit)
            budget -= len(s.tokens) - hit
        if not batch:
            return
        ids = [s.sid for s in batch]
        md = m.step(ids)
        self.kv.copy(md.copy_pairs)
        qsl = md.query_start_loc
        tokens = np.concatenate([np.asarray(s.tokens[h:], np.int32) for s, h in zip(batch, hits)])
        positions = np.concatenate([np.arange(h, len(s.tokens)) for s, h in zip(batch, hits)])
        tables = [np.asarray(m.block_table(sid), np.int64) for sid in ids]
        self.checker.begin_prefill(ids, np.diff(qsl).tolist())
        logits = self.model.prefill(
            self.kv, tokens, positions, qsl, md.context_lens, tables, md.slot_mapping, self.checker.observe
        )
        self.checker.end_step()
        for s in batch:
            s.state = "running"
            self.running.append(s)
        self._record(batch)
        self.prefill_computed += int(md.num_tokens)
        first = self._sample(logits)
        for i, s in enumerate(batch):
            if s.pending is not None:  # a recomputed sequence keeps the token it had already sampled
                continue
            s.pending = int(first[i])
            s.generated = 1
            self.generated += 1
            children = []
            for j in range(s.forks_left):
                c = self._new_seq(s.request, j + 1, list(s.tokens))
                m.fork(s.sid, c.sid)
                self.checker.fork(s.sid, c.sid)
                c.pending = int(self._sample(logits[i : i + 1])[0])  # its own sample of the same distribution
                c.generated = 1
                c.state = "running"
                self.generated += 1
                self.forks += 1
                children.append(c)
            s.forks_left = 0
            self.running.extend(children)
            for x in [s] + children:
                if self._finish_if_done(x):
                    self.running.remove(x)

    def _sample_memory(self) -> None:
        """Samples the KV pool's real occupancy from the manager (after every iteration)."""
        m, bs = self.manager, self.cfg.block_size
        ids = [s.sid for s in self.running]
        used = m.num_used_blocks
        if ids:
            indptr, indices, last = m.csr(ids)
            fill = np.full(len(indices), bs, np.int64)
            fill[indptr[1:] - 1] = last  # each sequence's last block holds last_page_len tokens
            per_block = np.zeros(m.num_blocks, np.int64)
            per_block[indices] = fill  # a block shared by forks or a cached prefix counts once
            held = int(per_block.sum())
            distinct = int(np.count_nonzero(per_block))
            logical = int(m.seq_lens(ids).sum())
        else:
            held = distinct = logical = 0
        if distinct != used:
            raise RuntimeError(
                f"memory accounting: the running sequences' tables hold {distinct} distinct blocks, "
                f"the manager reports {used} used blocks"
            )
        self.timeline.append((self.step_no, used, held, logical, len(ids)))

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> Engine:
        reqs = self.requests
        limit = 50 * (sum(r.output_len * r.n + len(r.prompt) for r in reqs) + len(reqs)) + 1000
        t0 = time.perf_counter()
        while self.finished_requests < len(reqs):
            if not self.running and not self.waiting and not self.swapped and self.arrived < len(reqs):
                self.step_no = max(self.step_no, reqs[self.arrived].arrival)  # idle: jump to the next arrival
            while self.arrived < len(reqs) and reqs[self.arrived].arrival <= self.step_no:
                r = reqs[self.arrived]
                s = self._new_seq(r, 0, r.prompt.tolist())
                s.forks_left = r.n - 1
                self.waiting.append(s)
                self.open_samples[r.rid] = r.n
                self.prompt_tokens += len(r.prompt)
                self.arrived += 1
            preempted = self._decode()
            if not preempted:
                self._swap_in()
                if not self.swapped:
                    self._admit()
            if not self.running and not self.swapped and self.waiting:
                raise ConfigError(
                    f"sequence {self.waiting[0].sid} ({len(self.waiting[0].tokens)} tokens) cannot be admitted "
                    "into an empty pool: raise --memory"
                )
            self._sample_memory()
            if self.cfg.prefix_caching and self.step_no % 64 == 0:
                self.checker.prune(self.manager.is_cached)
            self.step_no += 1
            if self.progress is not None:
                self.progress(self)
            if self.step_no > limit:
                raise RuntimeError(f"the scheduler made no progress in {limit} iterations")
        self.be.synchronize()
        self.wall = time.perf_counter() - t0
        return self
