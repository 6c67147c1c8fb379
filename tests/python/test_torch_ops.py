"""pagedattn.torch: the torch.ops.pagedattn operators.

Schemas (what each operator writes), torch.library.opcheck of every operator on CPU (and
CUDA), results against the plain calls and the float64 reference, fake implementations
(shapes and trace-time errors), a small decoder layer under torch.compile(fullgraph=True)
against eager and the reference, CUDA graphs (mode="reduce-overhead") replayed with new block
tables and lengths, the inference-only autograd, and `import pagedattn` not importing torch.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys

import numpy as np
import pytest

import pagedattn
from conftest import FP8_KV_CACHE_DTYPES, TOL, make_problem
from pagedattn.reference import paged_attention_ref

torch = pytest.importorskip("torch")
pt = pytest.importorskip("pagedattn.torch")

ops = torch.ops.pagedattn
HAS_CUDA = torch.cuda.is_available() and pagedattn.built_with_cuda()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"))]


def test_import_pagedattn_does_not_import_torch():
    code = "import sys, pagedattn; pagedattn.paged_attention; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # and the submodule's `import torch` is the top-level torch, not itself
    code = "import pagedattn.torch as p, torch; assert torch.__name__ == 'torch' and p.torch is torch"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _written(op) -> set:
    return {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def test_import_registers_each_kernel_once():
    """Some torch versions refuse a second Python kernel for an operator's dispatch key (the
    default of Library.impl's allow_override): the import registers each kernel once, so it
    imports under that rule on any version."""
    code = (
        "import inspect, torch.library as L\n"
        "impl = L.Library.impl\n"
        "if 'allow_override' in inspect.signature(impl).parameters:\n"
        "    def strict(self, *args, allow_override=False, **kwargs):\n"
        "        return impl(self, *args, allow_override=allow_override, **kwargs)\n"
        "    L.Library.impl = strict\n"
        "import torch, pagedattn.torch\n"
        "for name in ('paged_attention.out', 'reshape_and_cache', 'copy_blocks', 'swap_blocks'):\n"
        "    for key in ('Autograd', 'ADInplaceOrView', 'CompositeExplicitAutograd'):\n"
        "        assert torch._C._dispatch_has_kernel_for_dispatch_key('pagedattn::' + name, key), (name, key)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_schemas_declare_what_each_operator_writes():
    assert _written(ops.paged_attention.default) == set()
    assert _written(ops.paged_attention.out) == {"out", "workspace"}
    assert _written(ops.reshape_and_cache.default) == {"key_cache", "value_cache"}
    assert _written(ops.copy_blocks.default) == {"key_caches", "value_caches"}
    assert _written(ops.swap_blocks.default) == {"dst"}
    assert [r.type.kind() for r in ops.paged_attention.default._schema.returns] == ["TensorType"]
    for op in (
        ops.paged_attention.out,
        ops.reshape_and_cache.default,
        ops.copy_blocks.default,
        ops.swap_blocks.default,
    ):
        assert op._schema.returns == [], op


def _plain_keywords(fn) -> dict:
    """{keyword: default} of a compiled function, read from its nanobind signature."""
    nb_sig = getattr(fn, "__nb_signature__", None)
    if nb_sig is None:
        sig = inspect.signature(fn)
        return {n: p.default for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    args = ast.parse(nb_sig[0][0] + ": ...").body[0].args
    return {a.arg: ast.literal_eval(d) for a, d in zip(args.kwonlyargs, args.kw_defaults)}


@pytest.mark.parametrize(
    "plain, table, not_options",
    [
        (pagedattn.paged_attention, pt.ATTENTION_OPTIONS, {"out", "workspace", "stream"}),
        (pagedattn.reshape_and_cache, pt.CACHE_WRITE_OPTIONS, {"stream"}),
    ],
    ids=["paged_attention", "reshape_and_cache"],
)
def test_operators_take_every_option_of_the_plain_call(plain, table, not_options):
    """An option added to the plain call must be added to the operators' table (one line)."""
    plain_options = {n: d for n, d in _plain_keywords(plain).items() if n not in not_options}
    assert {pt._PLAIN_NAMES.get(name, name): default for name, _, default in table} == plain_options


