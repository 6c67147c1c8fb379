"""Framework-neutral helpers: array kinds, devices, streams and dtypes.

Nothing here imports a framework at module load; torch / CuPy / JAX are only touched
when an array of theirs is passed in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_KDLCUDA = 2


def is_numpy_bf16(a: Any) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.name == "bfloat16"


def as_core(a: Any) -> tuple[Any, bool]:
    """Returns an object the compiled core accepts, and whether it is a bfloat16 view.

    NumPy has no native bfloat16; ml_dtypes.bfloat16 arrays go to the core as uint16
    views with a flag, everything else through DLPack unchanged.
    """
    if is_numpy_bf16(a):
        return a.view(np.uint16), True
    return a, False


def check_writable(a: Any, name: str) -> None:
    """A clear error for a read-only NumPy array passed where pagedattn writes."""
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ValueError(f"{name}: the array is read-only; pagedattn writes into it")


def check_num_seqs(query: Any, block_tables: Any, seq_lens: Any) -> None:
    """Before an output is allocated for ``query``: its first dimension must match the
    index arrays' (the full validation happens in the core; this keeps a bad query from
    allocating a huge output first)."""
    q, bt, sl = (getattr(a, "shape", None) for a in (query, block_tables, seq_lens))
    if q is None or len(q) != 3:  # other ranks get the core's own message
        return
    for name, shape in (("seq_lens", sl), ("block_tables", bt)):
        if shape is not None and len(shape) >= 1 and int(shape[0]) != int(q[0]):
            raise ValueError(
                f"{name}: dimension 0 (num_seqs, as in query) must be {int(q[0])}, got {int(shape[0])}"
            )


def framework(a: Any) -> str:
    mod = type(a).__module__
    root = mod.split(".", 1)[0]
    if root in ("numpy", "torch", "cupy", "jax", "jaxlib"):
        return "jax" if root == "jaxlib" else root
    return root


def is_cuda(a: Any) -> bool:
    dev = getattr(a, "__dlpack_device__", None)
    if dev is None:
        return False
    return int(dev()[0]) == _KDLCUDA


def resolve_stream(stream: Any, like: Any) -> int:
    """The CUDA stream handle for a call.

    Rule: an explicit ``stream`` wins (an int handle, an object with ``__cuda_stream__``,
    a torch.cuda.Stream or a cupy Stream); otherwise, for torch and CuPy arrays the
    framework's current stream on the array's device; otherwise the default stream (0).
    """
    if stream is not None:
        if isinstance(stream, (int, np.integer)):
            return int(stream)
        proto = getattr(stream, "__cuda_stream__", None)
        if proto is not None:
            value = proto() if callable(proto) else proto
            if isinstance(value, tuple):
                value = value[1]
            return int(value)
        for attr in ("cuda_stream", "ptr", "handle"):
            handle = getattr(stream, attr, None)
            if isinstance(handle, (int, np.integer)):
                return int(handle)
        raise TypeError(
            f"stream: expected an int handle or an object with __cuda_stream__, got {type(stream).__name__}"
        )
    if not is_cuda(like):
        return 0
    fw = framework(like)
    if fw == "torch":
        import torch

        return int(torch.cuda.current_stream(like.device).cuda_stream)
    if fw == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def empty_like(a: Any) -> Any:
    """A new contiguous array of the same kind, dtype, shape and device as ``a``."""
    fw = framework(a)
    if fw == "numpy":
        return np.empty(a.shape, dtype=a.dtype)
    if not hasattr(a, "__dlpack__"):
        raise TypeError(
            f"query: expected an array supporting DLPack (NumPy, PyTorch, CuPy, JAX, ...), got {type(a).__name__}"
        )
    if fw == "torch":
        import torch

        return torch.empty(tuple(a.shape), dtype=a.dtype, device=a.device)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(a.device.id):
            return cupy.empty(a.shape, dtype=a.dtype)
    if not is_cuda(a):
        # Any other host array exporting DLPack (JAX on CPU, ...): NumPy buffer.
        return np.empty(tuple(a.shape), dtype=np.dtype(str(a.dtype)))
    raise TypeError(
        f"cannot allocate an output array of type {type(a).__module__}.{type(a).__name__} on a CUDA device; "
        "pass out= (any writable DLPack array)"
    )


def finish_like(result: Any, like: Any) -> Any:
    """Converts a NumPy result back to the kind of ``like`` when that kind is immutable (JAX)."""
    if framework(like) == "jax" and isinstance(result, np.ndarray):
        import jax.numpy as jnp

        return jnp.asarray(result)
    return result


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name for NumPy dtypes, scalar types, torch dtypes and strings."""
    if isinstance(dtype, str):
        return dtype.replace("torch.", "")
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch.") :]
    try:
        return np.dtype(dtype).name
    except TypeError:
        return getattr(dtype, "__name__", text)
