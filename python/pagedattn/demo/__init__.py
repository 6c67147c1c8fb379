"""The serving demo behind ``python -m pagedattn``: a tiny decoder-only transformer with
random weights, served by a continuous-batching loop on pagedattn's public API.

- :mod:`.workload`: request arrivals and lengths (a documented distribution);
- :mod:`.model`: the model (NumPy on the CPU; CuPy or PyTorch on a GPU, see :mod:`.backend`);
- :mod:`.kvcache`: the paged KV cache and the pagedattn calls that move its data;
- :mod:`.engine`: the scheduler (admission, prefix caching, forks, preemption);
- :mod:`.checker`: every attention output against dense float64 attention;
- :mod:`.report`, :mod:`.cli`: the report, the plot, the progress bar, the command line.
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
