"""A caller that changes the index arrays while a varlen or decode call runs.

Another stream (of higher priority, so that its blocks are scheduled between the
attention kernel's) overwrites query_start_loc, seq_lens and the block table with random
and extreme integers while the attention kernel reads them. The outputs of such a call
are whatever the kernel saw, but the library must neither hang (every thread of a block
meets every barrier: the block's work is read once, by one thread, and shared), nor touch
memory outside its arguments (block ids re-read after the check are clamped into the pool),
nor write anything but `out`. Each kernel family runs in a subprocess under a time limit,
so that a hang fails the test instead of stopping the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pagedattn

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
    pytest.skip("needs a CUDA device and pagedattn built with CUDA", allow_module_level=True)

# The racing writer of both scripts (each runs as MUTATE + script): 40 rounds on the stream
# `side` over the arrays the call reads (query_start_loc of T rows, seq_lens up to L, a table
# of n_blocks), plausible values (the kernel computes with them) and extreme ones in turns;
# `pad`: how far query_start_loc strays past [0, T].
MUTATE = r"""
import torch


def mutate(side, arrays, clean, T, pad, L, n_blocks):
    qsl_m, sl_m, bt_m = arrays
    qsl, sl, bt = clean
    S = sl.numel()
    lo32, hi32 = -(2**31), 2**31 - 1
    with torch.cuda.stream(side):
        for i in range(40):
            if i % 4 == 0:
                qsl_m.random_(lo32, hi32)
                sl_m.random_(lo32, hi32)
                bt_m.random_(lo32, hi32)
            elif i % 4 == 1:
                qsl_m.copy_(torch.sort(torch.randint(0, T + 1, (S + 1,), device=qsl.device)).values.to(torch.int32))
                sl_m.random_(0, 2 * L)
                bt_m.random_(-2, n_blocks + 2)
            elif i % 4 == 2:
                qsl_m.copy_(qsl)
                sl_m.random_(1, L + 1)
                bt_m.copy_(bt.flip(1))
            else:
                qsl_m.random_(-pad, T + pad)
                sl_m.copy_(sl)
                bt_m.random_(0, n_blocks)
"""

SCRIPT = r"""
import sys
import torch
import pagedattn

