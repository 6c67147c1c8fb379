"""Block-manager benchmark: pagedattn.BlockManager (C++, through Python) against the pure-Python
reference manager, the scheduler's calls in the shape of a serving engine, and the
memory-efficiency simulation (paged against contiguous allocation).

    python benchmarks/block_manager_bench.py [--quick] [--json] [--only scheduler]

The scheduler rows (run_scheduler_benchmarks) use the shape of an engine with persistent
metadata buffers: 256 running sequences with 512-token prompts, a block table 512 entries
wide (CUDA-graph style, sized for the longest sequence), every decode step writing the block
table, seq_lens, context_lens, query_start_loc and slot_mapping. Rows that need calls an
older build lacks are left out, so the same script times two builds (A/B).

Run it from a checkout against the installed package. The pure-Python baseline is the reference
manager the tests compare the C++ manager with (tests/python/harness/reference_block_manager.py):
the same policies written the way a Python serving engine would write them.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import pagedattn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "python", "harness"))
from reference_block_manager import ReferenceBlockManager  # noqa: E402

__all__ = ["run_benchmarks", "simulate_memory_efficiency"]

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


def _decode_manager(caching: bool, n_seqs: int = 256, prompt: int = 512):
    import numpy as np

    m = pagedattn.BlockManager(32768, 16, enable_prefix_caching=caching)
    rng = np.random.default_rng(0)
    for i in range(n_seqs):
        m.add_sequence(i, rng.integers(0, 32000, prompt).astype(np.int32))
    ids = np.arange(n_seqs, dtype=np.int64)
    m.step(ids)
    return m, ids, rng.integers(0, 32000, n_seqs).astype(np.int32)


def run_scheduler_benchmarks(quick: bool = False) -> dict:
    """A serving engine's calls: the decode step with its metadata (256 x 512 table), admission
    of a 2048-token prompt from each input kind, the cached-prefix peek, batch free / fork.
    Returns a dict of µs (medians of single calls)."""
    import numpy as np

    BlockManager = pagedattn.BlockManager
    steps = 50 if quick else 300
    width = 512
    res = {}
    new_api = hasattr(BlockManager, "step_into")
    for caching in (False, True):
        tag = "cache_on" if caching else "cache_off"
        m, ids, toks = _decode_manager(caching)
        res[f"decode256_w512_step_new_arrays_{tag}"] = _median_us(lambda: m.step(ids, toks, max_blocks=width), steps)  # noqa: B023
        m, ids, toks = _decode_manager(caching)
        exact = dict(block_tables=np.zeros((256, width), np.int32), seq_lens=np.zeros(256, np.int32),
                     context_lens=np.zeros(256, np.int32), query_start_loc=np.zeros(257, np.int32),
                     slot_mapping=np.zeros(256, np.int64))
        res[f"decode256_w512_step_exact_out_{tag}"] = _median_us(lambda: m.step(ids, toks, **exact), steps)  # noqa: B023
        if not new_api:
            continue
        # Persistent buffers sized for a larger batch (512 rows, 8192 tokens): filled up to need.
        persistent = dict(block_tables=np.zeros((512, width), np.int32), seq_lens=np.zeros(512, np.int32),
                          context_lens=np.zeros(512, np.int32), query_start_loc=np.zeros(513, np.int32),
                          slot_mapping=np.zeros(8192, np.int64))
        for name, incremental in (("incremental", True), ("full", False)):
            m, ids, toks = _decode_manager(caching)
            res[f"decode256_w512_step_into_{name}_{tag}"] = _median_us(
                lambda: m.step_into(ids, toks, incremental=incremental, **persistent), steps  # noqa: B023
            )
        m, ids, toks = _decode_manager(caching)
        res[f"decode256_step_into_no_export_{tag}"] = _median_us(lambda: m.step_into(ids, toks), steps)  # noqa: B023

    reps = 20 if quick else 200
    prompt = np.random.default_rng(1).integers(0, 32000, 2048)
    kinds = {"list": prompt.tolist(), "int32": prompt.astype(np.int32), "int64": prompt.astype(np.int64)}
    for kind, arg in kinds.items():
        m = BlockManager(32768, 16)
        counter = iter(range(10**9))
        res[f"alloc2048_{kind}_cache_off"] = _median_us(lambda: m.add_sequence(next(counter), arg), reps)  # noqa: B023
    if new_api:
        m = BlockManager(32768, 16)
        counter = iter(range(10**9))
        res["alloc2048_by_count_cache_off"] = _median_us(lambda: m.add_sequence_by_count(next(counter), 2048), reps)
        m = BlockManager(32768, 16, enable_prefix_caching=True)
        m.add_sequence(0, kinds["int32"])
        m.step([0])
        res["peek_prefix2048_cached_int32"] = _median_us(lambda: m.peek_prefix(kinds["int32"]), reps)
        res["peek_prefix2048_cached_list"] = _median_us(lambda: m.peek_prefix(kinds["list"]), reps)

    # Finishing 64 sequences of 2048 tokens: one call against 64.
    for name in ("free_x64", "free_batch_x64") if new_api else ("free_x64",):
        times = []
        for _ in range(max(5, reps // 10)):
            m = BlockManager(32768, 16)
            for i in range(64):
                m.add_sequence_by_count(i, 2048) if new_api else m.add_sequence(i, kinds["int32"])
            import time

            batch = np.arange(64, dtype=np.int64)
            t0 = time.perf_counter_ns()
            if name == "free_batch_x64":
                m.free_batch(batch)
            else:
                for i in range(64):
                    m.free(i)
            times.append(time.perf_counter_ns() - t0)
        times.sort()
        res[name] = times[len(times) // 2] / 1000.0
    # Forking 8 children of a 33-block sequence (n > 1 sampling): 8 calls against one.
    m = BlockManager(32768, 16)
    m.add_sequence(0, kinds["int32"][:520])
    m.step([0])
    groups = iter([list(range(1 + 8 * j, 9 + 8 * j)) for j in range(reps)])

    def fork_each():
        for c in next(groups):  # noqa: B023
            m.fork(0, c)  # noqa: B023

    res["fork33_x8"] = _median_us(fork_each, reps)
    if new_api:
        m = BlockManager(32768, 16)  # the same state as the row above started from
        m.add_sequence(0, kinds["int32"][:520])
        m.step([0])
        batches = iter([np.arange(10**6 + 8 * j, 10**6 + 8 * j + 8, dtype=np.int64) for j in range(reps)])
        res["fork_batch33_x8"] = _median_us(lambda: m.fork_batch(0, next(batches)), reps)  # noqa: B023
    return res


def run_benchmarks(quick: bool = False) -> dict:
    """Times the C++ manager (through Python) and the pure-Python reference; returns a dict of µs."""
    import numpy as np

    BlockManager = pagedattn.BlockManager

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
    p.add_argument("--only", choices=("scheduler",), help="run only the scheduler rows")
    args = p.parse_args(argv)
    sched = run_scheduler_benchmarks(args.quick)
    if args.only == "scheduler":
        print(json.dumps({"scheduler": sched}, indent=2) if args.json else
              "\n".join(f"{k:44s} {v:12.2f}" for k, v in sched.items()))
        return
    bench = run_benchmarks(args.quick)
    sim = simulate_memory_efficiency(num_requests=500 if args.quick else 2000)
    if args.json:
        print(json.dumps({"bench": bench, "scheduler": sched, "simulation": sim}, indent=2))
        return
    print(f"# block manager benchmark ({platform.machine()}, python {platform.python_version()})")
    for k, v in bench.items():
        print(f"{k:44s} {v:12.2f}")
    print("# scheduler calls")
    for k, v in sched.items():
        print(f"{k:44s} {v:12.2f}")
    print("# memory efficiency")
    for k, v in sim.items():
        print(k, {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()})


if __name__ == "__main__":
    main()
