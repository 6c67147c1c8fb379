"""The cost of the attention variants on the GPU (CUDA decode), against the plain call.

Rows:

- sliding window: a 4096-token window over 32k contexts against a plain 4096-token
  context, same batch and heads (target: within 15%; the window's time follows W, not
  the context), and the same for a 1024-token window over 16k;
- soft cap and sinks: soft_cap=30, sinks [H], and both, on the GQA decode shapes of the
  kernel benchmark, against the plain call on the same inputs (target: within 3%).

Times are CUDA-event medians with the L2 evicted before every call and the call queued
behind a short GPU spin (the kernel benchmark's Timer, python/pagedattn/bench/kernels.py,
whose inputs this reuses). Needs torch with CUDA.

    python benchmarks/variants_bench.py [--json variants.json] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import torch

import pagedattn
from pagedattn.bench.kernels import SHAPES, Shape, Timer, _make_inputs

WINDOW_ROWS = [  # (window, long context, batch)
    (4096, 32768, 1),
    (4096, 32768, 8),
    (4096, 32768, 32),
    (1024, 16384, 8),
]


def decode_call(inp: dict, layout: str, **kw):
    """A plain paged_attention decode over the inputs of _make_inputs, with options kw."""
    q = inp["q"]
    out = torch.empty_like(q)
    kc, vc = inp[f"k_{layout}"], inp[f"v_{layout}"]
    return lambda: pagedattn.paged_attention(q, kc, vc, inp["tables"], inp["lens"], out=out, **kw)


def window_rows(timer: Timer, layout: str, quick: bool, log) -> list[dict]:
    rows = []
    for i, (w, ctx, batch) in enumerate(WINDOW_ROWS[:2] if quick else WINDOW_ROWS):
        long_shape = Shape(f"gqa32/8 b{batch} x{ctx}", batch, ctx, 32, 8, 128, "bfloat16")
        short_shape = dataclasses.replace(long_shape, name=f"gqa32/8 b{batch} x{w}", context=w)
        long_inp = _make_inputs(torch, long_shape, seed=100 + i)
        windowed = timer.gpu_us(decode_call(long_inp, layout, sliding_window=w))
        full = timer.gpu_us(decode_call(long_inp, layout))
        del long_inp
        torch.cuda.empty_cache()
        short = timer.gpu_us(decode_call(_make_inputs(torch, short_shape, seed=200 + i), layout))
        row = dict(kind="window", layout=layout, window=w, context=ctx, batch=batch, windowed_us=windowed,
                   plain_window_context_us=short, full_context_us=full, ratio=windowed / short,
                   target=1.15)  # fmt: skip
        rows.append(row)
        log(f"window {w:5d} over {ctx:5d} b{batch:<3d} {layout}: {windowed:8.1f} us; plain x{w}: {short:8.1f} us "
            f"(x{row['ratio']:.3f}); whole context: {full:8.1f} us")  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def cap_and_sink_rows(timer: Timer, layout: str, quick: bool, log) -> list[dict]:
    rows = []
    shapes = [s for s in SHAPES if s.name.startswith("gqa")]
    if quick:
        shapes = [s for s in shapes if s.context == 4096 and s.batch in (1, 32)]
    for i, shape in enumerate(shapes):
        inp = _make_inputs(torch, shape, seed=300 + i)
        sinks = torch.randn(shape.num_heads, dtype=torch.float32, device="cuda")
        plain = timer.gpu_us(decode_call(inp, layout))
        variants = {
            "soft_cap": dict(soft_cap=30.0),
            "sinks": dict(sinks=sinks),
            "soft_cap+sinks": dict(soft_cap=30.0, sinks=sinks),
        }
        for name, kw in variants.items():
            us = timer.gpu_us(decode_call(inp, layout, **kw))
            rows.append(dict(kind=name, layout=layout, shape=shape.name, us=us, plain_us=plain, ratio=us / plain,
                             target=1.03))  # fmt: skip
            log(f"{shape.name:22s} {layout} {name:15s} {us:8.1f} us; plain {plain:8.1f} us (x{us / plain:.3f})")
        del inp
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | shape | layout | us | plain us | ratio | target |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "window":
            shape = f"W={r['window']} over {r['context']}, b{r['batch']} (plain: x{r['window']})"
            us, base = r["windowed_us"], r["plain_window_context_us"]
        else:
            shape, us, base = r["shape"], r["us"], r["plain_us"]
        ok = "ok" if r["ratio"] <= r["target"] else "OVER"
        lines.append(f"| {r['kind']} | {shape} | {r['layout']} | {us:.1f} | {base:.1f} | {r['ratio']:.3f} | "
                     f"{r['target']:.2f} {ok} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench_variants.json")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layouts", default="vllm,nhd")
    ap.add_argument("--quick", action="store_true", help="a few rows only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not pagedattn.built_with_cuda():
        print("variants_bench: needs a CUDA device and pagedattn built with CUDA", file=sys.stderr)
        return 2
    timer = Timer(torch, args.reps, args.warmup)
    log = functools.partial(print, flush=True)
    rows = []
    for layout in args.layouts.split(","):
        rows += window_rows(timer, layout, args.quick, log)
        rows += cap_and_sink_rows(timer, layout, args.quick, log)
    result = dict(device=torch.cuda.get_device_properties(0).name, pagedattn=pagedattn.__version__, rows=rows)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    print()
    print(table(rows))
    return 0 if all(r["ratio"] <= r["target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
