"""The serving demo's loop on the CPU with small settings: chunked prefill under a token
budget (mixed steps served by one varlen paged_attention per layer, prompts split over
several steps), forks, prefix-cache hits, preemption by swap and by recomputation, the
float64 check catching planted errors (in decode rows and in any row of a prompt
chunk), and the report's step-mix and memory figures against the run's own schedule and
the block manager's own state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pagedattn
from pagedattn.demo import AttentionMismatch, ConfigError, Engine, ModelConfig, ServeConfig, WorkloadConfig
from pagedattn.demo.backend import NumpyBackend, find_gpu_library, make_backend
from pagedattn.demo.engine import DEFAULT_NUM_BATCHED_TOKENS, MAX_NUM_BATCHED_TOKENS
from pagedattn.demo.report import format_report, summarize
from pagedattn.demo.workload import Request, make_workload

SMALL_MODEL = ModelConfig(vocab=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16,
                          d_ff=128, max_len=192)  # fmt: skip
SMALL_WORKLOAD = WorkloadConfig(
    num_requests=24, rate=2.0, system_len=32, system_share=0.8, prompt_median=24, prompt_sigma=0.6,
    prompt_min=4, prompt_max=96, output_median=16, output_sigma=0.6, output_min=4, output_max=64,
    n_choices=(1, 3), n_probs=(0.6, 0.4),
)  # fmt: skip


def small_config(**kw) -> ServeConfig:
    base = dict(dtype="float16", block_size=16, num_blocks=16, num_cpu_blocks=24, max_batch=32, seed=1,
                model=SMALL_MODEL, workload=SMALL_WORKLOAD)  # fmt: skip
    base.update(kw)
    return ServeConfig(**base)


def run(cfg: ServeConfig, **kw) -> Engine:
    return Engine(cfg, NumpyBackend(), **kw).run()


def expected_tokens(e: Engine) -> int:
    return sum(r.output_len * r.n for r in e.requests)


def test_serving_loop_forks_prefix_hits_and_preempts():
    e = run(small_config())
    m = e.manager
    assert e.finished_requests == len(e.requests) == SMALL_WORKLOAD.num_requests
    assert e.generated == expected_tokens(e)
    assert e.forks == sum(r.n - 1 for r in e.requests) > 0
    assert e.kv.blocks_copied > 0  # copy-on-write after the forks went through copy_blocks
    assert e.swaps > 0 and e.recomputes + e.swaps > 0  # a 16-block pool forces preemption
    assert e.swap_ins == e.swaps
    assert m.prefix_cache_stats["hit_tokens"] > 0
    assert e.prefill_computed < e.prompt_tokens  # prefix hits skipped recomputation
    assert e.checker.checked["decode"] > 0 and e.checker.checked["prefill"] > 0
    assert e.checker.checked["decode"] == e.cfg.model.num_layers * sum(r.n * (r.output_len - 1) for r in e.requests)
    # Every prompt row run through the model was checked, in every layer.
    assert e.checker.checked["prefill"] == e.cfg.model.num_layers * e.prefill_computed
    # Everything was given back.
    assert m.num_sequences == 0 and m.num_used_blocks == 0 and m.num_free_cpu_blocks == e.cfg.num_cpu_blocks
    m.check_invariants()
    text = format_report(summarize(e))
    assert f"served {len(e.requests)} requests" in text and "contiguous" in text


def test_preemption_by_recomputation_only():
    e = run(small_config(preempt="recompute", dtype="float32"))
    assert e.recomputes > 0 and e.swaps == 0
    assert e.generated == expected_tokens(e)
    # A recomputed sequence finds its own earlier blocks (and the system prompt) in the cache.
    assert e.manager.prefix_cache_stats["hit_tokens"] > 0


def test_preemption_by_swapping_only():
    e = run(small_config(preempt="swap", num_cpu_blocks=96, dtype="bfloat16" if _has_bf16() else "float16"))
    assert e.swaps > 0 and e.recomputes == 0 and e.swap_ins == e.swaps
    assert e.kv.blocks_swapped_out == e.kv.blocks_swapped_in > 0
    assert e.generated == expected_tokens(e)


def test_no_prefix_caching_recomputes_every_prompt():
    e = run(small_config(prefix_caching=False, num_blocks=64))
    assert e.manager.prefix_cache_stats["hit_tokens"] == 0
    assert e.prefill_computed >= e.prompt_tokens
    assert e.generated == expected_tokens(e)


def _has_bf16() -> bool:
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------
# Chunked prefill: the schedule as the block manager and the kernel see it
# ---------------------------------------------------------------------------------------
class ManagerSpy:
    """Passes every call to the engine's BlockManager and logs the scheduling calls."""

    def __init__(self, manager) -> None:
        self._m = manager
        self.log: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._m, name)

    def add_sequence(self, sid, tokens, **kw):
        hit = self._m.add_sequence(sid, tokens, **kw)
        self.log.append(("add", sid, len(tokens), hit))
        return hit

    def append_tokens_batch(self, ids, tokens):
        slots = self._m.append_tokens_batch(ids, tokens)
        self.log.append(("append", [int(i) for i in ids]))
        return slots

    def step(self, ids, token_ids=None, **kw):
        md = self._m.step(ids, token_ids, **kw)
        qlens = kw.get("query_lens")
        self.log.append(("step", [int(i) for i in ids], None if qlens is None else [int(q) for q in qlens],
                         md.context_lens.tolist(), md.seq_lens.tolist(), md.query_start_loc.tolist()))  # fmt: skip
        return md

    def free(self, sid):
        self._m.free(sid)
        self.log.append(("free", sid))

    def swap_out(self, ids):
        self.log.append(("swap_out", [int(i) for i in ids]))
        return self._m.swap_out(ids)