def _problem(rng, device, dtype=torch.float32, seq_lens=(17, 1, 32), layout="vllm", **kw):
    p = make_problem(rng, list(seq_lens), layout=layout, **kw)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    q, kc, vc = (t(a).to(dtype) for a in (p.query, p.key_cache, p.value_cache))
    return p, (q, kc, vc, t(p.block_tables), t(p.seq_lens))


def _varlen(rng, device, q_lens=(3, 1, 5), ctx=(9, 16, 4)):
    """A mixed batch: sequence i has q_lens[i] new query rows after ctx[i] cached tokens."""
    seq_lens = [c + n for c, n in zip(ctx, q_lens)]
    p, (_, kc, vc, bt, sl) = _problem(rng, device, seq_lens=seq_lens)
    q = torch.randn(sum(q_lens), p.query.shape[1], p.query.shape[2], dtype=torch.float32).to(device)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
    return p, (q, kc, vc, bt, sl), qsl, max(q_lens)


def _opcheck_cases(rng, device):
    p, args = _problem(rng, device)
    q, kc, vc, bt, sl = args
    h = q.shape[1]
    _, vargs, qsl, mql = _varlen(rng, device)
    cases = [
        ("decode", ops.paged_attention.default, args, {}),
        ("options", ops.paged_attention.default, args, {"scale": 0.3, "alibi_slopes": torch.rand(h, device=device)}),
        ("varlen", ops.paged_attention.default, vargs, {"query_start_loc": qsl, "max_query_len": mql}),
        ("variants", ops.paged_attention.default, vargs,
         {"query_start_loc": qsl, "max_query_len": mql, "sliding_window": 3, "soft_cap": 5.0,
          "sinks": torch.rand(h, device=device)}),
        ("hnd", ops.paged_attention.default, _problem(rng, device, layout="hnd")[1], {"layout": "hnd"}),
        ("out", ops.paged_attention.out, args, {"out": torch.empty_like(q)}),
        ("out_varlen", ops.paged_attention.out, vargs,
         {"out": torch.empty_like(vargs[0]), "query_start_loc": qsl, "max_query_len": mql}),
    ]  # fmt: skip
    k = torch.randn(4, kc.shape[1], q.shape[2], device=device)
    slots = torch.tensor([0, 5, -1, 7], device=device)
    cases.append(
        ("cache_write", ops.reshape_and_cache.default, (k, torch.randn_like(k), kc.clone(), vc.clone(), slots), {})
    )
    pairs = torch.tensor([[0, 2], [1, 3]], device=device)
    cases.append(
        ("copy_blocks", ops.copy_blocks.default, ([kc.clone(), kc.clone()], [vc.clone(), vc.clone()], pairs), {})
    )
    host_pairs = torch.tensor([[0, 2], [1, 3]])
    cases.append(("swap_blocks", ops.swap_blocks.default, (kc.clone(), torch.zeros_like(kc).cpu(), host_pairs), {}))
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_operator(rng, device):
    names = set()
    for name, op, args, kwargs in _opcheck_cases(rng, device):
        result = torch.library.opcheck(op, args, kwargs)
        assert set(result.values()) == {"SUCCESS"}, (name, result)
        names.add(op.name())
    assert names == {
        f"pagedattn::{n}"
        for n in ("paged_attention", "paged_attention.out", "reshape_and_cache", "copy_blocks", "swap_blocks")
    }


