"""Varlen paged attention (chunked prefill, mixed batches) on the GPU, side by side.

Systems, in one process: pagedattn (both cache layouts); PyTorch SDPA per sequence on
K/V gathered from the pages (lower-right causal mask) and on contiguous, never-paged
K/V (the "no paging" reference); FlashInfer's BatchPrefillWithPagedKVCacheWrapper
(fa2 and fa3 backends) when it is installed. Times are CUDA-event medians after
warm-up; TFLOP/s counts the exact causal (query, key) pairs x 4 x D x H; the dense
rate is a large torch.matmul of the same dtype measured in the same run, and the
copy bandwidth a large device-to-device copy, for the mixed step's GB/s.

    python benchmarks/prefill_bench.py [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

import pagedattn

DEV = torch.device("cuda")
B = 16  # page size


def timed(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]  # µs


def matmul_tflops(dtype):
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=dtype)
    b = torch.randn(n, n, device=DEV, dtype=dtype)
    us = timed(lambda: torch.matmul(a, b), iters=10)
    return 2 * n**3 / us / 1e6


def copy_gbps():
    x = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    us = timed(lambda: y.copy_(x), iters=10)
    return 2 * x.numel() / us / 1e3


class Shape:
    """Sequences given as (seq_len, q_len): the last q_len tokens are the queries."""

    def __init__(self, name, seqs, heads, kv_heads, head_size, dtype):
        self.name, self.seqs, self.H, self.K, self.D, self.dtype = name, seqs, heads, kv_heads, head_size, dtype
        self.T = sum(q for _, q in seqs)
        self.pairs = sum(sum(n - q + j + 1 for j in range(q)) for n, q in seqs)
        self.flops = 4 * self.pairs * self.D * self.H
        self.kv_bytes = sum(n for n, _ in seqs) * self.K * self.D * 2 * torch.finfo(dtype).bits // 8


def mixed_shapes(n_decodes, dtype, name=None):
    """The mixed step (a 512-row chunk at 2048 plus n_decodes one-row sequences at 2048,
    GQA 32/8 d128) and, for 127 decodes, its two parts alone: shared with profile_mixed.py."""
    chunk, decodes = [(2048, 512)], [(2048, 1)] * n_decodes
    mixed = Shape(name or f"mixed: chunk 512 at 2048 + {n_decodes} decodes at 2048", chunk + decodes, 32, 8, 128, dtype)
    if n_decodes != 127:
        return [mixed]
    return [mixed, Shape("  its chunk alone", chunk, 32, 8, 128, dtype),
            Shape("  its 127 decodes alone", decodes, 32, 8, 128, dtype)]  # fmt: skip


def make_inputs(sh, layout, g):
    nb = sum(-(-n // B) for n, _ in sh.seqs)
    kshape, vshape = pagedattn.kv_cache_shape(nb, B, sh.K, sh.D, str(sh.dtype).split(".")[1], layout)
    kc = torch.randn(kshape, device=DEV, dtype=sh.dtype, generator=g)
    vc = torch.randn(vshape, device=DEV, dtype=sh.dtype, generator=g)
    m = max(-(-n // B) for n, _ in sh.seqs)
    perm = torch.randperm(nb, device=DEV, generator=g).to(torch.int32)
    bt = torch.zeros((len(sh.seqs), m), dtype=torch.int32, device=DEV)
    pos = 0
    for i, (n, _) in enumerate(sh.seqs):
        k = -(-n // B)
        bt[i, :k] = perm[pos : pos + k]
        pos += k
    sl = torch.tensor([n for n, _ in sh.seqs], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0] + list(torch.tensor([q for _, q in sh.seqs]).cumsum(0)), dtype=torch.int32, device=DEV)
    q = torch.randn((sh.T, sh.H, sh.D), device=DEV, dtype=sh.dtype, generator=g)
    return q, kc, vc, bt, sl, qsl


def sdpa_rows(q, k, v):
    """q [q, H, D], k / v [n, K, D]: the last q of n tokens, causal (lower right)."""
    nq, n = q.shape[0], k.shape[0]
    # A whole prompt takes the plain causal flag (the flash kernel); a chunk needs the mask.
    mask = None if nq == n else torch.ones((nq, n), dtype=torch.bool, device=DEV).tril(diagonal=n - nq)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip


def bench_shape(sh, g, dense, copy_bw, flashinfer, peers=True):
    row = {"shape": sh.name, "T": sh.T, "pairs": sh.pairs}
    mql = max(q for _, q in sh.seqs)
    for layout in ("vllm", "nhd"):
        q, kc, vc, bt, sl, qsl = make_inputs(sh, layout, g)
        out = torch.empty_like(q)
        row[f"pagedattn_{layout}"] = timed(functools.partial(
            pagedattn.paged_attention, q, kc, vc, bt, sl, query_start_loc=qsl, max_query_len=mql, out=out))  # fmt: skip
    if not peers:
        return with_rates(row, sh, dense, copy_bw)
    # nhd cache for the peers: [N, B, K, D]
    q, kc, vc, bt, sl, qsl = make_inputs(sh, "nhd", g)
    spans = [(int(qsl[i]), int(qsl[i + 1])) for i in range(len(sh.seqs))]
    pages = [bt[i, : -(-n // B)].long() for i, (n, _) in enumerate(sh.seqs)]

    def gathered():
        for (lo, hi), p, (n, _) in zip(spans, pages, sh.seqs):
            if hi > lo:
                sdpa_rows(q[lo:hi], kc[p].flatten(0, 1)[:n], vc[p].flatten(0, 1)[:n])

    dense_kv = [(kc[p].flatten(0, 1)[:n].contiguous(), vc[p].flatten(0, 1)[:n].contiguous())
                for p, (n, _) in zip(pages, sh.seqs)]  # fmt: skip

    def contiguous():
        for (lo, hi), (k, v) in zip(spans, dense_kv):
            if hi > lo:
                sdpa_rows(q[lo:hi], k, v)

    row["sdpa_gathered"] = timed(gathered, iters=5, warmup=2)
    row["sdpa_contiguous"] = timed(contiguous, iters=5, warmup=2)
    if flashinfer is not None:
        for backend in ("fa2", "fa3"):
            try:
                ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                indptr = torch.tensor([0] + list(torch.tensor([-(-n // B) for n, _ in sh.seqs]).cumsum(0)),
                                      dtype=torch.int32, device=DEV)  # fmt: skip
                indices = torch.cat(pages).to(torch.int32)
                last = torch.tensor([(n - 1) % B + 1 for n, _ in sh.seqs], dtype=torch.int32, device=DEV)
                w.plan(qsl, indptr, indices, last, sh.H, sh.K, sh.D, B, causal=True, q_data_type=sh.dtype)
                row[f"flashinfer_{backend}"] = timed(functools.partial(w.run, q, (kc, vc)))
            except Exception as e:  # a backend this GPU or build lacks
                row[f"flashinfer_{backend}"] = f"n/a ({type(e).__name__})"
    return with_rates(row, sh, dense, copy_bw)


def with_rates(row, sh, dense, copy_bw):
    """Adds TFLOP/s, percent of the dense rate and KV GB/s beside every time of the row."""
    dense_rate = dense[sh.dtype]
    for key in list(row):
        if isinstance(row[key], float):
            tf = sh.flops / row[key] / 1e6
            row[key + "_tflops"] = round(tf, 1)
            row[key + "_pct_dense"] = round(100 * tf / dense_rate, 1)
            row[key + "_kv_gbps"] = round(sh.kv_bytes / row[key] / 1e3, 1)
    row["dense_tflops"] = round(dense_rate, 1)
    row["copy_gbps"] = round(copy_bw, 1)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--more", action="store_true",
                    help="add batches of many prompts: 16 x 512 and 12 prompts of 64 to 4096 tokens (GQA), "
                         "MHA 8 x 1024 (the persistent grid's deal of unequal tiles)")  # fmt: skip
    ap.add_argument("--pagedattn-only", action="store_true",
                    help="time pagedattn alone (no SDPA or FlashInfer columns), e.g. to compare kernel families "
                         "with PAGEDATTN_PREFILL_KERNEL=mma")  # fmt: skip
    args = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator(device=DEV).manual_seed(0)
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        flashinfer = None
    bf, fp = torch.bfloat16, torch.float16
    dense = {bf: matmul_tflops(bf), fp: matmul_tflops(fp)}
    copy_bw = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: dense bf16 {dense[bf]:.0f} TFLOP/s, f16 {dense[fp]:.0f} TFLOP/s, "
          f"copy {copy_bw:.0f} GB/s, flashinfer {'yes' if flashinfer else 'not installed'}")  # fmt: skip
    shapes = [
        Shape("prefill 1 x 8192 (GQA 32/8 d128 bf16)", [(8192, 8192)], 32, 8, 128, bf),
        Shape("prefill 8 x 1024 (GQA 32/8 d128 bf16)", [(1024, 1024)] * 8, 32, 8, 128, bf),
        Shape("chunk 2048 over 14336 (GQA 32/8 d128 bf16)", [(16384, 2048)], 32, 8, 128, bf),
        *mixed_shapes(127, bf),
        Shape("seed step 2 (OPT-125m 12 x d64 f16)", [(485, 1), (484, 456)], 12, 12, 64, fp),
        Shape("MHA 32 x d128 f16, 4 x 2048", [(2048, 2048)] * 4, 32, 32, 128, fp),
    ]
    if args.more:
        skewed = [(n, n) for n in (4096, 64, 2048, 512, 256, 2048, 4096, 128, 1024, 64, 256, 64)]
        mix4x60 = [(1024, 256)] * 4 + [(4096, 1)] * 60
        shapes += [
            Shape("more: prefill 16 x 512 (GQA 32/8 d128 bf16)", [(512, 512)] * 16, 32, 8, 128, bf),
            Shape("more: 12 prompts of 64-4096 (GQA 32/8 d128 bf16)", skewed, 32, 8, 128, bf),
            Shape("more: MHA 32 x d128 f16, 8 x 1024", [(1024, 1024)] * 8, 32, 32, 128, fp),
            *mixed_shapes(511, bf, "more: chunk 512 at 2048 + 511 decodes at 2048"),  # mostly empty varlen items
            Shape("more: 4 chunks of 256 at 1024 + 60 decodes at 4096", mix4x60, 32, 8, 128, bf),
        ]
    rows = []
    for sh in shapes:
        row = bench_shape(sh, g, dense, copy_bw, flashinfer, peers=not args.pagedattn_only)
        rows.append(row)
        cells = [f"{k}={row[k]:.1f}us ({row.get(k + '_tflops', 0)} TF, {row.get(k + '_pct_dense', 0)}%)"
                 for k in row if isinstance(row[k], float) and not k.endswith(("tflops", "dense", "gbps"))]  # fmt: skip
        print(f"{sh.name}: " + "; ".join(cells), flush=True)
    # The decode-only batch through the decode kernel (no query_start_loc), for the mixed-step target.
    sh = shapes[5]
    q, kc, vc, bt, sl, _ = make_inputs(sh, "vllm", g)
    out = torch.empty_like(q)
    dec = timed(lambda: pagedattn.paged_attention(q, kc, vc, bt, sl, out=out))
    mixed, chunk = rows[3]["pagedattn_vllm"], rows[4]["pagedattn_vllm"]
    print(f"mixed step {mixed:.1f} us vs decode kernel alone {dec:.1f} + chunk alone {chunk:.1f} "
          f"= {mixed / (dec + chunk):.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "decode_alone_us": dec,
                       "mixed_ratio": mixed / (dec + chunk)}, f, indent=1)  # fmt: skip
    assert math.isfinite(mixed)


if __name__ == "__main__":
    main()
