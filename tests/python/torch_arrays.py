"""NumPy <-> torch conversions shared by the tests (ml_dtypes bfloat16 included, by its
bits). Import it after ``pytest.importorskip("torch")``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from conftest import BF16


def to_torch(a: Any, device: Any = "cuda") -> Any:
    """A NumPy array as a torch tensor on `device` with the same values; None stays None."""
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    if BF16 is not None and a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a NumPy array on the host (bfloat16 as ml_dtypes bfloat16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(BF16)
    return t.numpy()
