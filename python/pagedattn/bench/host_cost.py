"""Host cost per decode call from Python, on a GPU.

    python -m pagedattn.bench.host_cost [--calls N]

Times the Python-side cost of issuing one decode (argument conversion, validation,
launch) for the seeds' OPT-125m shape, for: eager calls with torch tensors (converted
through the DLPack C exchange table, and through ``__dlpack__`` for arrays that hide the
table), the same call with zero sequences (no launch), an eager call with CuPy arrays, a
PreparedDecode (validated once) run, and for scale one torch kernel launch and the same
torch call with nothing to launch.
Each figure is the median wall time of single calls, issued while the GPU is kept busy
by a long spin so that launches never wait for the device.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pagedattn


def _problem(rng):
    s, h, d, b, length = 5, 12, 64, 16, 196
    nb = s * (-(-length // b))
    kshape, vshape = pagedattn.kv_cache_shape(nb, b, h, d, np.float16)
    return dict(
        query=rng.standard_normal((s, h, d)).astype(np.float16),
        key_cache=rng.standard_normal(kshape).astype(np.float16),
        value_cache=rng.standard_normal(vshape).astype(np.float16),
        block_tables=np.arange(nb, dtype=np.int32).reshape(s, -1),
        seq_lens=np.full(s, length, np.int32),
    )


class _DLPackOnly:
    """An array that offers only the DLPack protocol (its type has no exchange table)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, *args, **kwargs):
        return self.a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def _median_call_us(fn, calls, busy):
    for _ in range(20):
        fn()
    times = []
    for i in range(calls):
        if i % 50 == 0:
            busy()  # keep the GPU busy so the launch queue never blocks
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run(calls: int = 500):
    import torch

    rng = np.random.default_rng(0)
    host = _problem(rng)
    rows = {}
    busy = lambda: torch.cuda._sleep(2_000_000)  # noqa: E731 (a GPU spin of about 1 ms)
    t = {k: torch.from_numpy(v).cuda() for k, v in host.items()}
    out_t = torch.empty_like(t["query"])
    args_t = (t["query"], t["key_cache"], t["value_cache"], t["block_tables"], t["seq_lens"])
    rows["eager, torch tensors, out="] = _median_call_us(
        lambda: pagedattn.paged_attention(*args_t, out=out_t), calls, busy
    )
    rows["eager, torch tensors, new output"] = _median_call_us(lambda: pagedattn.paged_attention(*args_t), calls, busy)
    rows["eager, torch tensors, out=, single pass (one launch)"] = _median_call_us(
        lambda: pagedattn.paged_attention(*args_t, out=out_t, kernel="single_pass"), calls, busy
    )
    # Arrays whose type offers no exchange table go through __dlpack__ (one Python call
    # per array): torch tensors behind a wrapper that offers only the DLPack protocol.
    wrapped = [_DLPackOnly(a) for a in args_t]
    out_w = _DLPackOnly(out_t)
    rows["eager, torch tensors, out=, through __dlpack__"] = _median_call_us(
        lambda: pagedattn.paged_attention(*wrapped, out=out_w), calls, busy
    )
    # Where an eager call's time goes: the same call with zero sequences (array
    # conversion and every check, no launch).
    empty = (t["query"][:0], t["key_cache"], t["value_cache"], t["block_tables"][:0], t["seq_lens"][:0])
    out_empty = out_t[:0]  # sliced once: a torch slice per call would be timed too
    rows["eager, torch tensors, out=, zero sequences (no launch)"] = _median_call_us(
        lambda: pagedattn.paged_attention(*empty, out=out_empty), calls, busy
    )
    rows["for scale: one torch kernel launch (out.zero_())"] = _median_call_us(out_t.zero_, calls, busy)
    # The same torch call on an empty tensor launches nothing: the difference from the row
    # above is what one kernel launch costs on this host.
    rows["for scale: the same torch call, nothing launched"] = _median_call_us(out_empty.zero_, calls, busy)
    prep = pagedattn.prepare_decode(*args_t, out=out_t)
    rows["PreparedDecode.run(), torch tensors"] = _median_call_us(prep.run, calls, busy)
    try:
        import cupy

        c = {k: cupy.asarray(v) for k, v in host.items()}
        out_c = cupy.empty_like(c["query"])
        args_c = (c["query"], c["key_cache"], c["value_cache"], c["block_tables"], c["seq_lens"])
        rows["eager, CuPy arrays, out="] = _median_call_us(
            lambda: pagedattn.paged_attention(*args_c, out=out_c), calls, busy
        )
    except ImportError:
        pass
    torch.cuda.synchronize()
    # The prepared run computed the same thing as the eager call.
    ref = pagedattn.paged_attention(*args_t)
    prep.run()
    torch.cuda.synchronize()
    assert torch.equal(ref, out_t), "PreparedDecode.run() differs from the eager call"
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedattn.bench.host_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args(argv)
    rows = run(args.calls)
    for name, us in rows.items():
        print(f"{name:52s} {us:7.2f} us/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
