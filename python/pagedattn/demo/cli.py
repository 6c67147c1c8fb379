"""Command line of the serving demo (``python -m pagedattn`` with no subcommand)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from typing import Optional, TextIO

import pagedattn

from .backend import DTYPE_NAMES, find_gpu_library, limit_blas_threads, make_backend
from .checker import AttentionMismatch
from .engine import (
    DEFAULT_NUM_BATCHED_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    ConfigError,
    Engine,
    ServeConfig,
    check_token_budget,
    kv_bytes_per_token,
)
from .model import ModelConfig, check_tensor_parallel
from .report import Progress, format_report, plot_unavailable_reason, plural, summarize, write_plot
from .workload import WorkloadConfig

__all__ = [
    "ArgumentParser", "add_serve_arguments", "serve", "parse_memory", "build_config", "int_in", "float_in",
    "output_file", "MAX_POOL_MB", "MAX_BLOCKS", "MAX_REQUESTS", "MAX_SEED", "MAX_NUM_BATCHED_TOKENS",
    "MAX_TENSOR_PARALLEL", "serve_one",
]  # fmt: skip

DEFAULT_MEMORY = "6MB"
# Bounds of the command line, checked before any work starts.
MAX_POOL_MB = 2**20  # a KV pool (device or host) of at most 1 TiB
MAX_BLOCKS = 2**31 - 1  # block ids are int32
MAX_REQUESTS = 100_000  # the workload is drawn up front: ~100 MB of requests at most
MAX_RATE = 1e6
MAX_BATCH = 65_536
MAX_BLAS_THREADS = 1024
MAX_SEED = 2**63 - 1
MAX_TENSOR_PARALLEL = 1024
MAX_BLOCK_SIZE = int(pagedattn.supported()["cpu_max_block_size"])


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: argument --x: ...`` and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def int_in(lo: int, hi: int):
    """An argparse type: a whole number in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number in [{lo}, {hi}], got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected a whole number in [{lo}, {hi}], got {text}")
        return v

    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False):
    """An argparse type: a finite number in [lo, hi] (or (lo, hi] with lo_open)."""
    where = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {where}, got {text!r}") from None
        if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
            raise argparse.ArgumentTypeError(f"expected a number in {where}, got {text}")
        return v

    return parse