def replay(log: list[tuple]) -> dict:
    """The step mix and the prefills, recomputed from the manager's call log alone."""
    steps, completed, recomputed, interrupted = [], [], [], 0
    admitted: set = set()  # sids added at least once
    again: set = set()  # sids whose current admission is a recomputation
    remaining: dict[int, int] = {}  # sid -> prompt tokens still to prefill in its current admission
    chunks: dict[int, int] = {}
    decodes: set = set()
    resumed_after_swap = own_chunk_context = 0
    swapped_midway: set = set()
    for ev in log:
        if ev[0] == "add":
            _, sid, n, hit = ev
            remaining[sid], chunks[sid] = n - hit, 0
            if sid in admitted:
                again.add(sid)
            admitted.add(sid)
        elif ev[0] == "append":
            decodes = set(ev[1])
        elif ev[0] == "step":
            _, ids, qlens, ctx, lens, qsl = ev
            assert qlens is not None, "every step passes query_lens"
            assert qsl == [0, *np.cumsum(qlens).tolist()] and [c + q for c, q in zip(ctx, qlens)] == lens
            dec = pre = nchunks = 0
            for sid, q, c in zip(ids, qlens, ctx):
                if sid in decodes:
                    assert q == 1
                    dec += 1
                    continue
                if chunks[sid] > 0:  # a later chunk: its context holds the sequence's earlier chunks
                    assert c > 0
                    own_chunk_context += 1
                if sid in swapped_midway:
                    resumed_after_swap += 1
                    swapped_midway.discard(sid)
                pre += q
                nchunks += 1
                chunks[sid] += 1
                remaining[sid] -= q
                assert remaining[sid] >= 0
                if remaining[sid] == 0:
                    completed.append(chunks.pop(sid))
                    if sid in again:
                        recomputed.append(completed[-1])
                        again.discard(sid)
                    del remaining[sid]
            decodes = set()
            steps.append((dec, pre, nchunks))
        elif ev[0] == "free":
            if remaining.pop(ev[1], 0) > 0:
                interrupted += 1
            chunks.pop(ev[1], None)
        elif ev[0] == "swap_out":
            swapped_midway.update(sid for sid in ev[1] if remaining.get(sid, 0) > 0)
    return dict(steps=steps, completed=completed, recomputed=recomputed, interrupted=interrupted,
                resumed_after_swap=resumed_after_swap, own_chunk_context=own_chunk_context)  # fmt: skip


