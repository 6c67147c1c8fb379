"""``python -m pagedattn`` (or the ``pagedattn`` console script): serve a continuous-batching
workload end to end (the main job).

Commands:
  (none), serve  the serving demo: a tiny transformer with random weights served by a
                  continuous-batching loop on pagedattn (block manager, reshape_and_cache,
                  paged_attention, copy_blocks, swap_blocks), every attention output
                  checked against float64; prints a report. ``--help`` lists its options.
                  ``--tensor-parallel N`` serves on N ranks through torch.distributed (N spawned
                  processes, or under ``torchrun --nproc-per-node N -m pagedattn``).
  bench           the kernel benchmark: pagedattn.bench.kernels on a GPU, else
                  pagedattn.bench.cpu_decode (CPU path against a NumPy baseline);
                  ``--plot FILE.png`` adds GB/s against context length.
  selfcheck       decode two realistic shapes, check them against float64, print throughput.

Options (no command):
  --cmake-dir     print the folder to pass as pagedattn_DIR to CMake and exit
  --include-dir   print the C++ include folder and exit
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

import numpy as np

import pagedattn
from pagedattn.reference import paged_attention_ref


def _prog() -> str:
    """How the user ran us: the `pagedattn` console script, or `python -m pagedattn`."""
    return "pagedattn" if os.path.basename(sys.argv[0] or "") == "pagedattn" else "python -m pagedattn"


def _cuda_lib():
    """(name, module) of the first installed array library that sees a CUDA GPU, else (None, None)."""
    from pagedattn.demo.backend import find_gpu_library

    name, _ = find_gpu_library()
    return (name, importlib.import_module(name)) if name else (None, None)


def _random_problem(rng, num_seqs, num_heads, num_kv_heads, head_size, block_size, seq_len, dtype):
    max_blocks = -(-seq_len // block_size)
    num_blocks = num_seqs * max_blocks + 4
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype)
    key_cache = rng.standard_normal(kshape).astype(dtype)
    value_cache = rng.standard_normal(vshape).astype(dtype)
    query = rng.standard_normal((num_seqs, num_heads, head_size)).astype(dtype)
    perm = rng.permutation(num_blocks)[: num_seqs * max_blocks]
    block_tables = perm.reshape(num_seqs, max_blocks).astype(np.int32)
    seq_lens = np.full(num_seqs, seq_len, dtype=np.int32)
    return query, key_cache, value_cache, block_tables, seq_lens


def run_demo(device: str, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    shapes = [
        ("OPT-125m-like: 5 seqs x 196 tokens, 12 heads, head size 64", (5, 12, 12, 64, 16, 196)),
        ("grouped-query 32/8 heads, head size 128: 16 seqs x 4096 tokens", (16, 32, 8, 128, 16, 4096)),
    ]
    lib_name, lib = (None, None)
    if device == "cuda":
        lib_name, lib = _cuda_lib()
        if lib is None:
            print("error: --device cuda needs CuPy or torch with a visible GPU", file=sys.stderr)
            return 2
    print(
        f"pagedattn {pagedattn.__version__}: device {device}"
        + (f" (arrays through {lib_name})" if lib_name else f" ({pagedattn._core.num_threads()} CPU threads)")
    )
    ok = True
    for title, (s, h, k, d, b, length) in shapes:
        arrays = _random_problem(rng, s, h, k, d, b, length, np.float16)

        def move(a, _lib=lib, _name=lib_name):
            if _lib is None:
                return a
            return _lib.asarray(a) if _name == "cupy" else _lib.from_numpy(a).cuda()

        dev_arrays = [move(a) for a in arrays]
        out = pagedattn.paged_attention(*dev_arrays)
        reps = 3 if device == "cpu" else 20
        if lib_name == "torch":
            lib.cuda.synchronize()
        elif lib_name == "cupy":
            lib.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            pagedattn.paged_attention(*dev_arrays, out=out)
        if lib_name == "torch":
            lib.cuda.synchronize()
        elif lib_name == "cupy":
            lib.cuda.runtime.deviceSynchronize()
        dt = (time.perf_counter() - t0) / reps
        host_out = np.asarray(out.get() if lib_name == "cupy" else (out.cpu().numpy() if lib_name else out))
        ref = paged_attention_ref(*arrays)
        err = float(np.linalg.norm(host_out.astype(np.float64) - ref) / np.linalg.norm(ref))
        kv_bytes = 2 * s * length * k * d * 2
        good = bool(np.isfinite(err) and err < 2e-3)
        ok &= good
        print(
            f"  {title}\n    {dt * 1e3:8.3f} ms/call, {kv_bytes / dt / 1e9:7.2f} GB/s of KV read, "
            f"relative error vs float64 {err:.1e}: {'ok' if good else 'MISMATCH'}"
        )
    print("self-check passed" if ok else "self-check FAILED")
    return 0 if ok else 1


def selfcheck_main(argv=None) -> int:
    from pagedattn.demo.cli import MAX_SEED, ArgumentParser, int_in

    parser = ArgumentParser(
        prog=f"{_prog()} selfcheck", description="Decode two realistic shapes and check them against float64."
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="0 to 2^63 - 1 (default 0)")
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if pagedattn.built_with_cuda() and _cuda_lib()[1] is not None else "cpu"
    return run_demo(device, args.seed)


# ---------------------------------------------------------------------------------------
# bench: dispatch to the GPU or CPU benchmark, plus the GB/s-against-context plot
# ---------------------------------------------------------------------------------------
_BENCH_HELP = """Runs pagedattn.bench.kernels.main(argv) on a GPU (needs this build with CUDA and
PyTorch with a GPU), else pagedattn.bench.cpu_decode.main(argv) (the CPU path against a
NumPy baseline). Options other than --device and --plot go to that benchmark: see
`python -m pagedattn.bench.kernels --help` and `python -m pagedattn.bench.cpu_decode --help`
(both take --json FILE and --reps N; N is 1 to 100000, and FILE's folder must exist)."""
MAX_BENCH_REPS = 100_000


def _torch_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a torch without a usable driver
        return False


def _plot_gbs(series, path, title):
    """series: {label: [(context, GB/s), ...]} -> a PNG at path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for label, points in sorted(series.items()):
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", lw=1.2, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel("GB/s of KV cache read")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


SWEEP_SHAPE = "4 sequences, 32 query / 8 KV heads, head size 128, float16"


def _cpu_context_sweep(reps):
    """GB/s of pagedattn and of the NumPy baseline over context lengths (SWEEP_SHAPE)."""
    from pagedattn.bench import cpu_decode

    rng = np.random.default_rng(0)
    series = {"pagedattn (CPU)": [], "NumPy gather + softmax": []}
    for context in SWEEP_CONTEXTS:
        args = cpu_decode.make_inputs(rng, 4, 32, 8, 128, 16, context, np.dtype(np.float16))
        out = np.empty_like(args[0])
        t_pa = cpu_decode.time_call(lambda a=args, o=out: pagedattn.paged_attention(*a, out=o), reps)
        t_np = cpu_decode.time_call(lambda a=args: cpu_decode.numpy_baseline(*a), max(1, reps // 2))
        kv_bytes = 2 * 4 * context * 8 * 128 * 2
        series["pagedattn (CPU)"].append((context, kv_bytes / t_pa / 1e9))
        series["NumPy gather + softmax"].append((context, kv_bytes / t_np / 1e9))
        print(
            f"  context {context:5d}: pagedattn {kv_bytes / t_pa / 1e9:6.2f} GB/s, "
            f"NumPy {kv_bytes / t_np / 1e9:6.2f} GB/s",
            flush=True,
        )
    return series


SWEEP_CONTEXTS = (128, 256, 512, 1024, 2048, 4096, 8192)


def bench_main(argv=None) -> int:
    from pagedattn.demo.cli import ArgumentParser, int_in, output_file

    argv = list(argv or [])
    parser = ArgumentParser(prog=f"{_prog()} bench", description=_BENCH_HELP, add_help=False)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--plot", type=output_file, metavar="FILE.png", help="also write GB/s against context length (needs matplotlib)"
    )
    # Checked here, before either benchmark starts, and handed on to it.
    parser.add_argument("--reps", type=int_in(1, MAX_BENCH_REPS), help=f"timed calls per shape, 1 to {MAX_BENCH_REPS}")
    parser.add_argument("--json", type=output_file, metavar="FILE", help="write the results (its folder must exist)")
    args, rest = parser.parse_known_args(argv)
    if args.reps is not None:
        rest += ["--reps", str(args.reps)]
    if args.json is not None:
        rest += ["--json", args.json]
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print()
    device = args.device
    if device == "auto":
        device = "cuda" if pagedattn.built_with_cuda() and _torch_gpu() else "cpu"
    if device == "cuda" and not (pagedattn.built_with_cuda() and _torch_gpu()):
        print("error: bench --device cuda needs a CUDA build of pagedattn and PyTorch with a GPU", file=sys.stderr)
        return 2
    if args.plot:
        from pagedattn.demo.report import plot_unavailable_reason

        plot_problem = plot_unavailable_reason()
        if plot_problem:  # refused before the benchmark runs, not found missing after it
            print(f"error: {plot_problem}", file=sys.stderr)
            return 2
    if device == "cuda":
        from pagedattn.bench import kernels

        rc = kernels.main(rest)
        if rc != 0 or not args.plot or "-h" in rest or "--help" in rest:
            return rc
        with open(args.json or "bench_kernels.json") as f:
            result = json.load(f)
        series = {}
        for r in result["rows"]:
            if "gbs" in r:
                label = (
                    f"{r['impl']}, batch {r['batch']}, {r['num_heads']}/{r['num_kv_heads']} heads "
                    f"d{r['head_size']} {r['dtype']}"
                )
                series.setdefault(label, []).append((r["context"], r["gbs"]))
        series = {k: v for k, v in series.items() if len(v) > 1}  # lines need two contexts
        _plot_gbs(series, args.plot, f"paged decode on {result['device']} (block size 16; line: batch, heads, dtype)")
        print(f"wrote {args.plot}")
        return 0
    from pagedattn.bench import cpu_decode

    rc = cpu_decode.main(rest)
    if rc != 0 or not args.plot or "-h" in rest or "--help" in rest:
        return rc
    reps = args.reps or 3
    print(f"GB/s against context length ({SWEEP_SHAPE}):", flush=True)
    sweep = _cpu_context_sweep(reps)
    if args.json:  # the sweep the plot shows goes into the JSON too
        with open(args.json) as f:
            result = json.load(f)
        result["context_sweep"] = {
            "shape": SWEEP_SHAPE,
            "series": {label: [{"context": c, "gbs": g} for c, g in points] for label, points in sweep.items()},
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    _plot_gbs(sweep, args.plot, f"CPU decode, {pagedattn._core.num_threads()} threads: {SWEEP_SHAPE}")
    print(f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------
# the default command: the serving demo
# ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "selfcheck":
        return selfcheck_main(argv[1:])
    if argv and argv[0] == "bench":
        return bench_main(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    from pagedattn.demo.cli import ArgumentParser, add_serve_arguments, serve

    parser = ArgumentParser(
        prog=_prog(),
        description="Serve a continuous-batching workload with pagedattn and check every attention output. "
        f"Other commands: `{_prog()} bench [--help]`, `{_prog()} selfcheck`; `{_prog()} serve` is this command.",
    )
    parser.add_argument("--cmake-dir", action="store_true", help="print pagedattn_DIR for CMake and exit")
    parser.add_argument("--include-dir", action="store_true", help="print the C++ include folder and exit")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    if args.cmake_dir:
        print(pagedattn.cmake_dir())
        return 0
    if args.include_dir:
        print(pagedattn.include_dir())
        return 0
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
