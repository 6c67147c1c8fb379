"""reshape_and_cache, copy_blocks and swap_blocks on CUDA against the host path."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import BF16, DTYPE_NAMES, KV_CACHE_DTYPES, LAYOUTS

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
    pytest.skip("needs a CUDA device and pagedattn built with CUDA", allow_module_level=True)

DEV = torch.device("cuda", 0)
from torch_arrays import to_torch  # noqa: E402

NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


def raw(t):
    """Bytes of a tensor / array, for bitwise comparison (NaN included)."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().contiguous()
        if t.element_size() == 1:
            return t.view(torch.uint8).numpy()
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().view(np.uint8)
    return np.ascontiguousarray(t).view(np.uint8)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KV_CACHE_DTYPES)
def test_reshape_and_cache_matches_cpu(rng, dtype, layout, kind):
    dt = NP[dtype]
    nb, bs, kh, d, t = 7, 16, 3, 128 if kind == "auto" else 64, 50
    cdt = dt if kind == "auto" else np.dtype(np.uint8)
    kshape, vshape = pagedattn.kv_cache_shape(nb, bs, kh, d, cdt, layout)
    fill = 0x7F if kind != "auto" else np.nan
    kc, vc = np.full(kshape, fill, cdt), np.full(vshape, fill, cdt)
    big_k = rng.standard_normal((t, kh + 1, d)).astype(dt) * 3  # strided input: every other... head rows
    key = big_k[:, 1:]
    value = (rng.standard_normal((t, kh, d)) * 500).astype(dt)  # exercises fp8 saturation
    slots = rng.choice(nb * bs, size=t, replace=False).astype(np.int64)
    slots[::5] = -1
    kw = dict(kv_cache_dtype=kind, k_scale=0.5, v_scale=0.25)
    kc_t, vc_t = to_torch(kc), to_torch(vc)
    pagedattn.reshape_and_cache(to_torch(big_k)[:, 1:], to_torch(value), kc_t, vc_t, to_torch(slots), **kw)
    pagedattn.reshape_and_cache(key, value, kc, vc, slots, **kw)
    torch.cuda.synchronize()
    assert np.array_equal(raw(kc_t), raw(kc)), "key cache differs from the CPU path"
    assert np.array_equal(raw(vc_t), raw(vc)), "value cache differs from the CPU path"


def test_reshape_and_cache_skips_out_of_range_slots(rng):
    kshape, vshape = pagedattn.kv_cache_shape(2, 16, 1, 64, np.float16, "vllm")
    kc = torch.zeros(kshape, dtype=torch.float16, device=DEV)
    vc = torch.zeros(vshape, dtype=torch.float16, device=DEV)
    key = torch.ones((3, 1, 64), dtype=torch.float16, device=DEV)
    slots = torch.tensor([0, 32, 10**6], dtype=torch.int64, device=DEV)  # 32 == num_blocks * block_size
    pagedattn.reshape_and_cache(key, key, kc, vc, slots)
    torch.cuda.synchronize()
    assert kc.sum().item() == 64 and vc.sum().item() == 64  # only slot 0 written


@pytest.mark.parametrize("mapping_on", ["host", "device"])
def test_copy_blocks_all_layers_one_launch(rng, mapping_on):
    layers = 4
    keys = [rng.standard_normal((9, 2, 8, 16, 8)).astype(np.float16) for _ in range(layers)]
    values = [rng.standard_normal((9, 2, 64, 16)).astype(np.float16) for _ in range(layers)]
    pairs = np.array([[0, 3], [1, 4], [8, 2]], np.int64)
    kt, vt = [to_torch(k) for k in keys], [to_torch(v) for v in values]
    mapping = pairs if mapping_on == "host" else to_torch(pairs)
    pagedattn.copy_blocks(kt, vt, mapping)
    pagedattn.copy_blocks(keys, values, pairs)
    torch.cuda.synchronize()
    for a, b in zip(kt + vt, keys + values):
        assert np.array_equal(a.cpu().numpy(), b)


def test_copy_blocks_device_mapping_skips_bad_pairs(rng):
    cache = to_torch(rng.standard_normal((4, 32)).astype(np.float32))
    before = cache.clone()
    pagedattn.copy_blocks([cache], [], torch.tensor([[0, 1], [2, 99], [-1, 3]], device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(cache[1], before[0])
    assert torch.equal(cache[[0, 2, 3]], before[[0, 2, 3]])


@pytest.mark.parametrize("pinned", [True, False])
def test_swap_blocks_roundtrip(rng, pinned):
    gpu = to_torch(rng.standard_normal((10, 2, 64, 16)).astype(np.float16))
    host = torch.zeros((6, 2, 64, 16), dtype=torch.float16, pin_memory=pinned)
    out_pairs = [(3, 0), (4, 1), (5, 2), (9, 5)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    pagedattn.swap_blocks(gpu, host, out_pairs, stream=s)
    s.synchronize()
    for a, b in out_pairs:
        assert torch.equal(host[b], gpu[a].cpu())
    assert torch.all(host[[3, 4]] == 0)
    back = torch.zeros_like(gpu)
    pagedattn.swap_blocks(host, back, [(0, 7), (5, 8)])
    torch.cuda.synchronize()
    assert torch.equal(back[7], gpu[3]) and torch.equal(back[8], gpu[9])
    assert torch.all(back[:7] == 0)