@pytest.mark.parametrize("device", DEVICES)
def test_results_match_the_plain_calls_and_the_reference(rng, device):
    p, args = _problem(rng, device, alibi=True)
    slopes = torch.from_numpy(p.alibi_slopes).to(device)
    got = ops.paged_attention(*args, scale=0.2, alibi_slopes=slopes)
    assert torch.equal(got, pagedattn.paged_attention(*args, scale=0.2, alibi_slopes=slopes))
    ref = paged_attention_ref(*p.args(), scale=0.2, alibi_slopes=p.alibi_slopes)
    np.testing.assert_allclose(got.cpu().double().numpy(), ref, *TOL["float32"])
    # the .out overload and the wrapper, varlen
    vp, vargs, qsl, mql = _varlen(rng, device)
    out = torch.full_like(vargs[0], float("nan"))
    assert pt.paged_attention(*vargs, out=out, query_start_loc=qsl, max_query_len=mql) is out
    vref = paged_attention_ref(vargs[0].cpu().numpy(), *vp.args()[1:], query_start_loc=qsl.cpu().numpy())
    np.testing.assert_allclose(out.cpu().double().numpy(), vref, *TOL["float32"])
    assert torch.equal(out, ops.paged_attention(*vargs, query_start_loc=qsl, max_query_len=mql))
    # the attention variants reach the kernels through the operators' option schema
    h = vargs[0].shape[1]
    sinks = torch.rand(h, device=device)
    variants = dict(query_start_loc=qsl, max_query_len=mql, sliding_window=3, soft_cap=5.0, sinks=sinks)
    got = ops.paged_attention(*vargs, **variants)
    assert torch.equal(got, pagedattn.paged_attention(*vargs, **variants))
    vref = paged_attention_ref(vargs[0].cpu().numpy(), *vp.args()[1:], query_start_loc=qsl.cpu().numpy(),
                               sliding_window=3, soft_cap=5.0, sinks=sinks.cpu().numpy())  # fmt: skip
    np.testing.assert_allclose(got.cpu().double().numpy(), vref, *TOL["float32"])
    assert not np.allclose(got.cpu().double().numpy(), out.cpu().double().numpy(), atol=1e-3)


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
def test_fp8_cache_options_reach_the_kernels(rng, kind):
    """kv_cache_dtype / k_scale / v_scale go through both writing and reading operators."""
    h, k, d, b = 4, 2, 64, 16
    kc, vc = (c.zero_() for c in pt.empty_kv_cache(4, b, k, d, torch.uint8))
    key, value = torch.randn(20, k, d), torch.randn(20, k, d)
    slots = torch.arange(20)
    opts = {"kv_cache_dtype": kind, "k_scale": 0.5, "v_scale": 0.25}
    ops.reshape_and_cache(key, value, kc, vc, slots, **opts)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    pagedattn.reshape_and_cache(key, value, kc2, vc2, slots, **opts)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    q = torch.randn(1, h, d)
    bt, sl = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    got = ops.paged_attention(q, kc, vc, bt, sl, **opts)
    assert torch.equal(got, pagedattn.paged_attention(q, kc, vc, bt, sl, **opts))
    assert not torch.equal(got, ops.paged_attention(q, kc, vc, bt, sl, kv_cache_dtype=kind))  # the scales count


def test_fake_implementations_give_shapes_and_trace_time_errors():
    meta = torch.device("meta")
    q = torch.empty(5, 4, 64, device=meta)
    kc, vc = pt.empty_kv_cache(8, 16, 2, 64, torch.float32, device=meta)
    bt = torch.empty(3, 4, dtype=torch.int32, device=meta)
    sl = torch.empty(3, dtype=torch.int32, device=meta)
    qsl = torch.empty(4, dtype=torch.int32, device=meta)
    out = ops.paged_attention(q, kc, vc, bt, sl, query_start_loc=qsl, max_query_len=3)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == meta
    with pytest.raises(TypeError, match=r"block_tables: expected int32, got int64"):
        ops.paged_attention(q[:3], kc, vc, bt.long(), sl)
    with pytest.raises(ValueError, match=r"query has 5 rows but seq_lens 3 sequences"):
        ops.paged_attention(q, kc, vc, bt, sl)
    with pytest.raises(ValueError, match=r"query_start_loc: expected 4 entries \(S \+ 1\), got 3"):
        ops.paged_attention(q, kc, vc, bt, sl, query_start_loc=qsl[:3])
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 4, 64\)"):
        ops.paged_attention.out(q[:3], kc, vc, bt, sl, out=q)
    with pytest.raises(ValueError, match=r"slot_mapping: expected 5 slots"):
        ops.reshape_and_cache(torch.empty(5, 2, 64, device=meta), torch.empty(5, 2, 64, device=meta), kc, vc,
                              torch.empty(4, dtype=torch.int64, device=meta))  # fmt: skip
    with pytest.raises(ValueError, match=r"block_mapping: expected \[P, 2\]"):
        ops.copy_blocks([kc], [vc], torch.empty(3, 3, dtype=torch.int64, device=meta))


