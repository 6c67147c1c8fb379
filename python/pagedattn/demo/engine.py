"""The continuous-batching serving loop with chunked prefill.

Every iteration of :meth:`Engine.run` runs at most ONE forward pass (an engine step)
whose rows are scheduled under a token budget, ``ServeConfig.max_num_batched_tokens``
(the ``max_num_batched_tokens`` of vLLM's scheduler):

1. **Arrivals**: requests whose arrival step has come join the waiting queue.
2. **Decode tokens first.** Every running sequence whose prompt is fully computed
   decodes one token. If the pool cannot give each of them one more slot
   (``BlockManager.can_append_batch``), the most recently admitted sequences are
   preempted until it can: swapped out to the host pool (``swap_out`` +
   ``swap_blocks``) while it has room, else freed for recomputation. Their pending
   tokens are appended (``append_tokens_batch``).
3. **Then prompt chunks**, from what the decodes left of the budget: first the
   sequences already part-way through their prompt (in admission order), then new
   admissions (recomputations first, then new requests, in arrival order) while the
   pool can hold the whole prompt (``can_allocate``, watermark kept), the batch has
   room (a request's future forks counted) and budget is left. ``add_sequence`` reuses
   the longest cached prefix, so only the uncached tail is prefilled. A prompt longer
   than what is left is split: its first chunk now, the rest in later steps, each chunk
   attending to the sequence's own cached earlier chunks.
4. **One step**: ``BlockManager.step(ids, query_lens=...)`` schedules the decode rows
   and the chunks together and exports block tables, ``seq_lens``, ``context_lens``,
   ``query_start_loc`` and the slot mapping (plus copy-on-write pairs, run with
   ``copy_blocks``); the model runs one varlen ``paged_attention`` per layer for all
   rows. A token is sampled for every decode and for every prompt whose last chunk ran
   (a request asking for n samples is forked n - 1 times right after that); sequences
   that reached their output length are freed.
5. **Swap in** preempted sequences (oldest first) when they fit; nothing new is
   admitted while any is swapped out.

A sequence preempted part-way through its prompt is swapped like any other (its chunks
resume after the swap-in) or freed for recomputation (its tokens are prefilled again,
in chunks, the full blocks it had computed found in the prefix cache). Nothing is
admitted or swapped in during an iteration that preempted (no thrashing).
Every attention output row is checked by :class:`~pagedattn.demo.checker.Checker`.
:attr:`Engine.step_log` records each step's mix of decode and prefill-chunk tokens.

Tensor parallelism (``tp``, a :class:`~pagedattn.demo.replica.Leader`): the engine runs
on rank 0 only, with the model, KV caches and checker of rank 0's heads. Everything
above (the block manager, the schedule, sampling) stays here; the leader records what
the other ranks must repeat (cache copies and swaps, the checker's bookkeeping) and
sends it with each step's metadata in one broadcast just before the forward pass.
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
from .model import ModelConfig, Shard, StepInputs, TinyDecoder, kv_heads_per_rank
from .workload import Request, WorkloadConfig, make_workload

__all__ = [
    "ServeConfig", "Engine", "SeqState", "StepRecord", "ConfigError", "check_token_budget", "itemsize_of",
    "DEFAULT_NUM_BATCHED_TOKENS", "MAX_NUM_BATCHED_TOKENS", "kv_bytes_per_token", "make_rank_state",
]  # fmt: skip

# The default per-step token budget. 512 bounds the work of a step, and so the delay a
# decoding sequence sees while prompts are prefilled, to 512 rows whatever the prompts'
# lengths: the workload's longest prompt (576 tokens) takes two steps, a typical one
# (~100) shares a step with the decodes. It is 4x the default max_batch, so a full
# decode batch still leaves 384 tokens a step for prompts. Engines on large GPUs use
# 2048 or more, where a step of 2048 rows costs little more than a decode step; on the
# CPU it costs several decode steps.
DEFAULT_NUM_BATCHED_TOKENS = 512
MAX_NUM_BATCHED_TOKENS = 1 << 20  # query rows of one step


class ConfigError(ValueError):
    """Settings that cannot serve the workload (e.g. a pool smaller than one sequence)."""


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step's mix (one forward pass, one paged_attention call per layer)."""

    step: int  # the workload clock at this step
    decode_tokens: int  # rows that decode one token of a sequence past its prompt
    prefill_tokens: int  # rows of prompt chunks
    chunks: int  # prompt chunks (sequences with prefill rows)
    final_chunks: int  # of those, chunks that finish their prompt (a first token is sampled)

    @property
    def mixed(self) -> bool:
        return self.decode_tokens > 0 and self.prefill_tokens > 0