class AttentionSpy:
    """Wraps pagedattn.paged_attention: the rows, query_start_loc and seq_lens of every call."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple] = []
        real = pagedattn.paged_attention

        def spy(query, key_cache, value_cache, block_tables, seq_lens, **kw):
            qsl = kw.get("query_start_loc")
            self.calls.append((query.shape[0], None if qsl is None else np.asarray(qsl).tolist(),
                               np.asarray(seq_lens).tolist(), kw.get("max_query_len")))  # fmt: skip
            return real(query, key_cache, value_cache, block_tables, seq_lens, **kw)

        monkeypatch.setattr(pagedattn, "paged_attention", spy)


def run_spied(cfg: ServeConfig, monkeypatch, requests=None) -> tuple[Engine, dict, AttentionSpy]:
    attn = AttentionSpy(monkeypatch)
    e = Engine(cfg, NumpyBackend(), requests=requests)
    spy = ManagerSpy(e.manager)
    e.manager = spy
    e.run()
    e.manager = spy._m
    return e, replay(spy.log), attn


def assert_one_call_per_layer_per_step(e: Engine, sched: dict, attn: AttentionSpy) -> None:
    layers = e.cfg.model.num_layers
    assert len(attn.calls) == layers * len(sched["steps"]) == layers * len(e.step_log)
    for i, (dec, pre, _) in enumerate(sched["steps"]):
        for rows, qsl, lens, max_q in attn.calls[i * layers : (i + 1) * layers]:
            assert qsl is not None, "every attention call is the varlen form"
            assert rows == qsl[-1] == dec + pre <= e.cfg.max_num_batched_tokens
            assert max_q == max(np.diff(qsl).tolist())
            assert len(lens) == len(qsl) - 1


def test_small_budget_chunks_prompts_mixes_steps_and_checks_every_row(monkeypatch):
    budget = 16
    cfg = small_config(max_num_batched_tokens=budget, max_batch=16, num_blocks=24)
    e, sched, attn = run_spied(cfg, monkeypatch)
    assert e.finished_requests == len(e.requests) and e.generated == expected_tokens(e)
    assert_one_call_per_layer_per_step(e, sched, attn)
    assert max(len(r.prompt) for r in e.requests) > budget  # prompts longer than a step
    assert max(sched["completed"]) >= 3 and sched["own_chunk_context"] > 0
    assert any(d > 0 and p > 0 for d, p, _ in sched["steps"])  # mixed steps
    # The engine's own log is the manager's schedule, step by step.
    assert [(r.decode_tokens, r.prefill_tokens, r.chunks) for r in e.step_log] == sched["steps"]
    assert e.prefill_chunks == sched["completed"] and e.interrupted_prefills == sched["interrupted"]
    # Every row of every step was checked against float64 attention, in every layer.
    layers = cfg.model.num_layers
    assert e.checker.checked["prefill"] == layers * sum(p for _, p, _ in sched["steps"]) == layers * e.prefill_computed
    assert e.checker.checked["decode"] == layers * sum(d for d, _, _ in sched["steps"])
    e.manager.check_invariants()
    assert e.manager.num_used_blocks == 0

    # The report's step mix, recomputed from the manager's calls.
    mx = summarize(e)["step_mix"]
    dec = np.array([d for d, _, _ in sched["steps"]])
    pre = np.array([p for _, p, _ in sched["steps"]])
    done = np.array(sched["completed"])
    assert mx["token_budget"] == budget and mx["steps"] == len(sched["steps"])
    assert mx["decode_tokens"] == dec.sum() and mx["prefill_chunk_tokens"] == pre.sum() == e.prefill_computed
    assert mx["mixed_steps"] == np.count_nonzero((dec > 0) & (pre > 0)) > 0
    assert mx["decode_only_steps"] == np.count_nonzero((dec > 0) & (pre == 0))
    assert mx["prefill_only_steps"] == np.count_nonzero((dec == 0) & (pre > 0))
    assert mx["mixed_steps"] + mx["decode_only_steps"] + mx["prefill_only_steps"] == mx["steps"]
    assert mx["peak_tokens_per_step"] == (dec + pre).max() <= budget
    assert mx["full_budget_steps"] == np.count_nonzero(dec + pre == budget) > 0
    assert mx["mean_tokens_per_step"] == pytest.approx((dec + pre).mean())
    assert mx["prefills"] == len(done) and mx["prompt_chunks"] == done.sum()
    assert mx["chunked_prefills"] == np.count_nonzero(done > 1) > 0
    assert mx["chunks_per_prefill_max"] == done.max()
    assert mx["chunks_per_prefill_histogram"] == {int(k): int(v) for k, v in zip(*np.unique(done, return_counts=True))}
    assert mx["interrupted_prefills"] == sched["interrupted"]
    text = format_report(summarize(e))
    assert f"budget {budget} tokens: {mx['mixed_steps']} mixed decode + prefill" in text
    assert f"{mx['decode_tokens']} decode + {mx['prefill_chunk_tokens']} prefill-chunk" in text
    assert f"{mx['prompt_chunks']} for {mx['prefills']} prefills" in text


def test_the_default_budget_serves_the_seed_trace(monkeypatch):
    """Two 484-token prompts under a 512-token budget: step 1 = all of A (484) + 28 of B;
    step 2 = A's first decode + B's other 456 tokens over its 28 cached ones; then decodes."""
    model = ModelConfig(vocab=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_size=16, d_ff=32,
                        max_len=496)  # fmt: skip
    rng = np.random.default_rng(7)
    reqs = [Request(i, 0, rng.integers(0, 64, size=484, dtype=np.int32), output_len=3, n=1,
                    shares_system_prompt=False) for i in range(2)]  # fmt: skip
    cfg = small_config(model=model, num_blocks=72, max_batch=8)
    assert cfg.max_num_batched_tokens == DEFAULT_NUM_BATCHED_TOKENS == 512
    e, sched, attn = run_spied(cfg, monkeypatch, requests=reqs)
    assert [(rows, qsl, lens) for rows, qsl, lens, _ in attn.calls] == [
        (512, [0, 484, 512], [484, 28]),
        (457, [0, 1, 457], [485, 484]),
        (2, [0, 1, 2], [486, 485]),
        (1, [0, 1], [486]),  # A generated its 3 tokens; B decodes its third
    ]
    assert sched["steps"] == [(0, 512, 2), (1, 456, 1), (2, 0, 0), (1, 0, 0)]
    assert e.prefill_chunks == [1, 2] and e.checker.checked["prefill"] == 968
    assert e.generated == 6


def test_budget_smaller_than_every_prompt_prefix_hits_and_forks(monkeypatch):
    """A 4-token budget: every prompt is prefilled 4 rows a step; a prompt repeating a
    cached one prefills only its uncached tail; a request of 3 samples forks after its
    last chunk."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, SMALL_MODEL.vocab, size=37, dtype=np.int32)
    reqs = [
        Request(0, 0, shared, output_len=5, n=3, shares_system_prompt=True),
        Request(1, 1, rng.integers(0, SMALL_MODEL.vocab, size=9, dtype=np.int32), output_len=6, n=1,
                shares_system_prompt=False),
        Request(2, 40, np.concatenate([shared, [5, 6, 7, 8, 9]]).astype(np.int32), output_len=4, n=1,
                shares_system_prompt=True),
    ]  # fmt: skip
    cfg = small_config(max_num_batched_tokens=4, max_batch=4, num_blocks=32)
    e, sched, attn = run_spied(cfg, monkeypatch, requests=reqs)
    assert e.generated == 5 * 3 + 6 + 4 and e.forks == 2
    assert_one_call_per_layer_per_step(e, sched, attn)
    # 37 tokens in 4-token chunks: 10 chunks; 9 tokens: 3 (or more when decodes take the budget);
    # request 2 hits the 32 cached tokens of the shared prompt and prefills 42 - 32 = 10.
    assert e.manager.prefix_cache_stats["hit_tokens"] == 32
    assert e.prefill_computed == 37 + 9 + 10
    first, second, third = sched["completed"]
    assert (first, third) == (10, 3) and second >= 3
    assert all(d + p <= 4 for d, p, _ in sched["steps"])
    assert e.checker.checked["prefill"] == SMALL_MODEL.num_layers * 56


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_in_the_middle_of_a_prefill(preempt, monkeypatch):
    """A pool that runs out while long prompts are still being chunked: a part-way
    prefill preempted for recomputation is prefilled again in chunks; one swapped out
    resumes its chunks after the swap-in."""
    cfg = small_config(max_num_batched_tokens=8, max_batch=8, num_blocks=14, num_cpu_blocks=96, preempt=preempt,
                       dtype="float32")  # fmt: skip
    e, sched, attn = run_spied(cfg, monkeypatch)
    assert e.generated == expected_tokens(e)
    if preempt == "recompute":
        assert sched["interrupted"] > 0 and e.interrupted_prefills == sched["interrupted"] and e.swaps == 0
        assert max(sched["recomputed"]) >= 2  # a recomputation prefilled in several chunks
        # Every admission either completed its prefill or was preempted part-way.
        assert len(sched["completed"]) + sched["interrupted"] == len(e.requests) + e.recomputes
    else:
        assert sched["resumed_after_swap"] > 0 and e.recomputes == 0
    assert e.checker.checked["prefill"] == cfg.model.num_layers * e.prefill_computed
    e.manager.check_invariants()


