"""The serving demo behind ``python -m pagedattn``: a tiny decoder-only transformer with
random weights, served by a continuous-batching loop on pagedattn's public API.

- :mod:`.workload`: request arrivals and lengths (a documented distribution);
- :mod:`.model`: the model (NumPy on the CPU; CuPy or PyTorch on a GPU, see :mod:`.backend`);
  one forward pass per engine step, one varlen ``paged_attention`` per layer for all of
  the step's rows (decode tokens and prompt chunks);
- :mod:`.kvcache`: the paged KV cache and the pagedattn calls that move its data;
- :mod:`.engine`: the scheduler (chunked prefill under a per-step token budget,
  admission, prefix caching, forks, preemption);
- :mod:`.checker`: every attention output row against dense float64 attention;
- :mod:`.report`, :mod:`.cli`: the report, the plot, the progress bar, the command line;
- tensor parallelism (``--tensor-parallel N``): :mod:`.parallel` starts and joins the
  ranks, :mod:`.replica` carries rank 0's schedule to the others (one broadcast per
  step), :mod:`.comm` holds the ``torch.distributed`` collectives. Only this path
  imports torch.
"""

from __future__ import annotations

from .checker import AttentionMismatch, Checker
from .engine import ConfigError, Engine, ServeConfig
from .model import ModelConfig, TinyDecoder
from .workload import Request, WorkloadConfig, make_workload

__all__ = [
    "AttentionMismatch",
    "Checker",
    "ConfigError",
    "Engine",
    "ModelConfig",
    "Request",
    "ServeConfig",
    "TinyDecoder",
    "WorkloadConfig",
    "make_workload",
]
