"""fp8 against bf16 KV caches in CUDA decode: time, GB/s and the fp8 / bf16 speedup on the
GQA decode shapes (32 query / 8 KV heads, d128) whose bf16 KV is 512 MB, 1 GB and 2 GB,
with FlashInfer's bf16 and fp8 decode beside them when flashinfer is importable.

    python benchmarks/fp8_decode_bench.py [--json fp8_decode.json] [--reps 50] [--shapes x4096]

Timing is pagedattn.bench.kernels' (CUDA events after a warm-up, L2 evicted before each
timed call, median). Both caches hold the same values: the bf16 cache is the fp8 one
dequantized (a power-of-two scale, so exact in bf16), so the outputs must agree closely
and the speedup compares like with like. An fp8 cache moves half the bytes: the target is
a speedup of 1.9x or more on these shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Callable, Optional

from pagedattn.bench.kernels import Shape, Timer, _make_inputs, copy_bandwidth_gbs

TARGET = 1.9


def shapes() -> list[Shape]:
    """bf16 KV of 2 * batch * context * 8 * 128 * 2 bytes: 512 MB, 1 GB, 2 GB, as many
    sequences of 4096 tokens and as fewer sequences of 16384."""
    out = []
    for ctx in (4096, 16384):
        for mb in (512, 1024, 2048):
            batch = mb * 2**20 // (2 * ctx * 8 * 128 * 2)
            out.append(Shape(f"gqa32/8 b{batch} x{ctx} ({mb} MB bf16)", batch, ctx, 32, 8, 128, "bfloat16"))
    return out


def _fp8_caches(torch: Any, inp: dict, shape: Shape) -> dict:
    """fp8_e4m3 caches (both layouts) of the same values; the bf16 caches are overwritten
    with their exact dequantized values."""
    import pagedattn

    n, b, k, d = inp["k_nhd"].shape
    out: dict = {}
    for name in ("k", "v"):
        wide = inp[f"{name}_nhd"]
        amax = wide.abs().max().item()
        scale = 2.0 ** math.ceil(math.log2(amax / 448.0))
        codes = torch.empty(wide.shape, dtype=torch.uint8, device="cuda")
        pagedattn.quantize_fp8(wide, codes, scale=scale, fp8_dtype="fp8_e4m3")
        pagedattn.dequantize_fp8(codes, wide, scale=scale, fp8_dtype="fp8_e4m3")
        out[f"{name}_scale"] = scale
        out[f"{name}_nhd"] = codes
    xb = inp["k_vllm"].shape[-1]  # bf16 vllm key chunk (8); fp8 uses 16
    inp["k_vllm"].copy_(inp["k_nhd"].view(n, b, k, d // xb, xb).permute(0, 2, 3, 1, 4))
    inp["v_vllm"].copy_(inp["v_nhd"].permute(0, 2, 3, 1))
    kshape, _ = pagedattn.kv_cache_shape(n, b, k, d, "fp8_e4m3", "vllm")
    x8 = kshape[-1]
    out["k_vllm"] = out["k_nhd"].view(n, b, k, d // x8, x8).permute(0, 2, 3, 1, 4).contiguous()
    out["v_vllm"] = out["v_nhd"].permute(0, 2, 3, 1).contiguous()
    return out


_UNAVAILABLE: dict[str, str] = {}  # FlashInfer paths that failed (a JIT build is not retried)


def _impls(torch: Any, shape: Shape, inp: dict, fp8: dict, use_flashinfer: bool) -> dict[str, Callable[[], Any]]:
    import pagedattn

    q, tables, lens = inp["q"], inp["tables"], inp["lens"]
    out = torch.empty_like(q)
    stream = torch.cuda.current_stream().cuda_stream
    ws_size = max(
        pagedattn.decode_workspace_size(shape.batch, shape.num_heads, shape.num_kv_heads, shape.head_size,
                                        shape.block_size, inp["per_seq"], shape.dtype, layout=layout,
                                        kv_cache_dtype=kind)
        for layout in ("vllm", "nhd") for kind in ("auto", "fp8_e4m3")
    )  # fmt: skip
    ws = torch.empty(max(ws_size, 16), dtype=torch.uint8, device="cuda")
    impls: dict[str, Callable[[], Any]] = {}
    for layout in ("vllm", "nhd"):
        kc, vc = inp[f"k_{layout}"], inp[f"v_{layout}"]
        impls[f"pagedattn-{layout}-bf16"] = lambda kc=kc, vc=vc: pagedattn.paged_attention(
            q, kc, vc, tables, lens, out=out, workspace=ws, stream=stream)  # fmt: skip
        kc8, vc8 = fp8[f"k_{layout}"], fp8[f"v_{layout}"]
        impls[f"pagedattn-{layout}-fp8"] = lambda kc=kc8, vc=vc8: pagedattn.paged_attention(
            q, kc, vc, tables, lens, out=out, workspace=ws, stream=stream, kv_cache_dtype="fp8_e4m3",
            k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])  # fmt: skip
    if not use_flashinfer:
        return impls
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - optional peer
        print("flashinfer is not importable: its columns stay empty")
        return impls
    S, H, K, D = shape.batch, shape.num_heads, shape.num_kv_heads, shape.head_size
    L, B = shape.context, shape.block_size
    indptr = torch.arange(0, S + 1, dtype=torch.int32, device="cuda") * inp["per_seq"]
    indices = tables.reshape(-1).contiguous()
    last = torch.full((S,), L - (inp["per_seq"] - 1) * B, dtype=torch.int32, device="cuda")
    fi_ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    e4m3 = torch.float8_e4m3fn
    caches = {
        "bf16": (inp["k_nhd"], inp["v_nhd"], {}),
        "fp8": (fp8["k_nhd"].view(e4m3), fp8["v_nhd"].view(e4m3), dict(k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])),
    }  # fmt: skip
    for kind, (kc, vc, scales) in caches.items():
        for tc in (True, False):
            name = f"flashinfer-{'tc' if tc else 'cc'}-{kind}"
            if name in _UNAVAILABLE:  # its JIT build failed on an earlier shape: not tried again
                print(f"{name} unavailable for {shape.name}: {_UNAVAILABLE[name]}")
                continue
            try:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fi_ws, "NHD", use_tensor_cores=tc)
                w.plan(indptr, indices, last, H, K, D, B, q_data_type=q.dtype, kv_data_type=kc.dtype)
                w.run(q, (kc, vc), **scales)
            except Exception as e:  # noqa: BLE001 - a failing peer must not stop the run
                print(f"{name} unavailable for {shape.name}: {type(e).__name__}: {str(e)[:300]}")
                _UNAVAILABLE[name] = f"{type(e).__name__} on an earlier shape"
                continue
            impls[name] = lambda w=w, kc=kc, vc=vc, scales=scales: w.run(q, (kc, vc), **scales)
    return impls


def run(selected: list[Shape], reps: int, warmup: int, use_flashinfer: bool) -> dict:
    import torch

    import pagedattn

    timer = Timer(torch, reps, warmup)
    copy_gbs = copy_bandwidth_gbs(torch, timer)
    props = torch.cuda.get_device_properties(0)
    try:
        import flashinfer

        fi_version: Optional[str] = flashinfer.__version__
    except Exception:  # noqa: BLE001
        fi_version = None
    result: dict = dict(device=props.name, sms=props.multi_processor_count, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                        torch=torch.__version__, pagedattn=pagedattn.__version__, flashinfer=fi_version,
                        copy_bandwidth_gbs=copy_gbs, target_speedup=TARGET, rows=[])  # fmt: skip
    print(f"{props.name}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    for i, shape in enumerate(selected):
        print(f"[{i + 1}/{len(selected)}] {shape.name}")
        inp = _make_inputs(torch, shape, seed=4321 + i)
        fp8 = _fp8_caches(torch, inp, shape)
        impls = _impls(torch, shape, inp, fp8, use_flashinfer)
        qo = 2 * shape.batch * shape.num_heads * shape.head_size * 2  # bf16 query read, output written
        ref = None
        for name, fn in impls.items():
            elem = 1 if name.endswith("fp8") else 2
            row: dict = dict(shape=shape.name, impl=name, bytes=shape.kv_bytes(elem) + qo, batch=shape.batch,
                             context=shape.context, kv_mb_bf16=shape.kv_bytes(2) / 2**20)  # fmt: skip
            try:
                res = fn().float()
                torch.cuda.synchronize()
                if ref is None:
                    ref = res.clone()  # pagedattn vllm bf16: the same values as every other cache
                row["max_abs_diff_vs_bf16"] = (res - ref).abs().max().item()
                us = timer.gpu_us(fn)
                row["gpu_us"] = us
                row["gbs"] = row["bytes"] / (us * 1e-6) / 1e9
                row["pct_copy_bw"] = 100.0 * row["gbs"] / copy_gbs
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
            result["rows"].append(row)
            print(f"  {name:24s} " + (f"{row['gpu_us']:9.1f} us {row['gbs']:6.0f} GB/s "
                  f"diff {row['max_abs_diff_vs_bf16']:.2e}" if "gpu_us" in row else row["error"]))  # fmt: skip
        del inp, fp8, impls
        torch.cuda.empty_cache()
    return result


def table(result: dict) -> str:
    by: dict[str, dict[str, dict]] = {}
    for r in result["rows"]:
        by.setdefault(r["shape"], {})[r["impl"]] = r

    def us(d: dict, k: str) -> Optional[float]:
        return d.get(k, {}).get("gpu_us")

    def f(v: Optional[float], fmt: str = ".1f") -> str:
        return "-" if v is None else format(v, fmt)

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or b is None else a / b

    lines = [
        f"Device: {result['device']} ({result['sms']} SMs), {result['date']}, copy bandwidth "
        f"{result['copy_bandwidth_gbs']:.0f} GB/s; torch {result['torch']}, flashinfer {result['flashinfer']}. "
        f"Speedup = bf16 us / fp8 us (target {result['target_speedup']}x).",
        "",
        "| shape | layout | bf16 us | bf16 GB/s | fp8 us | fp8 GB/s | fp8 speedup | FI bf16 us | FI fp8 us | "
        "FI fp8 speedup | fp8 vs FI fp8 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape, d in by.items():
        fi_b = min((x for x in (us(d, "flashinfer-tc-bf16"), us(d, "flashinfer-cc-bf16")) if x), default=None)
        fi_8 = min((x for x in (us(d, "flashinfer-tc-fp8"), us(d, "flashinfer-cc-fp8")) if x), default=None)
        for layout in ("vllm", "nhd"):
            b, e = d.get(f"pagedattn-{layout}-bf16", {}), d.get(f"pagedattn-{layout}-fp8", {})
            sp = ratio(b.get("gpu_us"), e.get("gpu_us"))
            mark = "" if sp is None else (" ok" if sp >= result["target_speedup"] else " BELOW")
            lines.append(
                f"| {shape} | {layout} | {f(b.get('gpu_us'))} | {f(b.get('gbs'), '.0f')} | {f(e.get('gpu_us'))} | "
                f"{f(e.get('gbs'), '.0f')} | {f(sp, '.2f')}{mark} | {f(fi_b)} | {f(fi_8)} | "
                f"{f(ratio(fi_b, fi_8), '.2f')} | {f(ratio(fi_8, e.get('gpu_us')), '.2f')} |"
            )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="fp8_decode.json", help="where to write the results")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--shapes", default="", help="comma-separated substrings of shape names to run")
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("fp8_decode_bench: needs torch with CUDA", file=sys.stderr)
        return 2
    import pagedattn

    if not torch.cuda.is_available() or not pagedattn.built_with_cuda():
        print("fp8_decode_bench: needs a CUDA device and pagedattn built with CUDA", file=sys.stderr)
        return 2
    selected = shapes()
    if args.shapes:
        keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
        selected = [s for s in selected if any(k in s.name for k in keys)]
    result = run(selected, args.reps, args.warmup, not args.no_flashinfer)
    print()
    print(table(result))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