@pytest.mark.parametrize(
    "value, match",
    [
        (0, r"max_num_batched_tokens \(--max-num-batched-tokens\) must be in \[1, "),
        (-3, "must be in"),
        (MAX_NUM_BATCHED_TOKENS + 1, "must be in"),
        (2.5, "must be a whole number of tokens, got 2.5 \\(float\\)"),
        ("512", "must be a whole number of tokens, got '512' \\(str\\)"),
        (True, "must be a whole number"),
        (None, "must be a whole number"),
        (8, r"= 8 is smaller than max_batch \(--max-batch\) = 32"),
    ],
)
def test_invalid_token_budget_is_a_config_error(value, match):
    with pytest.raises(ConfigError, match=match):
        Engine(small_config(max_num_batched_tokens=value), NumpyBackend())


# ---------------------------------------------------------------------------------------
# The check catches planted errors
# ---------------------------------------------------------------------------------------
def test_check_catches_a_wrong_attention_output(monkeypatch):
    real = pagedattn.paged_attention
    calls = {"n": 0}

    def wrong(*args, **kw):
        out = real(*args, **kw)
        calls["n"] += 1
        if calls["n"] == 7:
            out[0, 1, 3] += 0.05  # one element of one head of one sequence, once
        return out

    monkeypatch.setattr(pagedattn, "paged_attention", wrong)
    with pytest.raises(AttentionMismatch, match="decode attention output of sequence"):
        run(small_config())
    assert calls["n"] == 7  # it failed on the very call that was wrong