def itemsize_of(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


@dataclasses.dataclass
class ServeConfig:
    dtype: str = "float16"
    block_size: int = 16
    num_blocks: int = 256  # device KV pool
    num_cpu_blocks: int = 128  # host pool for swapped-out blocks (0: preempt by recomputation only)
    max_batch: int = 128  # running sequences at most
    # Tokens (query rows) per step: decodes first, then prompt chunks; at least max_batch.
    max_num_batched_tokens: int = DEFAULT_NUM_BATCHED_TOKENS
    watermark: float = 0.01
    prefix_caching: bool = True
    preempt: str = "auto"  # auto: swap while the host pool has room, else recompute; or "swap" / "recompute"
    check_sample: float = 1.0  # share of sequences whose outputs are checked at each step
    seed: int = 0
    tensor_parallel: int = 1  # ranks sharing the heads (each holds num_blocks blocks of its own heads)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    workload: WorkloadConfig = dataclasses.field(default_factory=WorkloadConfig)


def kv_bytes_per_token(cfg: ServeConfig) -> int:
    """KV cache bytes of one token on one rank (all layers, keys and values, the rank's KV heads)."""
    mc = cfg.model
    return 2 * mc.num_layers * kv_heads_per_rank(mc, cfg.tensor_parallel) * mc.head_size * itemsize_of(cfg.dtype)


def make_rank_state(
    cfg: ServeConfig, backend: Backend, shard: Optional[Shard] = None, comm=None
) -> tuple[TinyDecoder, PagedKVCache, Checker]:
    """The model, KV caches and checker of one rank (all heads when ``shard`` is None):
    built the same way on every rank of a tensor-parallel run."""
    mc = cfg.model
    model = TinyDecoder(mc, backend, cfg.dtype, cfg.seed, shard=shard, comm=comm)
    kv = PagedKVCache(
        backend, num_layers=mc.num_layers, num_blocks=cfg.num_blocks, num_cpu_blocks=cfg.num_cpu_blocks,
        block_size=cfg.block_size, num_kv_heads=model.num_kv_heads, head_size=mc.head_size, dtype=cfg.dtype,
    )  # fmt: skip
    checker = Checker(
        backend, num_layers=mc.num_layers, num_kv_heads=model.num_kv_heads, head_size=mc.head_size,
        block_size=cfg.block_size, scale=model.scale, dtype=cfg.dtype, sample=cfg.check_sample, seed=cfg.seed,
        prefix_caching=cfg.prefix_caching,
    )  # fmt: skip
    return model, kv, checker


def check_token_budget(cfg: ServeConfig) -> None:
    """ConfigError unless ``max_num_batched_tokens`` is a whole number in [max_batch, MAX_NUM_BATCHED_TOKENS]."""
    b = cfg.max_num_batched_tokens
    name = "max_num_batched_tokens (--max-num-batched-tokens)"
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
        raise ConfigError(f"{name} must be a whole number of tokens, got {b!r} ({type(b).__name__})")
    if not 1 <= b <= MAX_NUM_BATCHED_TOKENS:
        raise ConfigError(f"{name} must be in [1, {MAX_NUM_BATCHED_TOKENS}], got {b}")
    if b < cfg.max_batch:
        raise ConfigError(
            f"{name} = {b} is smaller than max_batch (--max-batch) = {cfg.max_batch}: every running sequence "
            "decodes one token per step, so the budget must hold a full batch of decodes"
        )


@dataclasses.dataclass
class SeqState:
    sid: int
    request: Request
    sample: int  # index among the request's samples
    tokens: list  # every token with a cache slot (prompt + appended outputs)
    pending: Optional[int] = None  # sampled, not yet appended (the next decode step's input)
    computed: int = 0  # tokens[:computed] have their K/V in the cache (prefill done when == len(tokens))
    chunks: int = 0  # prompt chunks run since this sequence was last admitted
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
        tp=None,
    ) -> None:
        """``tp``: the :class:`~pagedattn.demo.replica.Leader` of a tensor-parallel run (this
        engine is rank 0), or None for one process holding every head."""
        self.cfg = cfg
        self.be = backend
        self.tp = tp
        mc, bs = cfg.model, cfg.block_size
        check_token_budget(cfg)
        world = tp.shard.world if tp is not None else 1
        if cfg.tensor_parallel != world:
            raise ConfigError(
                f"tensor_parallel = {cfg.tensor_parallel} but the engine runs on {world} rank(s): "
                "a tensor-parallel engine needs the Leader of its process group (pagedattn.demo.replica)"
            )
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
        self.model, self.kv, self.checker = make_rank_state(
            cfg, backend, tp.shard if tp is not None else None, tp.comm if tp is not None else None
        )
        if tp is not None:  # what the other ranks must repeat is recorded for the next broadcast
            self.kv, self.checker = tp.record_kv(self.kv), tp.record_checker(self.checker)
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
        self.decode_steps = 0  # steps with at least one decode row
        self.peak_batch = 0  # most sequences decoded in one step
        self.batch_sum = 0
        self.step_log: list[StepRecord] = []  # one per forward pass
        self.prefill_chunks: list[int] = []  # chunks of every completed prefill (recomputations included)
        self.interrupted_prefills = 0  # prefills preempted for recomputation before their last chunk
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
            self.kv.swap_out(m.swap_out([s.sid]))  # a part-way prefill resumes after its swap-in
            s.state = "swapped"
            self.swapped.append(s)
            self.swaps += 1
            return
        if self.cfg.preempt == "swap":
            raise ConfigError("--preempt swap: the host pool is full; raise --cpu-memory or use --preempt auto")
        m.free(s.sid)
        self.checker.drop(s.sid)
        if s.computed < len(s.tokens):
            self.interrupted_prefills += 1
        s.state = "waiting"
        s.computed = 0
        self.waiting.appendleft(s)  # recomputed before any new request
        self.recomputes += 1

    # -- scheduling -----------------------------------------------------------------------
    def _seats(self) -> int:
        """Places in the batch the running sequences take (a request's forks count from its admission)."""
        return sum(1 + s.forks_left for s in self.running)

    def _decodes(self) -> list[SeqState]:
        return [s for s in self.running if s.computed == len(s.tokens)]

    def _reserve_decodes(self) -> tuple[list[SeqState], bool]:
        """The sequences decoding this step (preempting until each can grow by one slot)
        and whether something was preempted."""
        m = self.manager
        preempted = False
        decodes = self._decodes()
        while decodes and not m.can_append_batch([s.sid for s in decodes]):
            if len(self.running) == 1:
                raise ConfigError("the KV pool cannot grow even a single running sequence: raise --memory")
            self._preempt(self.running.pop())
            preempted = True
            decodes = self._decodes()
        return decodes, preempted

    def _admit(self, budget: int) -> list[tuple[SeqState, int]]:
        """Admits waiting sequences into the budget; returns (sequence, first chunk length) pairs."""
        m, cfg = self.manager, self.cfg
        seats = self._seats()
        chunks = []
        while self.waiting and budget > 0:
            s = self.waiting[0]
            width = 1 + s.forks_left
            if seats + width > cfg.max_batch:
                break
            toks = np.asarray(s.tokens, np.int32)
            if not m.can_allocate(toks):
                if not self.running and not self.swapped:
                    raise ConfigError(
                        f"sequence {s.sid} ({len(toks)} tokens) cannot be admitted into an empty pool: raise --memory"
                    )
                break
            hit = m.add_sequence(s.sid, toks)
            self.checker.start(s.sid, toks, hit)
            self.waiting.popleft()
            s.state, s.computed, s.chunks = "running", hit, 0
            self.running.append(s)
            seats += width
            q = min(len(toks) - hit, budget)
            chunks.append((s, q))
            budget -= q
        return chunks

    def _schedule(self) -> tuple[list[SeqState], list[tuple[SeqState, int]], bool]:
        """This step's decodes (their pending tokens appended), its prompt chunks as
        (sequence, rows) pairs within the token budget, and whether something was preempted."""
        m = self.manager
        decodes, preempted = self._reserve_decodes()
        prefilling = [s for s in self.running if s.computed < len(s.tokens)]
        if decodes:  # their pending tokens get slots now; the step schedules them as one row each
            m.append_tokens_batch(
                np.fromiter((s.sid for s in decodes), np.int64, len(decodes)),
                np.fromiter((s.pending for s in decodes), np.int32, len(decodes)),
            )
            for s in decodes:
                s.tokens.append(s.pending)
        budget = self.cfg.max_num_batched_tokens - len(decodes)
        chunks = []
        for s in prefilling:  # prompts already part-way first, in admission order
            q = min(len(s.tokens) - s.computed, budget)
            if q == 0:
                break
            chunks.append((s, q))
            budget -= q
        if not preempted and not self.swapped:
            chunks += self._admit(budget)
        return decodes, chunks, preempted

    def _step(self) -> bool:
        """Schedules and runs one step; returns whether something was preempted."""
        decodes, chunks, preempted = self._schedule()
        sched = [(s, 1) for s in decodes] + chunks
        if not sched:
            return preempted
        nd = len(decodes)
        # Chunks that end their prompt: a first token is sampled from their last row.
        final_idx = [nd + i for i, (s, q) in enumerate(chunks) if s.computed + q == len(s.tokens)]
        finals = [sched[i][0] for i in final_idx]
        logits = self._forward(sched, nd, final_idx)
        for s, q in sched:
            s.computed += q
        for s, _ in chunks:
            s.chunks += 1
        self._record([s for s, _ in sched])
        prefill_tokens = sum(q for _, q in chunks)
        self.prefill_computed += prefill_tokens
        self.step_log.append(StepRecord(self.step_no, nd, prefill_tokens, len(chunks), len(finals)))
        if nd:
            self.decode_steps += 1
            self.peak_batch = max(self.peak_batch, nd)
            self.batch_sum += nd
        self._take_samples(decodes, finals, logits)
        return preempted

    def _forward(self, sched: list[tuple[SeqState, int]], nd: int, final_idx: list[int]) -> np.ndarray:
        """One BlockManager.step and one forward pass for the scheduled (sequence, rows)
        pairs (the first nd are decodes); returns the logits of the decode rows, then of
        the last row of each sequence in final_idx."""
        m = self.manager
        ids = np.fromiter((s.sid for s, _ in sched), np.int64, len(sched))
        qlens = np.fromiter((q for _, q in sched), np.int64, len(sched))
        md = m.step(ids, query_lens=qlens)
        self.kv.copy(md.copy_pairs)  # copy-on-write before anything writes into the copies
        ctx = md.context_lens.tolist()
        if ctx != [s.computed for s, _ in sched]:
            raise RuntimeError(f"the block manager's context_lens {ctx} disagree with the engine's schedule")
        tokens = np.concatenate([np.asarray(s.tokens[c : c + q], np.int32) for (s, q), c in zip(sched, ctx)])
        positions = np.concatenate([np.arange(c, c + q) for (_, q), c in zip(sched, ctx)])
        qsl = md.query_start_loc
        rows = np.concatenate([qsl[:nd], qsl[np.asarray(final_idx, np.int64) + 1] - 1]).astype(np.int64)
        step = StepInputs(md.block_tables, md.seq_lens, qsl, md.slot_mapping, int(md.max_query_len))
        if self.tp is not None:  # the other ranks get this step (and what led to it) in one broadcast
            self.tp.publish_step(self.step_no, ids, qlens, nd, tokens, positions, step)
        self.checker.begin_step(ids.tolist(), qlens.tolist(), [i < nd for i in range(len(sched))])
        logits = self.model.forward(self.kv, tokens, positions, step, rows, self.checker.observe)
        self.checker.end_step()
        return logits

    def _take_samples(self, decodes: list[SeqState], finals: list[SeqState], logits: np.ndarray) -> None:
        """Samples the next token of every decode and the first of every finished prompt
        (forking multi-sample requests); frees the sequences that are done."""
        m, nd = self.manager, len(decodes)
        sampled = self._sample(logits)
        finished = set()
        for s, t in zip(decodes, sampled[:nd].tolist()):
            s.pending = t
            s.generated += 1
            self.generated += 1
            if self._finish_if_done(s):
                finished.add(s.sid)
        for j, s in enumerate(finals):
            self.prefill_chunks.append(s.chunks)
            if s.pending is not None:  # a recomputed sequence keeps the token it had already sampled
                continue
            s.pending = int(sampled[nd + j])
            s.generated = 1
            self.generated += 1
            children = []
            for k in range(s.forks_left):
                c = self._new_seq(s.request, k + 1, list(s.tokens))
                m.fork(s.sid, c.sid)
                self.checker.fork(s.sid, c.sid)
                c.pending = int(self._sample(logits[nd + j : nd + j + 1])[0])  # its own sample of the same logits
                c.generated = 1
                c.computed = len(c.tokens)
                c.state = "running"
                self.generated += 1
                self.forks += 1
                children.append(c)
            s.forks_left = 0
            self.running.extend(children)
            for x in [s, *children]:
                if self._finish_if_done(x):
                    finished.add(x.sid)
        if finished:
            self.running = [s for s in self.running if s.sid not in finished]

    def _swap_in(self) -> None:
        m = self.manager
        while self.swapped:
            s = self.swapped[0]
            if self._seats() + 1 + s.forks_left > self.cfg.max_batch or not m.can_swap_in([s.sid]):
                break
            self.kv.swap_in(m.swap_in([s.sid]))
            self.swapped.popleft()
            s.state = "running"
            self.running.append(s)
            self.swap_ins += 1

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
        try:
            self._run()
        except ConfigError:  # raised between steps: the other ranks are told to stop
            if self.tp is not None:
                self.tp.abort()
            raise
        if self.tp is not None:
            self.tp.finish()
        return self

    def _run(self) -> None:
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
            preempted = self._step()
            if not preempted:
                self._swap_in()
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
