"""Command line of the serving demo (``python -m pagedattn`` with no subcommand)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Optional

import pagedattn

from .backend import DTYPE_NAMES, find_gpu_library, limit_blas_threads, make_backend
from .checker import AttentionMismatch
from .engine import ConfigError, Engine, ServeConfig, itemsize_of
from .model import ModelConfig
from .report import Progress, format_report, plot_unavailable_reason, summarize, write_plot
from .workload import WorkloadConfig

__all__ = ["add_serve_arguments", "serve", "parse_memory", "build_config"]

DEFAULT_MEMORY = "6MB"


def parse_memory(text: str, block_bytes: int) -> int:
    """'4', '4MB', '0.5mb' -> blocks of block_bytes in that many MiB; '300blocks' / '300b' -> 300 blocks."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(mb|m|mib|blocks|block|b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 4MB, 0.5 or 300blocks, got {text!r}")
    value, unit = float(m.group(1)), m.group(2) or "mb"
    if unit.startswith("b"):
        if value != int(value):
            raise argparse.ArgumentTypeError(f"a block count must be whole, got {text!r}")
        return int(value)
    return int(value * 2**20 // block_bytes)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving demo")
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda when this build has CUDA and CuPy or PyTorch sees a GPU, else cpu",
    )
    g.add_argument(
        "--gpu-lib",
        choices=["auto", "cupy", "torch"],
        default="auto",
        help="array library on the GPU (auto: CuPy, then PyTorch)",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", *DTYPE_NAMES],
        default="auto",
        help="queries, keys, values and KV cache (auto: float16)",
    )
    g.add_argument("--requests", type=int, default=WorkloadConfig.num_requests, help="number of requests")
    g.add_argument("--rate", type=float, default=WorkloadConfig.rate, help="mean request arrivals per engine step")
    g.add_argument(
        "--memory",
        default=DEFAULT_MEMORY,
        help=f"device KV pool: MB (e.g. 4, 4MB) or blocks (e.g. 300blocks); default {DEFAULT_MEMORY}",
    )
    g.add_argument(
        "--cpu-memory",
        default=None,
        help="host pool for swapped-out blocks, same units (default: 1/8 of --memory; 0 = no swapping)",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-batch", type=int, default=ServeConfig.max_batch, help="running sequences at most")
    g.add_argument(
        "--preempt",
        choices=["auto", "swap", "recompute"],
        default="auto",
        help="auto: swap while the host pool has room, else recompute",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    g.add_argument(
        "--check",
        type=float,
        default=1.0,
        metavar="SHARE",
        help="share of sequences checked against float64 attention at each step (default 1: all)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        metavar="N",
        help="threads of NumPy's OpenBLAS for the model's small matmuls (default 1; 0 = leave as is)",
    )
    g.add_argument("--plot", metavar="FILE.png", help="write KV memory in use over time (needs matplotlib)")
    g.add_argument("--json", metavar="FILE", help="write the report (and the memory timeline) as JSON")
    g.add_argument("--quiet", action="store_true", help="no header and no progress bar: only the report")


def _resolve_device(device: str, gpu_lib: str) -> str:
    if device != "auto":
        return device
    if pagedattn.built_with_cuda() and find_gpu_library(gpu_lib)[0] is not None:
        return "cuda"
    return "cpu"


def build_config(args: argparse.Namespace) -> ServeConfig:
    dtype = "float16" if args.dtype == "auto" else args.dtype
    model = ModelConfig()
    block_bytes = model.kv_bytes_per_token(itemsize_of(dtype)) * args.block_size
    num_blocks = parse_memory(args.memory, block_bytes)
    cpu = parse_memory(args.cpu_memory, block_bytes) if args.cpu_memory is not None else num_blocks // 8
    if not 0.0 <= args.check <= 1.0:
        raise ConfigError(f"--check must be in [0, 1], got {args.check}")
    return ServeConfig(
        dtype=dtype, block_size=args.block_size, num_blocks=num_blocks, num_cpu_blocks=cpu,
        max_batch=args.max_batch, prefix_caching=not args.no_prefix_caching, preempt=args.preempt,
        check_sample=args.check, seed=args.seed, model=model,
        workload=dataclasses.replace(WorkloadConfig(), num_requests=args.requests, rate=args.rate),
    )  # fmt: skip


def serve(args: argparse.Namespace, out=None, err=None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        cfg = build_config(args)
        device = _resolve_device(args.device, args.gpu_lib)
        backend = make_backend(device, args.gpu_lib)
        if args.blas_threads > 0:
            limit_blas_threads(args.blas_threads)
        plot_problem = plot_unavailable_reason() if args.plot else None
        if plot_problem:
            print(f"warning: {plot_problem}; running without the plot", file=err)
        progress = None if args.quiet else Progress(args.requests, err)
        engine = Engine(cfg, backend, progress=progress)
    except (ConfigError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=err)
        return 2
    if not args.quiet:
        mc = cfg.model
        lib = {"numpy": "NumPy", "cupy": "CuPy", "torch": "PyTorch"}[backend.name]
        pool_mb = cfg.num_blocks * cfg.block_size * mc.kv_bytes_per_token(itemsize_of(cfg.dtype)) / 2**20
        lines = [
            f"pagedattn {pagedattn.__version__} serving demo on {backend.describe()}, {cfg.dtype}",
            f"  model     {mc.describe()}",
            f"            random weights (seed {cfg.seed}); prefill attention dense ({lib} matmul, causal mask), "
            "decode attention paged",
        ]
        work = cfg.workload.describe()
        lines += [f"  workload  {work[0]}"] + [f"            {w}" for w in work[1:]]
        lines.append(
            f"  KV pool   {cfg.num_blocks} blocks x {cfg.block_size} tokens ({pool_mb:.1f} MB) on the device, "
            f"{cfg.num_cpu_blocks} blocks on the host for swapping; prefix caching "
            f"{'on' if cfg.prefix_caching else 'off'}; preemption: {cfg.preempt}"
        )
        print("\n".join(lines), file=out)
        out.flush()
    try:
        engine.run()
    except AttentionMismatch as e:
        if progress is not None:
            progress.close(engine)
        print(f"\nerror: CHECK FAILED at step {engine.step_no}: {e}", file=err)
        return 1
    except ConfigError as e:
        if progress is not None:
            progress.close(engine)
        print(f"\nerror: {e}", file=err)
        return 2
    if progress is not None:
        progress.close(engine)
    summary = summarize(engine)
    print(format_report(summary), file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot and not plot_problem:
        write_plot(summary, args.plot)
        print(f"wrote {args.plot}", file=out)
    return 0


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedattn.demo.cli", description=__doc__.splitlines()[0])
    add_serve_arguments(p)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