def test_check_catches_a_wrong_row_inside_a_prompt_chunk(monkeypatch):
    """A row in the middle of a chunk (neither its first nor its last) is checked too."""
    real = pagedattn.paged_attention
    planted = []

    def wrong(*args, **kw):
        out = real(*args, **kw)
        qsl = np.asarray(kw["query_start_loc"])
        long = [i for i, q in enumerate(np.diff(qsl).tolist()) if q >= 5]
        if long and not planted:
            out[int(qsl[long[0]]) + 2, 1, 3] += 0.05
            planted.append(long[0])
        return out

    monkeypatch.setattr(pagedattn, "paged_attention", wrong)
    row_two = r"prefill attention output of sequence \d+ \(row 2 of a \d+-row prompt chunk\)"
    with pytest.raises(AttentionMismatch, match=row_two):
        run(small_config(max_num_batched_tokens=16, max_batch=16, num_blocks=24))
    assert len(planted) == 1


def test_check_catches_a_skipped_copy_on_write(monkeypatch):
    monkeypatch.setattr(pagedattn, "copy_blocks", lambda *a, **k: None)
    with pytest.raises(AttentionMismatch):
        run(small_config(num_blocks=64))


def test_check_catches_a_skipped_swap_in(monkeypatch):
    real = pagedattn.swap_blocks
    state = {"ins": 0}

    def swap(src, dst, mapping, **kw):
        if isinstance(dst, np.ndarray) and dst.shape[0] == 16:  # into the 16-block device pool: a swap-in
            state["ins"] += 1
            return None
        return real(src, dst, mapping, **kw)

    monkeypatch.setattr(pagedattn, "swap_blocks", swap)
    with pytest.raises(AttentionMismatch):
        run(small_config(preempt="swap", num_cpu_blocks=96))
    assert state["ins"] > 0


