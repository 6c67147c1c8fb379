"""Tensor-parallel serving: start the ranks, join them through ``torch.distributed``,
run rank 0's engine and the other ranks' followers.

Two ways to start N ranks:

- ``torchrun --nproc-per-node N -m pagedattn --tensor-parallel N ...``: torchrun starts
  the processes and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; every
  process joins through ``env://``.
- ``python -m pagedattn --tensor-parallel N`` (``--tp-launch spawn``, the default outside
  torchrun): this process starts N processes (multiprocessing's spawn) that meet at a
  file in a fresh temporary folder (``file://``), and waits for them.

Rank r uses the CPU (gloo) or GPU ``LOCAL_RANK`` (NCCL for the all-reduce; see
:mod:`.comm`). Spawned CPU ranks split the machine's cores between their pagedattn thread
pools (``PAGEDATTN_NUM_THREADS``, unless it is set). Rank 0 prints the header and the
report; the other ranks print only errors. The first rank to fail decides the exit code
and the others are stopped.

:func:`run_engines` starts N ranks on ServeConfig settings directly, each writing its
results (and optionally a :class:`~.replica.StepTrace`) to a folder: the in-process form
the tests use.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import tempfile
from typing import Any, Callable, Optional, TextIO

import pagedattn

from .backend import NumpyBackend, limit_blas_threads
from .checker import AttentionMismatch
from .comm import init_process_group, torch_distributed_problem
from .engine import ConfigError, Engine, ServeConfig, make_rank_state
from .model import Shard
from .replica import Follower, Leader, RankStopped, StepTrace

__all__ = ["serve_parallel", "run_rank", "spawn", "run_engines", "TORCHRUN_VARS"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _env_int(name: str) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be a whole number, got {text!r}") from None


def _cpu_share(world: int) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // world)


def _resolve_device(args: argparse.Namespace) -> str:
    """cpu or cuda for a tensor-parallel run (its GPU arrays are always PyTorch tensors)."""
    import torch

    if args.gpu_lib == "cupy":
        raise ConfigError("--tensor-parallel runs on PyTorch tensors on a GPU: use --gpu-lib torch (or auto)")
    try:
        sees_gpu = bool(torch.cuda.is_available())
    except Exception:  # a torch without a usable driver
        sees_gpu = False
    device = args.device
    if device == "auto":
        device = "cuda" if pagedattn.built_with_cuda() and sees_gpu else "cpu"
    if device == "cuda":
        if not pagedattn.built_with_cuda():
            raise ConfigError("--device cuda: this pagedattn build has no CUDA backend (nvcc was not found at build)")
        if not sees_gpu:
            raise ConfigError("--device cuda with --tensor-parallel needs PyTorch with a visible GPU")
        cuda_sizes = pagedattn.supported()["cuda_block_sizes"]
        if args.block_size not in cuda_sizes:
            raise ConfigError(
                f"argument --block-size: the CUDA kernels take one of {', '.join(map(str, cuda_sizes))}, "
                f"got {args.block_size}"
            )
    return device


def serve_parallel(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``--tensor-parallel N``: checks the settings, then runs this process's rank
    (under torchrun) or spawns the N ranks and waits for them. Returns the exit code."""
    from .cli import build_config
    from .report import plot_unavailable_reason

    problem = torch_distributed_problem()
    if problem:
        print(f"error: {problem}", file=err)
        return 2
    n = args.tensor_parallel
    try:
        build_config(args)  # settings and the head split, before any process starts
        device = _resolve_device(args)
        launch = args.tp_launch
        if launch == "auto":
            launch = "torchrun" if launched_by_torchrun() else "spawn"
        if launch == "torchrun":
            missing = [v for v in TORCHRUN_VARS if v not in os.environ]
            if missing:
                raise ConfigError(f"--tp-launch torchrun: {', '.join(missing)} not set; start this under torchrun")
            world = _env_int("WORLD_SIZE")
            if world != n:
                raise ConfigError(f"--tensor-parallel {n}, but torchrun started {world} processes (WORLD_SIZE)")
        elif launched_by_torchrun() and _env_int("WORLD_SIZE") > 1:
            raise ConfigError("--tp-launch spawn under torchrun: every torchrun process would spawn its own ranks")
        if device == "cuda":
            import torch

            count = torch.cuda.device_count()
            need = _env_int("LOCAL_RANK") + 1 if launch == "torchrun" else n
            if count < need:
                raise ConfigError(f"--tensor-parallel {n} on CUDA needs {need} GPUs on this host; it sees {count}")
        if args.plot:
            plot_problem = plot_unavailable_reason()
            if plot_problem:
                raise ConfigError(plot_problem)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=err)
        return 2
    args = argparse.Namespace(**{**vars(args), "device": device, "tp_launch": launch})
    if launch == "torchrun":
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
        os.environ.setdefault(
            "PAGEDATTN_NUM_THREADS", str(_cpu_share(int(local_world) if local_world.isdigit() else 1))
        )
        return run_rank(args, _env_int("RANK"), n, _env_int("LOCAL_RANK"), "env://", out, err)
    out.flush()
    err.flush()
    return spawn(_cli_rank, n, args)


def _cli_rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> int:
    return run_rank(args, rank, world, rank, init_method, sys.stdout, sys.stderr)


