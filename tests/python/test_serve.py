"""The serving demo's loop on the CPU with small settings: forks, prefix-cache hits,
preemption by swap and by recomputation, the float64 check catching planted errors, and
the report's memory figures against the block manager's own state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pagedattn
from pagedattn.demo import AttentionMismatch, ConfigError, Engine, ModelConfig, ServeConfig, WorkloadConfig
from pagedattn.demo.backend import NumpyBackend, find_gpu_library, make_backend
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
@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_serving_loop_on_cuda(lib):
    if not pagedattn.built_with_cuda():
        pytest.skip("pagedattn built without CUDA")
    if find_gpu_library(lib)[0] is None:
        pytest.skip(f"{lib} with a CUDA GPU is not available")
    backend = make_backend("cuda", lib)
    e = Engine(small_config(), backend).run()
    assert e.generated == expected_tokens(e)
    assert e.forks > 0 and e.kv.blocks_copied > 0 and e.swaps > 0
    assert e.checker.checked["decode"] > 0
    assert e.manager.num_used_blocks == 0
