"""GPU benchmark of pagedattn's CUDA decode against PyTorch and FlashInfer.

Per shape and implementation:

- GPU time per call: median over many repetitions, timed with CUDA events after a
  warm-up. Before each timed call the L2 cache is evicted by reading a buffer twice its
  size (``--flush write`` writes it instead, which leaves dirty lines the timed call must
  write back), and the call is queued behind a short GPU spin so host overhead stays out.
- Host cost per eager call: wall time of many back-to-back calls from Python, divided by
  their number (the GPU is not waited on).
- Bytes moved (every key and value a sequence owns read once, queries read, outputs
  written), GB/s, and percent of the device-to-device copy bandwidth measured in the
  same run (bytes read + written).

Implementations: ``pagedattn`` (vllm and nhd cache layouts), ``torch`` (gather the pages
then ``scaled_dot_product_attention``) and ``flashinfer`` (paged decode, tensor-core and
CUDA-core variants) when it is installed. Needs torch with CUDA.

Run: ``python -m pagedattn.bench.kernels [--quick] [--json out.json] [--no-flashinfer]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from typing import Any, Callable, Optional

__all__ = ["Shape", "SHAPES", "main", "run"]


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str  # "bfloat16" / "float16"
    block_size: int = 16

    def kv_bytes(self, elem: int) -> int:
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_size * elem


def _suite() -> list[Shape]:
    shapes = []
    for batch in (1, 8, 32, 128):
        for ctx in (1024, 4096, 16384):
            shapes.append(Shape(f"gqa32/8 b{batch} x{ctx}", batch, ctx, 32, 8, 128, "bfloat16"))
    shapes.append(Shape("opt-125m 5x196", 5, 196, 12, 12, 64, "float16"))
    shapes.append(Shape("opt-30b 1x204", 1, 204, 56, 56, 128, "float16"))
    shapes.append(Shape("mha32x128 b64 x2048", 64, 2048, 32, 32, 128, "float16"))
    return shapes


SHAPES = _suite()


class Timer:
    """CUDA-event timing with L2 eviction and a GPU spin in front of each call."""

    def __init__(self, torch: Any, reps: int, warmup: int, flush: str = "read"):
        self.torch = torch
        self.flush_mode = flush
        self.reps = reps
        self.warmup = warmup
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20
        self.flush = torch.zeros(int(2 * l2) // 4 + 1024, dtype=torch.int32, device="cuda")
        # cycles for roughly 30 us of spin at ~2 GHz: long enough to queue the call
        self.spin_cycles = 60_000

    def gpu_us(self, fn: Callable[[], Any]) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            self._evict_l2(i)
            torch.cuda._sleep(self.spin_cycles)
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))

    def _evict_l2(self, i: int) -> None:
        # "read" leaves the L2 full of clean lines (as after the weight reads of a model
        # step); "write" leaves it full of dirty lines, so the timed call also pays for
        # writing ~L2-size bytes back to memory while it reads.
        if self.flush_mode == "write":
            self.flush.fill_(i)
        else:
            self.flush.sum()

    def host_us(self, fn: Callable[[], Any], calls: int = 200) -> float:
        torch = self.torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / calls * 1e6


def copy_bandwidth_gbs(torch: Any, timer: Timer, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    a = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_()
    b = torch.empty_like(a)
    us = timer.gpu_us(functools.partial(b.copy_, a))
    del a, b
    return 2 * nbytes / (us * 1e-6) / 1e9


def _make_inputs(torch: Any, shape: Shape, seed: int):
    import pagedattn

    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, shape.dtype)
    S, H, K, D = shape.batch, shape.num_heads, shape.num_kv_heads, shape.head_size
    B, L = shape.block_size, shape.context
    per_seq = -(-L // B)
    nblocks = S * per_seq
    perm = torch.randperm(nblocks, device="cuda", generator=g).to(torch.int32)
    tables = perm.view(S, per_seq).contiguous()
    lens = torch.full((S,), L, dtype=torch.int32, device="cuda")
    q = torch.randn((S, H, D), dtype=dt, device="cuda", generator=g)
    k_nhd = torch.randn((nblocks, B, K, D), dtype=dt, device="cuda", generator=g)
    v_nhd = torch.randn((nblocks, B, K, D), dtype=dt, device="cuda", generator=g)
    kshape, vshape = pagedattn.kv_cache_shape(nblocks, B, K, D, dt, "vllm")
    x = kshape[-1]
    # the same values in the vllm layout
    k_vllm = k_nhd.view(nblocks, B, K, D // x, x).permute(0, 2, 3, 1, 4).contiguous()
    v_vllm = v_nhd.permute(0, 2, 3, 1).contiguous()
    return dict(q=q, k_nhd=k_nhd, v_nhd=v_nhd, k_vllm=k_vllm, v_vllm=v_vllm, tables=tables, lens=lens,
                nblocks=nblocks, per_seq=per_seq)  # fmt: skip


def _impls(torch: Any, shape: Shape, inp: dict, use_flashinfer: bool) -> dict[str, Callable[[], Any]]:
    import pagedattn

    q, tables, lens = inp["q"], inp["tables"], inp["lens"]
    out = torch.empty_like(q)
    impls: dict[str, Callable[[], Any]] = {}
    ws_size = 0
    for layout in ("vllm", "nhd"):
        ws_size = max(ws_size, pagedattn.decode_workspace_size(
            shape.batch, shape.num_heads, shape.num_kv_heads, shape.head_size, shape.block_size,
            inp["per_seq"], shape.dtype, layout=layout))  # fmt: skip
    ws = torch.empty(max(ws_size, 16), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for layout in ("vllm", "nhd"):
        kc, vc = inp[f"k_{layout}"], inp[f"v_{layout}"]
        impls[f"pagedattn-{layout}"] = (
            lambda kc=kc, vc=vc: pagedattn.paged_attention(
                q, kc, vc, tables, lens, out=out, workspace=ws, stream=stream
            )
        )

    S, H, K, D, L = shape.batch, shape.num_heads, shape.num_kv_heads, shape.head_size, shape.context
    k_nhd, v_nhd = inp["k_nhd"], inp["v_nhd"]
    scale = 1.0 / math.sqrt(D)

    def torch_sdpa():
        k = k_nhd[tables.long()].reshape(S, -1, K, D)[:, :L].transpose(1, 2)  # [S, K, L, D]
        v = v_nhd[tables.long()].reshape(S, -1, K, D)[:, :L].transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, scale=scale, enable_gqa=H != K).squeeze(2)  # fmt: skip

    impls["torch-gather-sdpa"] = torch_sdpa

    if use_flashinfer:
        try:
            import flashinfer  # noqa: F401
        except Exception:  # noqa: BLE001 - optional
            use_flashinfer = False
    if use_flashinfer:
        import flashinfer

        B = shape.block_size
        indptr = torch.arange(0, S + 1, dtype=torch.int32, device="cuda") * inp["per_seq"]
        indices = tables.reshape(-1).contiguous()
        last = torch.full((S,), L - (inp["per_seq"] - 1) * B, dtype=torch.int32, device="cuda")
        fi_ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for tc in (True, False):
            try:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fi_ws, "NHD", use_tensor_cores=tc)
                w.plan(indptr, indices, last, H, K, D, B, q_data_type=q.dtype, kv_data_type=q.dtype)
            except Exception as e:  # noqa: BLE001 - optional peer
                print(f"flashinfer ({'tc' if tc else 'cc'}) unavailable for {shape.name}: {type(e).__name__}: {e}")
                continue
            impls[f"flashinfer-{'tc' if tc else 'cc'}"] = lambda w=w: w.run(q, (k_nhd, v_nhd))
    return impls


def run(shapes: list[Shape], *, reps: int = 50, warmup: int = 5, use_flashinfer: bool = True,
        check: bool = True, log: Callable[[str], None] = print, flush: str = "read") -> dict:  # fmt: skip
    import torch

    import pagedattn

    timer = Timer(torch, reps, warmup, flush)
    copy_gbs = copy_bandwidth_gbs(torch, timer)
    props = torch.cuda.get_device_properties(0)
    result: dict = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "pagedattn": pagedattn.__version__,
        "copy_bandwidth_gbs": copy_gbs,
        "l2_flush": flush,
        "rows": [],
    }
    try:
        import flashinfer

        result["flashinfer"] = flashinfer.__version__
    except Exception:  # noqa: BLE001
        result["flashinfer"] = None
    log(f"{props.name}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    for i, shape in enumerate(shapes):
        # Each shape takes seconds to tens of seconds (inputs, warm-up, timed repetitions
        # for every implementation): say which one is running.
        log(f"[{i + 1}/{len(shapes)}] {shape.name}: {shape.batch} x {shape.context} tokens, "
            f"{shape.num_heads}/{shape.num_kv_heads} heads, d{shape.head_size}, {shape.dtype}")
        inp = _make_inputs(torch, shape, seed=1234 + i)
        elem = torch.finfo(inp["q"].dtype).bits // 8
        nbytes = shape.kv_bytes(elem) + 2 * shape.batch * shape.num_heads * shape.head_size * elem
        impls = _impls(torch, shape, inp, use_flashinfer)
        ref = None
        for name, fn in impls.items():
            row = {"shape": shape.name, "impl": name, "bytes": nbytes, **dataclasses.asdict(shape)}
            try:
                res = fn()
                torch.cuda.synchronize()
                if check:
                    if ref is None:
                        ref = impls["torch-gather-sdpa"]().float()
                    err = (res.float() - ref).abs().max().item()
                    row["max_abs_diff_vs_torch"] = err
                us = timer.gpu_us(fn)
                row["gpu_us"] = us
                row["gbs"] = nbytes / (us * 1e-6) / 1e9
                row["pct_copy_bw"] = 100.0 * row["gbs"] / copy_gbs
                row["host_us"] = timer.host_us(fn, calls=100 if us < 1000 else 10)
            except Exception as e:  # noqa: BLE001 - a failing peer must not stop the run
                row["error"] = f"{type(e).__name__}: {e}"
            result["rows"].append(row)
            msg = (f"{shape.name:24s} {name:20s} " + (f"{row['gpu_us']:9.1f} us {row['gbs']:7.0f} GB/s "
                   f"{row['pct_copy_bw']:5.1f}% host {row['host_us']:6.1f} us" if "gpu_us" in row else row["error"]))
            log(msg)  # fmt: skip
        del inp, impls
        torch.cuda.empty_cache()
    return result


def table(result: dict) -> str:
    """Markdown table: per shape, pagedattn's best layout vs the peers."""
    rows: dict[str, dict[str, dict]] = {}
    for r in result["rows"]:
        rows.setdefault(r["shape"], {})[r["impl"]] = r
    lines = [
        f"Device: {result['device']} ({result['sms']} SMs), {result['date']}, copy bandwidth "
        f"{result['copy_bandwidth_gbs']:.0f} GB/s; torch {result['torch']}, flashinfer {result['flashinfer']}; "
        f"L2 evicted by {result.get('l2_flush', 'write')}ing",
        "",
        "| shape | KV MB | pagedattn vllm us | nhd us | GB/s (best) | % copy bw | host us | torch us | "
        "flashinfer tc us | flashinfer cc us | vs torch | vs flashinfer best |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def us(d: dict, k: str) -> Optional[float]:
        return d.get(k, {}).get("gpu_us")

    def f(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.1f}"

    for shape, d in rows.items():
        ours = [x for x in (us(d, "pagedattn-vllm"), us(d, "pagedattn-nhd")) if x is not None]
        best = min(ours) if ours else None
        best_row = min((d[k] for k in ("pagedattn-vllm", "pagedattn-nhd") if "gpu_us" in d.get(k, {})),
                       key=lambda r: r["gpu_us"], default={})  # fmt: skip
        fi = [x for x in (us(d, "flashinfer-tc"), us(d, "flashinfer-cc")) if x is not None]
        t = us(d, "torch-gather-sdpa")
        any_row = next(iter(d.values()))
        lines.append(
            f"| {shape} | {any_row['bytes'] / 1e6:.0f} | {f(us(d, 'pagedattn-vllm'))} | {f(us(d, 'pagedattn-nhd'))} | "
            f"{best_row.get('gbs', 0):.0f} | {best_row.get('pct_copy_bw', 0):.1f} | {f(best_row.get('host_us'))} | "
            f"{f(t)} | {f(us(d, 'flashinfer-tc'))} | {f(us(d, 'flashinfer-cc'))} | "
            f"{'-' if best is None or t is None else f'{best / t:.2f}'} | "
            f"{'-' if best is None or not fi else f'{best / min(fi):.2f}'} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedattn bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench_kernels.json", help="where to write the results")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of shape names to run")
    ap.add_argument("--flush", choices=("read", "write"), default="read",
                    help="evict L2 before each timed call by reading (default) or writing a buffer twice its size")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("pagedattn bench: needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("pagedattn bench: no CUDA device", file=sys.stderr)
        return 2
    shapes = SHAPES
    if args.quick:
        shapes = [s for s in SHAPES if s.batch in (1, 8) and s.context == 4096] + SHAPES[-3:]
    if args.shapes:
        keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
        shapes = [s for s in shapes if any(k in s.name for k in keys)]
    result = run(shapes, reps=args.reps, warmup=args.warmup, use_flashinfer=not args.no_flashinfer, flush=args.flush,
                 log=functools.partial(print, flush=True))
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    print()
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