def run_rank(
    args: argparse.Namespace, rank: int, world: int, local_rank: int, init_method: str, out: TextIO, err: TextIO
) -> int:
    """One rank of ``--tensor-parallel``: rank 0 serves and reports, the others follow."""
    from .backend import TorchBackend
    from .cli import build_config, serve_one

    cfg = build_config(args)
    if args.blas_threads > 0:
        limit_blas_threads(args.blas_threads)
    try:
        comm = init_process_group(rank, world, init_method, args.device, local_rank)
    except Exception as e:  # the rendezvous or the backend failed: no collective has started
        print(f"error: rank {rank}: cannot join the process group ({type(e).__name__}: {e})", file=err)
        return 2
    shard = Shard.of(cfg.model, world, rank)
    backend = NumpyBackend() if args.device == "cpu" else TorchBackend(f"cuda:{local_rank}")
    if rank == 0:
        leader = Leader(shard, comm, "torchrun" if args.tp_launch == "torchrun" else "spawned processes")
        rc = serve_one(args, out, err, backend=backend, tp=leader)
    else:
        rc = _follow(cfg, backend, shard, comm, err)
    if rc == 0:
        comm.close()
    return rc


def _follow(cfg: ServeConfig, backend: Any, shard: Shard, comm: Any, err: TextIO) -> int:
    rank = shard.rank
    try:
        follower = Follower(*make_rank_state(cfg, backend, shard, comm), comm)
    except (ValueError, RuntimeError, MemoryError) as e:
        print(f"error: rank {rank}: {type(e).__name__}: {e}", file=err)
        return 2
    try:
        follower.run()
    except AttentionMismatch as e:
        print(f"\nerror: CHECK FAILED on rank {rank} at step {follower.step_no}: {e}", file=err)
        return 1
    except RankStopped:
        return 2  # rank 0 reports why
    except RuntimeError as e:  # a collective failed: another rank is gone
        print(f"error: rank {rank} at step {follower.step_no}: {type(e).__name__}: {e}", file=err)
        return 1
    return 0


# ---------------------------------------------------------------------------------------
# spawning N local ranks
# ---------------------------------------------------------------------------------------
def _child(fn: Callable[..., int], rank: int, world: int, init_method: str, threads: int, args: tuple) -> None:
    os.environ.setdefault("PAGEDATTN_NUM_THREADS", str(threads))  # before pagedattn's pool starts
    sys.exit(fn(rank, world, init_method, *args))


def spawn(fn: Callable[..., int], world: int, *args: Any) -> int:
    """Runs ``fn(rank, world, init_method, *args) -> exit code`` in ``world`` spawned
    processes that rendezvous at a file in a fresh temporary folder. Returns 0 when every
    rank returned 0, else the exit code of the first rank that failed (the others are
    then terminated). ``fn`` and ``args`` must be picklable."""
    ctx = multiprocessing.get_context("spawn")
    threads = _cpu_share(world)
    with tempfile.TemporaryDirectory(prefix="pagedattn-tp-") as folder:
        init_method = "file://" + os.path.join(folder, "rendezvous")
        procs = [
            ctx.Process(target=_child, args=(fn, r, world, init_method, threads, args), name=f"pagedattn-rank-{r}")
            for r in range(world)
        ]
        rc = 0
        try:
            for p in procs:
                p.start()
            pending = {p.sentinel: p for p in procs}
            while pending:
                for sentinel in multiprocessing.connection.wait(list(pending)):
                    p = pending.pop(sentinel)
                    p.join()
                    if p.exitcode != 0 and rc == 0:
                        rc = p.exitcode if p.exitcode and p.exitcode > 0 else 1
                        for q in pending.values():
                            q.terminate()
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                if p.pid is not None:
                    p.join()
    return rc


# ---------------------------------------------------------------------------------------
# the in-process form the tests use
# ---------------------------------------------------------------------------------------
def run_engines(cfg: ServeConfig, world: int, folder: str, *, trace: bool = False, device: str = "cpu") -> int:
    """Serves ``cfg`` on ``world`` spawned ranks (CPU: NumPy arrays and gloo; cuda: PyTorch
    tensors on GPU r and NCCL); rank r writes ``rank{r}.pkl`` to ``folder``: its figures
    (rank 0: the report's summary with every rank's figures) and, with ``trace``, its
    :class:`~.replica.StepTrace` steps. Returns the exit code."""
    import dataclasses

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    cfg = dataclasses.replace(cfg, tensor_parallel=world)
    return spawn(_engine_rank, world, cfg, folder, trace, device)


def _engine_rank(
    rank: int, world: int, init_method: str, cfg: ServeConfig, folder: str, trace: bool, device: str
) -> int:
    from .backend import TorchBackend
    from .report import summarize

    limit_blas_threads(1)
    comm = init_process_group(rank, world, init_method, device, rank)
    shard = Shard.of(cfg.model, world, rank)
    backend = NumpyBackend() if device == "cpu" else TorchBackend(f"cuda:{rank}")
    result: dict[str, Any] = {"shard": shard}
    if rank == 0:
        engine = Engine(cfg, backend, tp=Leader(shard, comm))
        tr: Optional[StepTrace] = StepTrace(engine.model) if trace else None
        engine.run()
        result["summary"] = summarize(engine)
    else:
        follower = Follower(*make_rank_state(cfg, backend, shard, comm), comm)
        tr = StepTrace(follower.model) if trace else None
        follower.run()
        result["checked"] = dict(follower.checker.checked)
    result["trace"] = tr.steps if tr is not None else None
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    comm.close()
    return 0