def output_file(text: str) -> str:
    """An argparse type: a file path that can be written (checked now, written after the run)."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; expected a file to write")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


_MEMORY = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(mb|m|mib|blocks|block|b)?\s*")


def _memory_parts(text: str) -> tuple[str, float | int]:
    """('mb', MiB) or ('blocks', count) of a --memory value, bounds checked."""
    m = _MEMORY.fullmatch(text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 4MB, 0.5 or 300blocks, got {text!r}")
    number, unit = m.group(1), m.group(2) or "mb"
    if unit.startswith("b"):
        if "." in number and float(number) != int(float(number)):
            raise argparse.ArgumentTypeError(f"a block count must be whole, got {text!r}")
        count = int(float(number)) if "." in number else int(number)
        if count > MAX_BLOCKS:
            raise argparse.ArgumentTypeError(f"at most {MAX_BLOCKS} blocks, got {text!r}")
        return "blocks", count
    mb = float(number)
    if mb > MAX_POOL_MB:
        raise argparse.ArgumentTypeError(f"at most {MAX_POOL_MB} MB, got {text!r}")
    return "mb", mb


def memory_size(text: str) -> str:
    """An argparse type: a --memory / --cpu-memory value, checked (converted in build_config)."""
    _memory_parts(text)
    return text


def parse_memory(text: str, block_bytes: int) -> int:
    """'4', '4MB', '0.5mb' -> blocks of block_bytes in that many MiB; '300blocks' / '300b' -> 300 blocks.

    Raises argparse.ArgumentTypeError for a malformed size, more than MAX_POOL_MB MiB,
    more than MAX_BLOCKS blocks, or blocks of block_bytes totalling more than MAX_POOL_MB.
    """
    unit, value = _memory_parts(text)
    if unit == "blocks":
        if value * block_bytes > MAX_POOL_MB * 2**20:
            raise argparse.ArgumentTypeError(
                f"{value} blocks of {block_bytes} bytes exceed {MAX_POOL_MB} MB, got {text!r}"
            )
        return int(value)
    return min(int(value * 2**20 // block_bytes), MAX_BLOCKS)


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
    g.add_argument(
        "--requests",
        type=int_in(1, MAX_REQUESTS),
        default=WorkloadConfig.num_requests,
        help=f"number of requests, 1 to {MAX_REQUESTS}",
    )
    g.add_argument(
        "--rate",
        type=float_in(0.0, MAX_RATE, lo_open=True),
        default=WorkloadConfig.rate,
        help=f"mean request arrivals per engine step, in (0, {MAX_RATE:g}]",
    )
    g.add_argument(
        "--memory",
        type=memory_size,
        default=DEFAULT_MEMORY,
        help=f"device KV pool (per rank with --tensor-parallel): MB (e.g. 4, 4MB) or blocks (e.g. 300blocks); "
        f"default {DEFAULT_MEMORY}; "
        f"at most {MAX_POOL_MB} MB and {MAX_BLOCKS} blocks",
    )
    g.add_argument(
        "--cpu-memory",
        type=memory_size,
        default=None,
        help="host pool for swapped-out blocks, same units and bounds (default: 1/8 of --memory; 0 = no swapping)",
    )
    g.add_argument(
        "--block-size",
        type=int_in(1, MAX_BLOCK_SIZE),
        default=16,
        help=f"tokens per KV block, 1 to {MAX_BLOCK_SIZE} on the CPU; on CUDA one of "
        f"{', '.join(map(str, pagedattn.supported()['cuda_block_sizes']))}",
    )
    g.add_argument(
        "--max-batch",
        type=int_in(1, MAX_BATCH),
        default=ServeConfig.max_batch,
        help=f"running sequences at most, 1 to {MAX_BATCH}",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int_in(1, MAX_NUM_BATCHED_TOKENS),
        default=DEFAULT_NUM_BATCHED_TOKENS,
        metavar="N",
        help=f"token budget of one engine step, 1 to {MAX_NUM_BATCHED_TOKENS} and not below --max-batch "
        f"(default {DEFAULT_NUM_BATCHED_TOKENS}): decode tokens first, then prompt chunks; a longer prompt is "
        "split over several steps (chunked prefill)",
    )
    g.add_argument(
        "--preempt",
        choices=["auto", "swap", "recompute"],
        default="auto",
        help="auto: swap while the host pool has room, else recompute",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    g.add_argument(
        "--check",
        type=float_in(0.0, 1.0),
        default=1.0,
        metavar="SHARE",
        help="share of sequences checked against float64 attention at each step (default 1: all)",
    )
    g.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="0 to 2^63 - 1 (default 0)")
    g.add_argument(
        "--blas-threads",
        type=int_in(0, MAX_BLAS_THREADS),
        default=1,
        metavar="N",
        help=f"threads of NumPy's OpenBLAS for the model's small matmuls (default 1; 0 = leave as is; "
        f"at most {MAX_BLAS_THREADS})",
    )
    g.add_argument(
        "--plot", type=output_file, metavar="FILE.png", help="write KV memory in use over time (needs matplotlib)"
    )
    g.add_argument(
        "--json",
        type=output_file,
        metavar="FILE",
        help="write the report (and the memory timeline) as JSON; its folder must exist",
    )
    g.add_argument("--quiet", action="store_true", help="no header and no progress bar: only the report")
    t = p.add_argument_group("tensor parallelism (needs PyTorch: torch.distributed)")
    t.add_argument(
        "--tensor-parallel",
        type=int_in(1, MAX_TENSOR_PARALLEL),
        default=None,
        metavar="N",
        help="serve on N ranks, each holding 1/N of the query heads, its share of the KV heads (replicated when "
        "N exceeds them) and its own KV caches; one all-reduce per layer (NCCL on CUDA, gloo on the CPU), one "
        "metadata broadcast per step from rank 0, which schedules. N must divide the query heads. --memory in MB "
        "is per rank. Also under torchrun: torchrun --nproc-per-node N -m pagedattn --tensor-parallel N",
    )
    t.add_argument(
        "--tp-launch",
        choices=["auto", "spawn", "torchrun"],
        default="auto",
        help="auto: torchrun's processes when started by torchrun (RANK / WORLD_SIZE set), else spawn N local "
        "processes",
    )


def _resolve_device(device: str, gpu_lib: str) -> str:
    if device != "auto":
        return device
    if pagedattn.built_with_cuda() and find_gpu_library(gpu_lib)[0] is not None:
        return "cuda"
    return "cpu"


def block_bytes_of(cfg: ServeConfig) -> int:
    """Bytes of one KV block on one rank (all layers, keys and values)."""
    return kv_bytes_per_token(cfg) * cfg.block_size


def build_config(args: argparse.Namespace) -> ServeConfig:
    dtype = "float16" if args.dtype == "auto" else args.dtype
    model = ModelConfig()
    world = getattr(args, "tensor_parallel", None) or 1
    check_tensor_parallel(model, world)
    probe = ServeConfig(dtype=dtype, block_size=args.block_size, tensor_parallel=world, model=model)
    block_bytes = block_bytes_of(probe)
    try:
        num_blocks = parse_memory(args.memory, block_bytes)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"argument --memory: {e}") from None
    try:
        cpu = parse_memory(args.cpu_memory, block_bytes) if args.cpu_memory is not None else num_blocks // 8
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"argument --cpu-memory: {e}") from None
    if not 0.0 <= args.check <= 1.0:
        raise ConfigError(f"--check must be in [0, 1], got {args.check}")
    cfg = ServeConfig(
        dtype=dtype, block_size=args.block_size, num_blocks=num_blocks, num_cpu_blocks=cpu,
        max_batch=args.max_batch, max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=not args.no_prefix_caching, preempt=args.preempt,
        check_sample=args.check, seed=args.seed, model=model, tensor_parallel=world,
        workload=dataclasses.replace(WorkloadConfig(), num_requests=args.requests, rate=args.rate),
    )  # fmt: skip
    check_token_budget(cfg)  # against --max-batch, before anything is built
    return cfg


def serve(args: argparse.Namespace, out=None, err=None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    if getattr(args, "tensor_parallel", None) is not None:
        from .parallel import serve_parallel  # the only path that imports torch

        return serve_parallel(args, out, err)
    world = os.environ.get("WORLD_SIZE", "1")
    if "RANK" in os.environ and world.strip() not in ("", "0", "1"):  # started by torchrun (or alike)
        print(
            f"error: started by torchrun with WORLD_SIZE={world}: pass --tensor-parallel {world} "
            "(each process would otherwise serve the whole workload on its own)",
            file=err,
        )
        return 2
    return serve_one(args, out, err)


def serve_one(args: argparse.Namespace, out: TextIO, err: TextIO, *, backend=None, tp=None) -> int:
    """Serves and reports in this process: the whole model, or rank 0 of a tensor-parallel
    run (``tp``, its :class:`~pagedattn.demo.replica.Leader`, with the rank's ``backend``)."""
    try:
        cfg = build_config(args)
        device = _resolve_device(args.device, args.gpu_lib) if backend is None else backend.device
        cuda_sizes = pagedattn.supported()["cuda_block_sizes"]
        if device == "cuda" and cfg.block_size not in cuda_sizes:
            raise ConfigError(
                f"argument --block-size: the CUDA kernels take one of {', '.join(map(str, cuda_sizes))}, "
                f"got {cfg.block_size}"
            )
        if backend is None:
            backend = make_backend(device, args.gpu_lib)
        if args.blas_threads > 0:
            limit_blas_threads(args.blas_threads)
        plot_problem = plot_unavailable_reason() if args.plot else None
        if plot_problem:  # refused before the run, not found missing after it
            raise ConfigError(plot_problem)
        progress = None if args.quiet else Progress(args.requests, err)
        engine = Engine(cfg, backend, progress=progress, tp=tp)
    except (ConfigError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=err)
        if tp is not None:
            tp.abort()
        return 2
    except MemoryError:
        pool_mb = (cfg.num_blocks + cfg.num_cpu_blocks) * block_bytes_of(cfg) / 2**20
        print(f"error: cannot allocate the KV pools ({pool_mb:.0f} MB): lower --memory or --cpu-memory", file=err)
        if tp is not None:
            tp.abort()
        return 2
    if not args.quiet:
        mc = cfg.model
        lib = {"numpy": "NumPy", "cupy": "CuPy", "torch": "PyTorch"}[backend.name]
        pool_mb = cfg.num_blocks * block_bytes_of(cfg) / 2**20
        lines = [
            f"pagedattn {pagedattn.__version__} serving demo on {backend.describe()}, {cfg.dtype}",
            f"  model     {mc.describe()}",
            f"            random weights (seed {cfg.seed}, {lib} arrays); all attention paged: one varlen "
            "paged_attention call per layer per step",
            f"  steps     chunked prefill under a budget of {cfg.max_num_batched_tokens} tokens per step: "
            "decode tokens first, then prompt chunks",
        ]
        work = cfg.workload.describe()
        lines += [f"  workload  {work[0]}"] + [f"            {w}" for w in work[1:]]
        per_rank = " per rank" if tp is not None else ""
        lines.append(
            f"  KV pool   {plural(cfg.num_blocks, 'block')} x {plural(cfg.block_size, 'token')} ({pool_mb:.1f} MB"
            f"{per_rank}) on the device, {plural(cfg.num_cpu_blocks, 'block')} on the host for swapping; prefix "
            f"caching {'on' if cfg.prefix_caching else 'off'}; preemption: {cfg.preempt}"
        )
        if tp is not None:
            lines.append(
                f"  parallel  tensor parallel over {plural(tp.shard.world, 'rank')} ({tp.launch}; torch.distributed: "
                f"all-reduce over {tp.comm.backend}, metadata broadcast over gloo): rank 0 holds "
                f"{tp.shard.describe(mc)}; every rank its own KV caches; rank 0 schedules"
            )
        print("\n".join(lines), file=out)
        out.flush()
    try:
        engine.run()
    except AttentionMismatch as e:
        if progress is not None:
            progress.close(engine)
        where = " on rank 0" if tp is not None else ""
        print(f"\nerror: CHECK FAILED{where} at step {engine.step_no}: {e}", file=err)
        return 1
    except ConfigError as e:
        if progress is not None:
            progress.close(engine)
        print(f"\nerror: {e}", file=err)
        return 2
    except RuntimeError as e:
        if tp is None:
            raise
        # A collective failed: another rank is gone (it reported why).
        print(f"\nerror: rank 0 at step {engine.step_no}: {type(e).__name__}: {e}", file=err)
        return 1
    if progress is not None:
        progress.close(engine)
    summary = summarize(engine)
    if not args.quiet:
        print(file=out)  # a blank line between the header and the report
    print(format_report(summary), file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        write_plot(summary, args.plot)
        print(f"wrote {args.plot}", file=out)
    return 0


def main(argv: Optional[list] = None) -> int:
    p = ArgumentParser(prog="python -m pagedattn.demo.cli", description=__doc__.splitlines()[0])
    add_serve_arguments(p)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
