"""Host cost per call, the same script against two builds (A/B): eager decode calls with torch
CUDA tensors (out= and new output), with zero sequences (no launch), a prepared run, CuPy
arrays, and NumPy arrays on the CPU (a real CPU decode of a tiny problem). Works with the
API before and after the options object (no keyword that only one of them has).

    PYTHONPATH=<build> python host_ab.py TAG [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pagedattn
from pagedattn.bench.host_cost import _problem as problem  # the shape host_cost.py times


def median_us(fn, calls, busy=None):
    for _ in range(50):
        fn()
    times = []
    for i in range(calls):
        if busy is not None and i % 50 == 0:
            busy()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    import torch

    rng = np.random.default_rng(0)
    host = problem(rng)
    rows = {}
    busy = lambda: torch.cuda._sleep(2_000_000)  # noqa: E731
    t = {k: torch.from_numpy(v).cuda() for k, v in host.items()}
    args_t = (t["query"], t["key_cache"], t["value_cache"], t["block_tables"], t["seq_lens"])
    out_t = torch.empty_like(t["query"])
    rows["torch eager out="] = median_us(lambda: pagedattn.paged_attention(*args_t, out=out_t), a.calls, busy)
    rows["torch eager new output"] = median_us(lambda: pagedattn.paged_attention(*args_t), a.calls, busy)
    empty = (t["query"][:0], t["key_cache"], t["value_cache"], t["block_tables"][:0], t["seq_lens"][:0])
    out_e = out_t[:0]
    rows["torch eager zero seqs"] = median_us(lambda: pagedattn.paged_attention(*empty, out=out_e), a.calls, busy)
    prep = pagedattn.prepare_decode(*args_t, out=out_t)
    rows["torch prepared run"] = median_us(prep.run, a.calls, busy)
    try:
        import cupy

        c = {k: cupy.asarray(v) for k, v in host.items()}
        out_c = cupy.empty_like(c["query"])
        args_c = (c["query"], c["key_cache"], c["value_cache"], c["block_tables"], c["seq_lens"])
        rows["cupy eager out="] = median_us(lambda: pagedattn.paged_attention(*args_c, out=out_c), a.calls, busy)
    except ImportError:
        pass
    tiny = problem(np.random.default_rng(1))
    tiny["seq_lens"][:] = 0  # no work: conversion and checks only
    args_n = tuple(tiny.values())
    out_n = np.empty_like(tiny["query"])
    rows["numpy eager out=, zero-length seqs"] = median_us(
        lambda: pagedattn.paged_attention(*args_n, out=out_n), a.calls
    )
    rows["numpy eager new output, zero-length seqs"] = median_us(lambda: pagedattn.paged_attention(*args_n), a.calls)
    rows["torch launch for scale (out.zero_())"] = median_us(out_t.zero_, a.calls, busy)
    torch.cuda.synchronize()
    for k, v in rows.items():
        print(f"{a.tag} host: {k} {v:.2f} us")


if __name__ == "__main__":
    main()
