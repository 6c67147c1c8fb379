"""Array backends of the serving demo: NumPy on the CPU, CuPy or PyTorch on a CUDA GPU.

The demo model and KV cache are written against the small set of operations below, so
the same code runs on any of the three libraries. pagedattn itself only ever sees the
arrays (through DLPack); nothing here is needed by the library.
"""

from __future__ import annotations

import abc
from typing import Any, Optional

import numpy as np

__all__ = [
    "Backend",
    "NumpyBackend",
    "CupyBackend",
    "TorchBackend",
    "make_backend",
    "find_gpu_library",
    "limit_blas_threads",
]

DTYPE_NAMES = ("float32", "float16", "bfloat16")


def _numpy_bfloat16() -> np.dtype:
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("--dtype bfloat16 on the CPU needs the ml_dtypes package (pip install ml_dtypes)") from e
    return np.dtype(ml_dtypes.bfloat16)


class Backend(abc.ABC):
    """Operations the demo needs; subclasses bind them to one array library."""

    name = "abstract"
    device = "cpu"

    @abc.abstractmethod
    def describe(self) -> str:
        """One line naming the device and the array library."""

    # -- dtypes and transfers ------------------------------------------------------------
    @abc.abstractmethod
    def dtype(self, name: str) -> Any:
        """The library's dtype object for a dtype name."""

    @abc.abstractmethod
    def from_numpy(self, a: np.ndarray, dtype: Optional[str] = None) -> Any:
        """A device copy of a host array (cast to ``dtype`` when given)."""

    @abc.abstractmethod
    def index(self, a: np.ndarray) -> Any:
        """A device copy of a host integer array (block tables, lengths, slots)."""

    @abc.abstractmethod
    def to_numpy(self, a: Any) -> np.ndarray:
        """A host float32 copy of a floating-point device array (any of the three dtypes)."""

    @abc.abstractmethod
    def cast(self, a: Any, dtype: str) -> Any:
        """Cast (see the NumPy backend for the semantics)."""

    @abc.abstractmethod
    def full(self, shape: tuple, value: float, dtype: str) -> Any:
        """Full (see the NumPy backend for the semantics)."""

    @abc.abstractmethod
    def host_pool(self, shape: tuple, dtype: str) -> Any:
        """Host memory for swapped-out blocks (pinned when a GPU is involved)."""

    def synchronize(self) -> None:  # noqa: B027 - a no-op where work is synchronous
        """Waits for queued device work (for honest timings)."""

    # -- math ----------------------------------------------------------------------------
    @abc.abstractmethod
    def take(self, a: Any, rows: np.ndarray) -> Any:
        """``a[rows]`` along the first dimension (``rows`` a host integer array)."""

    @abc.abstractmethod
    def rmsnorm(self, x: Any, gain: Any, eps: float = 1e-6) -> Any:
        """Rmsnorm (see the NumPy backend for the semantics)."""

    @abc.abstractmethod
    def silu(self, x: Any) -> Any:
        """Silu (see the NumPy backend for the semantics)."""


class NumpyBackend(Backend):
    """NumPy arrays in host memory: the CPU path."""

    name = "numpy"
    device = "cpu"

    def __init__(self) -> None:
        self.xp = np

    def describe(self) -> str:
        import pagedattn

        n = pagedattn._core.num_threads()
        return f"cpu (NumPy {np.__version__}, {n} pagedattn thread{'' if n == 1 else 's'})"

    def dtype(self, name: str) -> Any:
        if name == "bfloat16":
            return _numpy_bfloat16()
        return np.dtype(name)

    def from_numpy(self, a, dtype=None):
        return np.array(a, dtype=self.dtype(dtype) if dtype else None, copy=True)

    def index(self, a):
        return a

    def to_numpy(self, a):
        return np.asarray(a).astype(np.float32)

    def cast(self, a, dtype):
        return a.astype(self.dtype(dtype))

    def full(self, shape, value, dtype):
        return np.full(shape, value, dtype=self.dtype(dtype))

    def host_pool(self, shape, dtype):
        return np.zeros(shape, dtype=self.dtype(dtype))

    def take(self, a, rows):
        return a[rows]

    def rmsnorm(self, x, gain, eps=1e-6):
        xp = self.xp
        return x * (1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)) * gain

    def silu(self, x):
        return x / (1.0 + self.xp.exp(-x))