def test_decode_kernel_is_the_plain_calls_kernel_option(rng):
    _, args = _problem(rng, "cpu")
    want = pagedattn.paged_attention(*args, kernel="single_pass")
    assert torch.equal(ops.paged_attention(*args, decode_kernel="single_pass"), want)
    assert torch.equal(pt.paged_attention(*args, kernel="single_pass"), want)
    for call in (
        lambda: ops.paged_attention(*args, decode_kernel="bogus"),
        lambda: pt.paged_attention(*args, kernel="bogus"),
    ):
        with pytest.raises(ValueError, match=r'kernel: got "bogus", expected "auto"'):
            call()


def test_eager_errors_are_the_plain_calls_errors(rng):
    _, (q, kc, vc, bt, sl) = _problem(rng, "cpu")
    with pytest.raises(IndexError, match=r"seq_lens\[0\] = 1000000 is outside"):
        ops.paged_attention(q, kc, vc, bt, sl.clone().fill_(10**6))
    with pytest.raises(ValueError, match="workspace is taken with out= only"):
        pt.paged_attention(q, kc, vc, bt, sl, workspace=torch.empty(16, dtype=torch.uint8))


def test_writing_operators_bump_the_version_of_what_they_write(rng):
    """Autograd's saved-tensor checks and functionalization see the writes."""
    _, (q, kc, vc, bt, sl) = _problem(rng, "cpu")
    key = torch.randn(2, kc.shape[1], q.shape[2])
    out, ws = torch.empty_like(q), torch.empty(64, dtype=torch.uint8)
    before = [t._version for t in (kc, vc, out, ws, q, key)]
    ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1]))
    ops.copy_blocks([kc], [vc], torch.tensor([[0, 1]]))
    ops.paged_attention.out(q, kc, vc, bt, sl, out, ws)
    after = [t._version for t in (kc, vc, out, ws, q, key)]
    assert [a - b for a, b in zip(after, before)] == [2, 2, 1, 1, 0, 0]
    ops.swap_blocks(kc, vc.new_empty(kc.shape), torch.tensor([[0, 1]]))
    assert kc._version == after[0]  # swap_blocks reads src


def test_autograd_is_a_clear_error(rng):
    _, (q, kc, vc, bt, sl) = _problem(rng, "cpu")
    x = q.clone().requires_grad_()
    y = ops.paged_attention(x, kc, vc, bt, sl)  # forward works (inference without no_grad)
    assert torch.equal(y.detach(), ops.paged_attention(q, kc, vc, bt, sl))
    with pytest.raises(RuntimeError, match=r"pagedattn::paged_attention has no backward.*inference_mode"):
        y.sum().backward()
    key = torch.randn(2, kc.shape[1], q.shape[2], requires_grad=True)
    slots = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=r"pagedattn::reshape_and_cache has no backward"):
        ops.reshape_and_cache(key, key.detach(), kc, vc, slots)
    with pytest.raises(RuntimeError, match=r"pagedattn::paged_attention.out has no backward"):
        pt.paged_attention(x, kc, vc, bt, sl, out=torch.empty_like(q))
    with torch.no_grad():  # the writing operators are fine without grad mode
        ops.reshape_and_cache(key, key, kc, vc, slots)
        pt.paged_attention(x, kc, vc, bt, sl, out=torch.empty_like(q))