def test_check_catches_a_corrupted_prefix_cache_block():
    """A prefix-cache hit reads the cached K/V from the paged cache: corrupting an evictable
    cached block between two requests sharing a prompt must fail the next prefill."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, SMALL_MODEL.vocab, size=40, dtype=np.int32)
    reqs = [
        Request(0, 0, prompt, output_len=4, n=1, shares_system_prompt=True),
        Request(1, 30, np.concatenate([prompt, [1, 2, 3]]).astype(np.int32), output_len=4, n=1,
                shares_system_prompt=True),
    ]  # fmt: skip
    corrupted = []

    def hook(e: Engine) -> None:
        if e.finished_requests == 1 and not corrupted:  # request 0's full blocks are cached, held by nobody
            m = e.manager
            for b in range(m.num_blocks):
                if m.is_cached(b) and m.ref_count(b) == 0:
                    e.kv.value[1][b] += np.float16(0.5)
                    corrupted.append(b)

    cfg = small_config(num_blocks=32)
    with pytest.raises(AttentionMismatch, match="prefill attention output of sequence 1"):
        Engine(cfg, NumpyBackend(), progress=hook, requests=reqs).run()
    assert len(corrupted) == 2  # the two full blocks of the 40-token prompt

    # Without the corruption the same run passes and the hit skipped those 32 tokens.
    e = Engine(cfg, NumpyBackend(), requests=reqs).run()
    assert e.manager.prefix_cache_stats["hit_tokens"] == 32
    assert e.prefill_computed == 40 + (43 - 32)


# ---------------------------------------------------------------------------------------
# The report's memory figures come from the manager's real state
# ---------------------------------------------------------------------------------------
def test_memory_utilisation_matches_the_managers_state():
    seen = []

    def naive(e: Engine) -> None:
        m, bs = e.manager, e.cfg.block_size
        fill: dict[int, int] = {}
        logical = 0
        for s in e.running:
            table, n = m.block_table(s.sid), m.seq_len(s.sid)
            logical += n
            for i, b in enumerate(table):
                fill[b] = min(bs, n - i * bs)
        assert len(fill) == m.num_used_blocks
        seen.append((m.num_used_blocks, sum(fill.values()), logical, len(e.running)))
        assert e.timeline[-1][1:] == seen[-1]

    e = run(small_config(), progress=naive)
    assert len(seen) == len(e.timeline) == summarize(e)["iterations"]
    s = summarize(e)
    used = np.array([x[0] for x in seen])
    held = np.array([x[1] for x in seen])
    logical = np.array([x[2] for x in seen])
    seqs = np.array([x[3] for x in seen])
    assert s["paged_utilisation"] == pytest.approx(held.sum() / (used.sum() * e.cfg.block_size))
    assert s["contiguous_utilisation"] == pytest.approx(logical.sum() / (seqs.sum() * SMALL_MODEL.max_len))
    assert s["contiguous_max_batch"] == 16 * 16 // SMALL_MODEL.max_len
    assert s["peak_batch"] <= seqs.max()
    assert 0.5 < s["paged_utilisation"] <= 1.0
    assert s["contiguous_utilisation"] < s["paged_utilisation"]
    assert s["sharing_ratio"] > 1.0  # forks and the system prompt share blocks


# ---------------------------------------------------------------------------------------
# Configuration errors and the workload
# ---------------------------------------------------------------------------------------
def test_pool_smaller_than_one_sequence_is_refused():
    with pytest.raises(ConfigError, match="raise --memory"):
        Engine(small_config(num_blocks=8), NumpyBackend())


def test_workload_distribution_is_reproducible_and_bounded():
    cfg = dataclasses.replace(SMALL_WORKLOAD, num_requests=400)
    a = make_workload(cfg, 64, seed=5)
    b = make_workload(cfg, 64, seed=5)
    assert [r.prompt.tolist() for r in a] == [r.prompt.tolist() for r in b]
    arrivals = [r.arrival for r in a]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert abs(len(a) / (arrivals[-1] + 1) - cfg.rate) < 0.5  # Poisson rate per step
    system = a[[r.shares_system_prompt for r in a].index(True)].prompt[: cfg.system_len]
    for r in a:
        user = len(r.prompt) - (cfg.system_len if r.shares_system_prompt else 0)
        assert cfg.prompt_min <= user <= cfg.prompt_max
        assert cfg.output_min <= r.output_len <= cfg.output_max
        assert r.n in cfg.n_choices
        if r.shares_system_prompt:
            assert np.array_equal(r.prompt[: cfg.system_len], system)
    share = np.mean([r.shares_system_prompt for r in a])
    assert abs(share - cfg.system_share) < 0.1
    outs = np.array([r.output_len for r in a])
    assert abs(np.median(outs) - cfg.output_median) < 4
    assert make_workload(cfg, 64, seed=6)[0].prompt.tolist() != a[0].prompt.tolist()


# ---------------------------------------------------------------------------------------
# GPU: the same loop through CuPy or PyTorch arrays (skipped without a GPU)
# ---------------------------------------------------------------------------------------
def test_serving_loop_with_torch_tensors_on_the_cpu():
    """The backend the GPU path uses, with CPU tensors: strided query views, int32
    query_start_loc and the step's metadata all cross as torch tensors."""
    torch = pytest.importorskip("torch")
    from pagedattn.demo.backend import TorchBackend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: torch's threads beside pagedattn's pool only add contention
    try:
        e = Engine(small_config(max_num_batched_tokens=16, max_batch=16, num_blocks=24), TorchBackend("cpu")).run()
    finally:
        torch.set_num_threads(threads)
    assert e.generated == expected_tokens(e)
    assert e.checker.checked["prefill"] == e.cfg.model.num_layers * e.prefill_computed
    assert any(r.mixed for r in e.step_log) and max(e.prefill_chunks) > 1 and e.swaps > 0


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [512, 16])
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_serving_loop_on_cuda(lib, budget):
    if not pagedattn.built_with_cuda():
        pytest.skip("pagedattn built without CUDA")
    if find_gpu_library(lib)[0] is None:
        pytest.skip(f"{lib} with a CUDA GPU is not available")
    backend = make_backend("cuda", lib)
    e = Engine(small_config(max_num_batched_tokens=budget, max_batch=min(budget, 32)), backend).run()
    assert e.generated == expected_tokens(e)
    assert e.forks > 0 and e.kv.blocks_copied > 0 and e.swaps > 0
    assert e.checker.checked["decode"] > 0
    assert e.checker.checked["prefill"] == e.cfg.model.num_layers * e.prefill_computed
    assert any(r.mixed for r in e.step_log) and (budget > 96 or max(e.prefill_chunks) > 1)
    assert e.manager.num_used_blocks == 0
