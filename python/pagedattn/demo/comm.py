"""The ranks' communication in a tensor-parallel run, through ``torch.distributed``.

Two collectives, each timed and counted:

- **all-reduce** (one per layer, on the model's device): the sum of the ranks' partial
  outputs of the row-parallel output projection. NCCL when the device is CUDA, gloo on
  the CPU. NumPy arrays cross as CPU tensors sharing their memory (no copy).
- **broadcast** (one per step, from rank 0): the step's metadata as ONE int64 buffer
  (:mod:`.replica` packs it). The metadata lives on the host on every rank (the block
  manager and the checker are host code), so it travels over gloo on the CPU even when
  the all-reduce runs on NCCL: a CUDA buffer would cost a host-to-device copy on rank 0
  and a device-to-host copy and a synchronisation on every other rank for a few KB.
  The buffer keeps its capacity between steps; a message that does not fit makes every
  rank grow it (doubling) and costs a second broadcast in that step only.

A collective's time on one rank includes waiting for the last rank to arrive. Every
call's entry and exit times are kept (``perf_counter``, one clock for all the processes
of a host), so that the report can also give the time after the last rank arrived: the
collective itself, without the imbalance between the ranks.

This module imports torch: only the tensor-parallel path loads it.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Optional

import numpy as np

__all__ = ["Comm", "init_process_group", "torch_distributed_problem"]

INITIAL_CAPACITY = 1024  # int64 words of the broadcast buffer before it first grows
TIMEOUT = datetime.timedelta(minutes=10)


def torch_distributed_problem() -> Optional[str]:
    """None when torch.distributed can be used here, else why not (one line)."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        return f"--tensor-parallel needs PyTorch (torch.distributed), which cannot be imported ({e}): pip install torch"
    if not dist.is_available():
        return "--tensor-parallel needs torch.distributed, which this PyTorch build lacks"
    return None


def init_process_group(rank: int, world: int, init_method: str, device: str, local_rank: int) -> Comm:
    """Joins the process group (NCCL on CUDA, gloo on the CPU) and returns the ranks' Comm."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group(
            "nccl", init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT,
            device_id=torch.device("cuda", local_rank),
        )  # fmt: skip
        meta = dist.new_group(backend="gloo", timeout=TIMEOUT)  # the host-side metadata (see above)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
        meta = None  # the default group is gloo already
    return Comm(rank, world, device, meta)


class Comm:
    """The all-reduce and the metadata broadcast of one rank, with their timings."""

    def __init__(self, rank: int, world: int, device: str, meta_group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world, self.device = rank, world, device
        self.backend = dist.get_backend()
        self.meta_group = meta_group
        self._buf = torch.zeros(INITIAL_CAPACITY, dtype=torch.int64)
        self.stats = {
            "all_reduce_calls": 0, "all_reduce_seconds": 0.0, "all_reduce_bytes": 0,
            "broadcast_calls": 0, "broadcast_seconds": 0.0, "broadcast_bytes": 0, "broadcast_grows": 0,
            "message_bytes": 0,
        }  # fmt: skip
        # (entry, exit) times of every call, for the time after the last rank arrived.
        self.times: dict[str, list[tuple[float, float]]] = {"all_reduce": [], "broadcast": []}

    # -- the all-reduce -----------------------------------------------------------------
    def all_reduce(self, partial: Any) -> Any:
        """The sum over the ranks of ``partial`` (a NumPy array or a torch tensor, reduced
        in place and returned). On CUDA the device is synchronised around the collective so
        that its time is measured alone (this demo's steps are synchronous anyway)."""
        torch = self.torch
        if isinstance(partial, np.ndarray):
            if not (partial.flags.c_contiguous and partial.flags.writeable):
                partial = np.ascontiguousarray(partial)
            tensor = torch.from_numpy(partial)
        else:
            tensor = partial
        cuda = tensor.is_cuda
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.dist.all_reduce(tensor)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        self.times["all_reduce"].append((t0, t1))
        s = self.stats
        s["all_reduce_seconds"] += t1 - t0
        s["all_reduce_calls"] += 1
        s["all_reduce_bytes"] += tensor.numel() * tensor.element_size()
        return partial

    # -- the metadata broadcast -----------------------------------------------------------
    def broadcast(self, message: Optional[np.ndarray] = None) -> np.ndarray:
        """Rank 0 passes ``message`` (int64 [n]); every rank returns it. Word 0 of the
        buffer carries n; a message longer than the buffer grows it on every rank."""
        t0 = time.perf_counter()
        s = self.stats
        if self.rank == 0:
            if message is None:
                raise ValueError("rank 0 must pass the message to broadcast")
            message = np.ascontiguousarray(message, dtype=np.int64)
            n = len(message)
        while True:
            buf = self._buf.numpy()
            if self.rank == 0:
                buf[0] = n
                if n < len(buf):
                    buf[1 : n + 1] = message
            self.dist.broadcast(self._buf, src=0, group=self.meta_group)
            s["broadcast_calls"] += 1
            s["broadcast_bytes"] += self._buf.numel() * 8
            n = int(buf[0])
            if n < len(buf):
                break
            capacity = len(buf)
            while capacity <= n:
                capacity *= 2
            self._buf = self.torch.zeros(capacity, dtype=self.torch.int64)  # every rank grows alike
            s["broadcast_grows"] += 1
        out = message if self.rank == 0 else buf[1 : n + 1].copy()
        s["message_bytes"] += 8 * n
        t1 = time.perf_counter()
        self.times["broadcast"].append((t0, t1))
        s["broadcast_seconds"] += t1 - t0
        return out

    def gather(self, obj: Any) -> Optional[list]:
        """Every rank's ``obj`` on rank 0 (None elsewhere); once, at the end of a run."""
        out = [None] * self.world if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0, group=self.meta_group)
        return out

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