# ---- a small decoder layer: QKV projection, reshape_and_cache, paged attention, output ----

H, K, D, B, HIDDEN = 4, 2, 64, 16, 128


class DecoderLayer(torch.nn.Module):
    def __init__(self, num_blocks: int, device):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, (H + 2 * K) * D, bias=False, device=device)
        self.o = torch.nn.Linear(H * D, HIDDEN, bias=False, device=device)
        kc, vc = pt.empty_kv_cache(num_blocks, B, K, D, torch.float32, device=device)
        self.register_buffer("key_cache", kc.fill_(float("nan")))
        self.register_buffer("value_cache", vc.fill_(float("nan")))

    def attention_inputs(self, x):
        q, k, v = self.qkv(x).split([H * D, K * D, K * D], dim=-1)
        t = x.shape[0]
        return q.view(t, H, D), k.view(t, K, D), v.view(t, K, D)

    def forward(self, x, slot_mapping, block_tables, seq_lens, query_start_loc=None, max_query_len: int = 1):
        q, k, v = self.attention_inputs(x)
        torch.ops.pagedattn.reshape_and_cache(k, v, self.key_cache, self.value_cache, slot_mapping)
        a = torch.ops.pagedattn.paged_attention(
            q, self.key_cache, self.value_cache, block_tables, seq_lens,
            query_start_loc=query_start_loc, max_query_len=max_query_len,
        )  # fmt: skip
        return self.o(a.reshape(x.shape[0], H * D))


def _pair(num_blocks, device):
    torch.manual_seed(0)
    eager = DecoderLayer(num_blocks, device)
    other = DecoderLayer(num_blocks, device)
    other.load_state_dict(eager.state_dict())
    return eager, other