dtype = getattr(torch, sys.argv[1])
layout = sys.argv[2]
rounds = int(sys.argv[3])
dev = "cuda"
torch.manual_seed(0)
S, L, H, K, D, B = 4, 1536, 16, 4, 128, 16
n_blocks = S * L // B
kshape, vshape = pagedattn.kv_cache_shape(n_blocks, B, K, D, sys.argv[1], layout)
kc = torch.randn(kshape, device=dev).to(dtype)
vc = torch.randn(vshape, device=dev).to(dtype)
q = torch.randn(S * L, H, D, device=dev).to(dtype)
bt = torch.randperm(n_blocks, device=dev).to(torch.int32).view(S, L // B)
sl = torch.full((S,), L, dtype=torch.int32, device=dev)
qsl = torch.arange(0, S * L + 1, L, dtype=torch.int32, device=dev)
sums = [t.double().sum().item() for t in (kc, vc, q)]
before = pagedattn.paged_attention(q, kc, vc, bt, sl, query_start_loc=qsl, max_query_len=L)
torch.cuda.synchronize()

side = torch.cuda.Stream(priority=-1)  # higher priority: its blocks run between the kernel's
for r in range(rounds):
    bt_m, sl_m, qsl_m = bt.clone(), sl.clone(), qsl.clone()
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    mql = L if r % 2 == 0 else None  # with and without the host's bound (the flat grid)
    pagedattn.paged_attention(q, kc, vc, bt_m, sl_m, query_start_loc=qsl_m, max_query_len=mql, out=out)
    mutate(side, (qsl_m, sl_m, bt_m), (qsl, sl, bt), S * L, L, L, n_blocks)
    torch.cuda.synchronize()

after = pagedattn.paged_attention(q, kc, vc, bt, sl, query_start_loc=qsl, max_query_len=L)
torch.cuda.synchronize()
assert [t.double().sum().item() for t in (kc, vc, q)] == sums, "a racing call wrote outside out"
assert torch.equal(before.view(torch.uint8), after.view(torch.uint8)), "a clean call changed after the races"
print(pagedattn.decode_plan(S, H, K, D, B, L // B, sys.argv[1], layout)["varlen_kernel"])
"""

HOPPER = torch.cuda.get_device_capability(0) == (9, 0)
CASES = [
    # (dtype, layout, PAGEDATTN_PREFILL_KERNEL, the family expected)
    ("bfloat16", "nhd", None, "sm90_wgmma" if HOPPER else "sm80_mma"),
    ("float16", "vllm", None, "sm90_wgmma" if HOPPER else "sm80_mma"),
    ("bfloat16", "nhd", "blocks", "sm90_wgmma" if HOPPER else "sm80_mma"),  # one block per work item
    ("bfloat16", "nhd", "mma", "sm80_mma"),
    ("float16", "vllm", "mma", "sm80_mma"),
    ("float32", "nhd", None, "cuda_core"),
]


@pytest.mark.parametrize("dtype,layout,kernel,expected", CASES)
def test_index_arrays_changed_during_the_call(dtype, layout, kernel, expected):
    env = dict(os.environ)
    env.pop("PAGEDATTN_PREFILL_KERNEL", None)
    env.pop("PAGEDATTN_SM90_PERSISTENT", None)
    if kernel == "blocks":
        env["PAGEDATTN_SM90_PERSISTENT"] = "0"
    elif kernel is not None:
        env["PAGEDATTN_PREFILL_KERNEL"] = kernel
    try:
        r = subprocess.run([sys.executable, "-c", MUTATE + SCRIPT, dtype, layout, "12"], env=env, capture_output=True,
                           text=True, timeout=240)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{dtype} {layout} ({kernel or 'default'} kernel): the call hung while its index arrays changed")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    family = r.stdout.strip().splitlines()[-1]
    if family == "sm80_mma" and expected == "sm90_wgmma":
        pytest.skip("this build has no Hopper kernels")
    assert family == expected, family


DECODE_SCRIPT = r"""
import sys
import torch
import pagedattn

dtype = getattr(torch, sys.argv[1])
layout, B, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dev = "cuda"
torch.manual_seed(0)
S, L, H, K, D = 16, 2048, 16, 4, 128
n_blocks = S * L // B
kshape, vshape = pagedattn.kv_cache_shape(n_blocks, B, K, D, sys.argv[1], layout)
kc = torch.randn(kshape, device=dev).to(dtype)
vc = torch.randn(vshape, device=dev).to(dtype)
q = torch.randn(S, H, D, device=dev).to(dtype)
bt = torch.randperm(n_blocks, device=dev).to(torch.int32).view(S, L // B)
sl = torch.randint(1, L + 1, (S,), dtype=torch.int32, device=dev)
qsl = torch.arange(0, S + 1, dtype=torch.int32, device=dev)  # a mixed batch of decode rows only
sums = [t.double().sum().item() for t in (kc, vc, q)]
forms = [dict(), dict(kernel="partitioned", partition_size=80), dict(sliding_window=300),
         dict(query_start_loc=qsl, max_query_len=1)]
before = [pagedattn.paged_attention(q, kc, vc, bt, sl, **f) for f in forms]
torch.cuda.synchronize()

side = torch.cuda.Stream(priority=-1)  # higher priority: its blocks run between the kernel's
for r in range(rounds):
    f = dict(forms[r % len(forms)])
    bt_m, sl_m, qsl_m = bt.clone(), sl.clone(), qsl.clone()
    if "query_start_loc" in f:
        f["query_start_loc"] = qsl_m
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    pagedattn.paged_attention(q, kc, vc, bt_m, sl_m, out=out, **f)
    mutate(side, (qsl_m, sl_m, bt_m), (qsl, sl, bt), S, S, L, n_blocks)
    torch.cuda.synchronize()

after = [pagedattn.paged_attention(q, kc, vc, bt, sl, **f) for f in forms]
torch.cuda.synchronize()
assert [t.double().sum().item() for t in (kc, vc, q)] == sums, "a racing call wrote outside out"
for a, b in zip(before, after):
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "a clean call changed after the races"
print("ok")
"""


# The decode kernels, among them the one whose warps share value stages through mbarriers
# (vllm pages of 64 and more, 16-bit caches, head size 128): a thread that read another
# length than its CTA's others would wait forever at a barrier the others never reach.
@pytest.mark.parametrize("dtype,layout,block_size", [("bfloat16", "vllm", 64), ("float16", "vllm", 256),
                                                     ("bfloat16", "vllm", 16), ("bfloat16", "nhd", 64)])  # fmt: skip
def test_decode_index_arrays_changed_during_the_call(dtype, layout, block_size):
    try:
        r = subprocess.run([sys.executable, "-c", MUTATE + DECODE_SCRIPT, dtype, layout, str(block_size), "16"],
                           capture_output=True, text=True, timeout=240)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{dtype} {layout} page {block_size}: the decode call hung while its index arrays changed")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "ok"