class CupyBackend(NumpyBackend):
    """CuPy arrays on the current CUDA device."""

    name = "cupy"
    device = "cuda"

    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self.cupy = cupy

    def describe(self) -> str:
        props = self.cupy.cuda.runtime.getDeviceProperties(self.cupy.cuda.Device().id)
        gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return f"cuda ({gpu}; arrays through CuPy {self.cupy.__version__})"

    def dtype(self, name):
        if name == "bfloat16":
            raise RuntimeError("CuPy has no bfloat16 arrays: use --dtype float16/float32 or --gpu-lib torch")
        return np.dtype(name)

    def from_numpy(self, a, dtype=None):
        out = self.cupy.asarray(a)
        return out.astype(self.dtype(dtype)) if dtype else out

    def index(self, a):
        return self.cupy.asarray(a)

    def to_numpy(self, a):
        return self.cupy.asnumpy(a).astype(np.float32)

    def full(self, shape, value, dtype):
        return self.cupy.full(shape, value, dtype=self.dtype(dtype))

    def host_pool(self, shape, dtype):
        import cupyx

        out = cupyx.empty_pinned(shape, dtype=self.dtype(dtype))
        out[...] = 0
        return out

    def take(self, a, rows):
        return a[self.cupy.asarray(rows)]

    def synchronize(self):
        self.cupy.cuda.get_current_stream().synchronize()


class TorchBackend(Backend):
    """PyTorch tensors on a CUDA device."""

    name = "torch"
    device = "cuda"

    def __init__(self, device: str = "cuda") -> None:
        import torch

        self.torch = torch
        self.dev = torch.device(device)
        self.device = "cuda" if self.dev.type == "cuda" else "cpu"

    def describe(self) -> str:
        t = self.torch
        if self.dev.type == "cuda":
            return f"cuda ({t.cuda.get_device_name(self.dev)}; arrays through PyTorch {t.__version__})"
        return f"cpu (PyTorch {t.__version__} tensors)"

    def dtype(self, name):
        return {"float32": self.torch.float32, "float16": self.torch.float16, "bfloat16": self.torch.bfloat16}[name]

    def from_numpy(self, a, dtype=None):
        t = self.torch.from_numpy(np.ascontiguousarray(a)).to(self.dev)
        return t.to(self.dtype(dtype)) if dtype else t

    def index(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.dev)

    def to_numpy(self, a):
        return a.detach().to(self.torch.float32).cpu().numpy()

    def cast(self, a, dtype):
        return a.to(self.dtype(dtype))

    def full(self, shape, value, dtype):
        return self.torch.full(tuple(shape), value, dtype=self.dtype(dtype), device=self.dev)

    def host_pool(self, shape, dtype):
        pinned = self.dev.type == "cuda"
        return self.torch.zeros(tuple(shape), dtype=self.dtype(dtype), pin_memory=pinned)

    def synchronize(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def take(self, a, rows):
        return a[self.torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(self.dev)]

    def rmsnorm(self, x, gain, eps=1e-6):
        return x * self.torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * gain

    def silu(self, x):
        return self.torch.nn.functional.silu(x)


_OPENBLAS_SETTERS = (
    "scipy_openblas_set_num_threads64_",  # NumPy >= 2 wheels (scipy-openblas, 64-bit ints)
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def limit_blas_threads(n: int = 1) -> bool:
    """Caps the threads of the OpenBLAS that NumPy loaded; returns whether one was found.

    The demo's matmuls are small ([batch, 256] x [256, 768]): BLAS threads gain nothing
    there and, on a small machine shared with other work, spinning BLAS threads slow the
    whole loop down several times. pagedattn's own thread pool is not affected. Uses
    threadpoolctl when it is installed, else the OpenBLAS entry point found in the
    process's loaded libraries (Linux).
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        threadpool_limits(n, user_api="blas")
        return True
    import ctypes
    import os

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.rsplit("/", 1)[-1].lower()}
    except OSError:
        return False
    found = False
    for path in sorted(paths):
        if not os.path.isfile(path):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _OPENBLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                found = True
                break
    return found


def find_gpu_library(prefer: str = "auto") -> tuple[Optional[str], Optional[str]]:
    """(name, None) of the first array library that sees a CUDA GPU, else (None, reason)."""
    names = ("cupy", "torch") if prefer == "auto" else (prefer,)
    reasons = []
    for name in names:
        try:
            mod = __import__(name)
        except ImportError:
            reasons.append(f"{name} is not installed")
            continue
        try:
            if name == "cupy" and mod.cuda.runtime.getDeviceCount() > 0:
                return name, None
            if name == "torch" and mod.cuda.is_available():
                return name, None
            reasons.append(f"{name} sees no CUDA GPU")
        except Exception as e:  # a library present but without a usable driver
            reasons.append(f"{name} cannot use a GPU ({type(e).__name__}: {e})")
    return None, "; ".join(reasons)


def make_backend(device: str, gpu_lib: str = "auto") -> Backend:
    """The backend for ``device`` ("cpu" or "cuda"); on CUDA CuPy first, then PyTorch."""
    if device == "cpu":
        return NumpyBackend()
    import pagedattn

    if not pagedattn.built_with_cuda():
        raise RuntimeError("--device cuda: this pagedattn build has no CUDA backend (nvcc was not found at build)")
    name, why = find_gpu_library(gpu_lib)
    if name is None:
        raise RuntimeError(f"--device cuda needs CuPy or PyTorch with a visible GPU: {why}")
    return CupyBackend() if name == "cupy" else TorchBackend("cuda")