def _slots(block_tables, starts, counts):
    """Slot ids of tokens starts[i] .. starts[i] + counts[i] - 1 of every sequence."""
    out = []
    for row, s, n in zip(block_tables.tolist(), starts, counts):
        out += [row[t // B] * B + t % B for t in range(s, s + n)]
    return torch.tensor(out, dtype=torch.int64)


def _reference_output(layer, x, block_tables, seq_lens, qsl):
    """float64: the layer's own projections, the reference attention over its caches, o."""
    with torch.no_grad():
        q = layer.attention_inputs(x)[0].double().cpu().numpy()
        attn = paged_attention_ref(
            q, layer.key_cache.cpu().numpy(), layer.value_cache.cpu().numpy(), block_tables.cpu().numpy(),
            seq_lens.cpu().numpy(), query_start_loc=None if qsl is None else qsl.cpu().numpy(),
        )  # fmt: skip
        return torch.from_numpy(attn).reshape(x.shape[0], H * D) @ layer.o.weight.double().cpu().T


def test_compiled_decoder_layer_fullgraph_matches_eager_and_reference():
    eager, compiled_layer = _pair(12, "cpu")
    compiled = torch.compile(compiled_layer, fullgraph=True)  # a graph break raises
    bt = torch.tensor([[3, 7, 0], [9, 1, 0]], dtype=torch.int32)
    steps = [  # (new tokens per sequence, context before): a mixed prefill + decode batch, then two decodes
        ([5, 1], [0, 17]),
        ([1, 1], [5, 18]),
        ([1, 1], [6, 19]),
    ]
    # sequence 1's first 17 tokens, written by an earlier (eager) prefill into both layers' caches
    x0 = torch.randn(17, HIDDEN)
    with torch.no_grad():
        for layer in (eager, compiled_layer):
            _, k, v = layer.attention_inputs(x0)
            ops.reshape_and_cache(k, v, layer.key_cache, layer.value_cache, _slots(bt[1:], [0], [17]))
    for counts, ctx in steps:
        x = torch.randn(sum(counts), HIDDEN)
        seq_lens = torch.tensor([c + n for c, n in zip(ctx, counts)], dtype=torch.int32)
        qsl = torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32)
        slots = _slots(bt, ctx, counts)
        with torch.no_grad():
            want = eager(x, slots, bt, seq_lens, qsl, max(counts))
            got = compiled(x, slots, bt, seq_lens, qsl, max(counts))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        ref = _reference_output(compiled_layer, x, bt, seq_lens, qsl)
        np.testing.assert_allclose(got.double().numpy(), ref.numpy(), atol=1e-4, rtol=1e-4)
        # the compiled layer wrote its cache buffers in place, like the eager one
        assert torch.equal(compiled_layer.key_cache.nan_to_num(), eager.key_cache.nan_to_num())
        assert torch.equal(compiled_layer.value_cache.nan_to_num(), eager.value_cache.nan_to_num())


def test_compiled_out_overload_and_block_copies_fullgraph(rng):
    p, (q, kc, vc, bt, sl) = _problem(rng, "cpu")

    def step(q, kc, vc, bt, sl, out, pairs):
        torch.ops.pagedattn.copy_blocks([kc], [vc], pairs)
        pt.paged_attention(q, kc, vc, bt, sl, out=out, scale=0.25)
        return out * 2

    pairs = torch.tensor([[int(bt[0, 0]), int(bt[2, 1])]])  # sequence 0's first block over one of sequence 2's
    want_out = torch.empty_like(q)
    kc_e, vc_e = kc.clone(), vc.clone()
    want = step(q, kc_e, vc_e, bt, sl, want_out, pairs)
    out = torch.empty_like(q)
    got = torch.compile(step, fullgraph=True)(q, kc, vc, bt, sl, out, pairs)
    assert torch.equal(got, want) and torch.equal(out, want_out)
    assert torch.equal(kc.nan_to_num(), kc_e.nan_to_num()) and torch.equal(vc.nan_to_num(), vc_e.nan_to_num())
    assert torch.equal(kc[int(bt[2, 1])], kc[int(bt[0, 0])])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_graphs_reduce_overhead_replays_with_new_block_tables_and_lengths():
    from torch._dynamo.utils import counters

    dev = torch.device("cuda")
    num_seqs, max_blocks, num_blocks = 3, 4, 24
    eager, graphed_layer = _pair(num_blocks, dev)
    torch._dynamo.mark_static_address(graphed_layer.key_cache)
    torch._dynamo.mark_static_address(graphed_layer.value_cache)
    counters.clear()
    graphed = torch.compile(graphed_layer, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):  # warm-up, recording, then replays
        # a new block table (other block ids for every sequence) and new lengths every step
        bt = (
            torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks]
            .view(num_seqs, max_blocks)
            .to(torch.int32)
        )
        lengths = torch.randint(1, max_blocks * B + 1, (num_seqs,), generator=gen).tolist()
        # each sequence's history (all but its last token), written into both layers' caches
        history = _slots(bt, [0] * num_seqs, [n - 1 for n in lengths]).to(dev)
        kh, vh = (torch.randn(len(history), K, D, generator=gen).to(dev) for _ in range(2))
        for layer in (eager, graphed_layer):
            ops.reshape_and_cache(kh, vh, layer.key_cache, layer.value_cache, history)
        x = torch.randn(num_seqs, HIDDEN, generator=gen).to(dev)
        slots = _slots(bt, [n - 1 for n in lengths], [1] * num_seqs).to(dev)
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        bt = bt.to(dev)
        with torch.no_grad():
            want = eager(x, slots, bt, seq_lens)
            got = graphed(x, slots, bt, seq_lens).clone()  # the graph's output buffer is reused by the next replay
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        ref = _reference_output(graphed_layer, x, bt, seq_lens, None)
        np.testing.assert_allclose(got.double().cpu().numpy(), ref.numpy(), atol=1e-3, rtol=1e-3)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
