// C++ tests of the core: tensor views, DLPack conversion, validation errors, and the CPU
// decode and cache write against a direct double-precision computation.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <pagedattn/pagedattn.hpp>

#include "check.hpp"

using namespace pagedattn;

namespace {

// A struct shaped like DLPack's DLTensor, to exercise from_dlpack without the header.
struct FakeDLDevice {
  int device_type;
  int device_id;
};
struct FakeDLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct FakeDLTensor {
  void* data;
  FakeDLDevice device;
  int ndim;
  FakeDLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};

// A small float32 problem in the nhd layout with NaN in every unused slot.
struct Problem {
  int S = 3, H = 4, K = 2, D = 16, B = 4, M = 4, N = 12;
  std::vector<float> q, kc, vc, out;
  std::vector<std::int32_t> bt, lens;
  Problem() {
    std::mt19937 gen(1234);
    std::normal_distribution<float> nd;
    q.resize(static_cast<size_t>(S * H * D));
    for (auto& v : q) v = nd(gen);
    kc.assign(static_cast<size_t>(N * B * K * D), std::numeric_limits<float>::quiet_NaN());
    vc = kc;
    out.assign(q.size(), std::numeric_limits<float>::quiet_NaN());
    lens = {0, 5, 13};
    bt = {7, 7, 7, 7, 3, 9, 7, 7, 11, 0, 5, 2};  // padding points at block 7 (all NaN)
    for (int s = 0; s < S; ++s)
      for (int t = 0; t < lens[static_cast<size_t>(s)]; ++t) {
        const int blk = bt[static_cast<size_t>(s * M + t / B)];
        for (int h = 0; h < K; ++h)
          for (int d = 0; d < D; ++d) {
            const size_t i = static_cast<size_t>(((blk * B + t % B) * K + h) * D + d);
            kc[i] = nd(gen);
            vc[i] = nd(gen);
          }
      }
  }
  TensorView qv() { return make_view(q.data(), DType::kFloat32, {S, H, D}); }
  TensorView ov() { return make_view(out.data(), DType::kFloat32, {S, H, D}); }
  TensorView kv() { return make_view(kc.data(), DType::kFloat32, {N, B, K, D}); }
  TensorView vv() { return make_view(vc.data(), DType::kFloat32, {N, B, K, D}); }
  TensorView btv() { return make_view(bt.data(), DType::kInt32, {S, M}); }
  TensorView lv() { return make_view(lens.data(), DType::kInt32, {S}); }

  // With the variants: a sliding window (0 = off), a soft cap (0 = off), a sink (-inf = none).
  double ref(int s, int h, int d, int window = 0, double cap = 0.0,
             double sink = -std::numeric_limits<double>::infinity()) const {
    const int L = lens[static_cast<size_t>(s)];
    if (L == 0) return 0.0;
    const int kh = h / (H / K);
    const int t0 = window > 0 ? std::max(0, L - window) : 0;
    std::vector<double> logit(static_cast<size_t>(L));
    double mx = sink;
    for (int t = t0; t < L; ++t) {
      const int blk = bt[static_cast<size_t>(s * M + t / B)];
      double acc = 0;
      for (int e = 0; e < D; ++e)
        acc += static_cast<double>(q[static_cast<size_t>((s * H + h) * D + e)]) *
               kc[static_cast<size_t>(((blk * B + t % B) * K + kh) * D + e)];
      logit[static_cast<size_t>(t)] = acc / std::sqrt(static_cast<double>(D));
      if (cap > 0) logit[static_cast<size_t>(t)] = cap * std::tanh(logit[static_cast<size_t>(t)] / cap);
      mx = std::max(mx, logit[static_cast<size_t>(t)]);
    }
    double sum = std::exp(sink - mx), o = 0;
    for (int t = t0; t < L; ++t) {
      const int blk = bt[static_cast<size_t>(s * M + t / B)];
      const double p = std::exp(logit[static_cast<size_t>(t)] - mx);
      sum += p;
      o += p * vc[static_cast<size_t>(((blk * B + t % B) * K + kh) * D + d)];
    }
    return o / sum;
  }
};

}  // namespace

PA_TEST(view_contiguity_and_shape_str) {
  float buf[24];
  TensorView v = make_view(buf, DType::kFloat32, {2, 3, 4});
  PA_CHECK(v.is_contiguous());
  PA_CHECK_EQ(v.numel(), 24);
  PA_CHECK_EQ(v.shape_str(), std::string("[2, 3, 4]"));
  v.strides[1] = 8;
  PA_CHECK(!v.is_contiguous());
}

PA_TEST(from_dlpack_reads_all_fields) {
  float buf[12];
  std::int64_t shape[2] = {3, 4};
  std::int64_t strides[2] = {4, 1};
  FakeDLTensor t{buf, {1, 0}, 2, {4, 16, 1}, shape, strides, 8};
  TensorView v = from_dlpack(t);
  PA_CHECK(v.dtype == DType::kBFloat16);
  PA_CHECK(v.device == DeviceKind::kCPU);
  PA_CHECK_EQ(v.size(0), 3);
  PA_CHECK_EQ(v.stride(0), 4);
  PA_CHECK(v.data == reinterpret_cast<char*>(buf) + 8);
  FakeDLTensor no_strides{buf, {2, 1}, 2, {2, 32, 1}, shape, nullptr, 0};
  TensorView w = from_dlpack(no_strides);
  PA_CHECK(w.device == DeviceKind::kCUDA && w.device_id == 1 && w.dtype == DType::kFloat32);
  PA_CHECK_EQ(w.stride(0), 4);
  PA_CHECK_EQ(w.stride(1), 1);
}

PA_TEST(cpu_decode_matches_double_reference) {
  Problem p;
  paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv());
  for (int s = 0; s < p.S; ++s)
    for (int h = 0; h < p.H; ++h)
      for (int d = 0; d < p.D; ++d) {
        const double got = p.out[static_cast<size_t>((s * p.H + h) * p.D + d)];
        const double want = p.ref(s, h, d);
        if (!(std::fabs(got - want) <= 1e-5 + 1e-5 * std::fabs(want)))
          PA_FAIL_AT("out[" << s << "," << h << "," << d << "] = " << got << ", expected " << want);
      }
}

PA_TEST(cpu_decode_variants_match_double_reference) {
  Problem p;
  // Sequence 2 (13 tokens) in a window of 6 sees tokens 7..12: its first block (tokens
  // 0..3) is released (-1) and tokens 4..6 of its second block are NaN.
  const int window = 6;
  p.bt[static_cast<size_t>(2 * p.M)] = -1;
  for (int t = 4; t < 7; ++t)
    for (int h = 0; h < p.K; ++h)
      for (int d = 0; d < p.D; ++d) {
        const int blk = p.bt[static_cast<size_t>(2 * p.M + 1)];
        const size_t i = static_cast<size_t>(((blk * p.B + t % p.B) * p.K + h) * p.D + d);
        p.kc[i] = p.vc[i] = std::numeric_limits<float>::quiet_NaN();
      }
  std::vector<float> sinks = {0.5f, -1.0f, -std::numeric_limits<float>::infinity(), 3.0f};
  AttentionOptions opt;
  opt.sliding_window = window;
  opt.soft_cap = 1.5f;
  opt.sinks = make_view(sinks.data(), DType::kFloat32, {p.H});
  paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv(), opt);
  for (int s = 0; s < p.S; ++s)
    for (int h = 0; h < p.H; ++h)
      for (int d = 0; d < p.D; ++d) {
        const double got = p.out[static_cast<size_t>((s * p.H + h) * p.D + d)];
        const double want = p.ref(s, h, d, window, 1.5, sinks[static_cast<size_t>(h)]);
        if (!(std::fabs(got - want) <= 1e-5 + 1e-5 * std::fabs(want)))
          PA_FAIL_AT("out[" << s << "," << h << "," << d << "] = " << got << ", expected " << want);
      }
  // without the window the released block is read: an error naming it
  AttentionOptions plain;
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv(), plain), OutOfRange);
  AttentionOptions bad;
  bad.sliding_window = -3;
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv(), bad), InvalidArgument);
  bad = {};
  bad.soft_cap = std::numeric_limits<float>::quiet_NaN();
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv(), bad), InvalidArgument);
  bad = {};
  std::vector<double> sinks64(static_cast<size_t>(p.H));
  bad.sinks = make_view(sinks64.data(), DType::kFloat64, {p.H});
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv(), bad), TypeMismatch);
  bad.sinks = make_view(sinks.data(), DType::kFloat32, {p.H - 1});
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv(), bad), InvalidArgument);
}

// The problem's caches re-laid as "hnd" [N, K, B, D] halves of one [N, 2, K, B, D]
// allocation (NaN between the used slots): key and value blocks interleaved, each cache
// a block-strided view.
PA_TEST(cpu_decode_reads_hnd_halves_of_one_allocation) {
  Problem p;
  const std::int64_t E = static_cast<std::int64_t>(p.B) * p.K * p.D;  // one block of one cache
  std::vector<float> both(static_cast<size_t>(p.N * 2 * E), std::numeric_limits<float>::quiet_NaN());
  for (int n = 0; n < p.N; ++n)
    for (int t = 0; t < p.B; ++t)
      for (int h = 0; h < p.K; ++h)
        for (int d = 0; d < p.D; ++d) {
          const size_t from = static_cast<size_t>(((n * p.B + t) * p.K + h) * p.D + d);
          const size_t to = static_cast<size_t>(n * 2 * E + (h * p.B + t) * p.D + d);
          both[to] = p.kc[from];
          both[to + static_cast<size_t>(E)] = p.vc[from];
        }
  TensorView kv = make_view(both.data(), DType::kFloat32, {p.N, p.K, p.B, p.D});
  kv.strides[0] = 2 * E;
  TensorView vv = kv;
  vv.data = both.data() + E;
  AttentionOptions opt;
  opt.layout = CacheLayout::kHND;
  paged_attention(p.ov(), p.qv(), kv, vv, p.btv(), p.lv(), opt);
  for (int s = 0; s < p.S; ++s)
    for (int h = 0; h < p.H; ++h)
      for (int d = 0; d < p.D; ++d) {
        const double got = p.out[static_cast<size_t>((s * p.H + h) * p.D + d)];
        const double want = p.ref(s, h, d);
        if (!(std::fabs(got - want) <= 1e-5 + 1e-5 * std::fabs(want)))
          PA_FAIL_AT("out[" << s << "," << h << "," << d << "] = " << got << ", expected " << want);
      }
  // A block stride below one block would make blocks overlap: refused.
  kv.strides[0] = E - 1;
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), kv, vv, p.btv(), p.lv(), opt), InvalidArgument);
}

PA_TEST(validation_errors_are_typed) {
  Problem p;
  std::vector<std::int64_t> bt64(p.bt.begin(), p.bt.end());
  TensorView bad_bt = make_view(bt64.data(), DType::kInt64, {p.S, p.M});
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), bad_bt, p.lv()), TypeMismatch);
  p.bt[static_cast<size_t>(2 * p.M + 1)] = 99;
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv()), OutOfRange);
  PA_CHECK_THROWS(paged_attention(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv()), std::out_of_range);
  Problem p2;
  TensorView q2 = make_view(p2.q.data(), DType::kFloat32, {p2.S, p2.H, p2.D / 2});
  PA_CHECK_THROWS(paged_attention(p2.ov(), q2, p2.kv(), p2.vv(), p2.btv(), p2.lv()), InvalidArgument);
  AttentionOptions opt;
  opt.kernel = static_cast<DecodeKernel>(7);
  PA_CHECK_THROWS(paged_attention(p2.ov(), p2.qv(), p2.kv(), p2.vv(), p2.btv(), p2.lv(), opt), std::invalid_argument);
  try {
    paged_attention(p2.ov(), p2.qv(), p2.kv(), p2.vv(), p2.btv(), p2.lv(), opt);
  } catch (const InvalidArgument& e) {
    PA_CHECK(std::string(e.what()).find("kernel") != std::string::npos);
  }
}

PA_TEST(reshape_and_cache_then_decode_roundtrip_vllm_layout) {
  // Write keys/values with reshape_and_cache into the vllm layout, then decode one
  // sequence and compare with the nhd problem's reference (same tokens).
  Problem p;
  const int x = 4;  // 16 / sizeof(float)
  std::vector<float> kc(static_cast<size_t>(p.N * p.K * p.D * p.B), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> vc = kc;
  const int s = 2, L = p.lens[2];
  std::vector<float> k(static_cast<size_t>(L * p.K * p.D)), v(k.size());
  std::vector<std::int64_t> slots(static_cast<size_t>(L));
  for (int t = 0; t < L; ++t) {
    const int blk = p.bt[static_cast<size_t>(s * p.M + t / p.B)];
    slots[static_cast<size_t>(t)] = static_cast<std::int64_t>(blk) * p.B + t % p.B;
    for (int h = 0; h < p.K; ++h)
      for (int d = 0; d < p.D; ++d) {
        const size_t src = static_cast<size_t>(((blk * p.B + t % p.B) * p.K + h) * p.D + d);
        k[static_cast<size_t>((t * p.K + h) * p.D + d)] = p.kc[src];
        v[static_cast<size_t>((t * p.K + h) * p.D + d)] = p.vc[src];
      }
  }
  TensorView kcv = make_view(kc.data(), DType::kFloat32, {p.N, p.K, p.D / x, p.B, x});
  TensorView vcv = make_view(vc.data(), DType::kFloat32, {p.N, p.K, p.D, p.B});
  reshape_and_cache(make_view(k.data(), DType::kFloat32, {L, p.K, p.D}),
                    make_view(v.data(), DType::kFloat32, {L, p.K, p.D}), kcv, vcv,
                    make_view(slots.data(), DType::kInt64, {L}));
  std::vector<float> out(static_cast<size_t>(p.H * p.D));
  paged_attention(make_view(out.data(), DType::kFloat32, {1, p.H, p.D}),
                  make_view(p.q.data() + s * p.H * p.D, DType::kFloat32, {1, p.H, p.D}), kcv, vcv,
                  make_view(p.bt.data() + s * p.M, DType::kInt32, {1, p.M}),
                  make_view(p.lens.data() + s, DType::kInt32, {1}));
  for (int h = 0; h < p.H; ++h)
    for (int d = 0; d < p.D; ++d) {
      const double want = p.ref(s, h, d);
      const double got = out[static_cast<size_t>(h * p.D + d)];
      if (!(std::fabs(got - want) <= 1e-5 + 1e-5 * std::fabs(want)))
        PA_FAIL_AT("h=" << h << " d=" << d << ": " << got << " vs " << want);
    }
}

PA_TEST(kv_cache_shape_layouts) {
  CacheShapes s = kv_cache_shape(10, 16, 8, 128, 2, CacheLayout::kVLLM);
  PA_CHECK_EQ(s.key_ndim, 5);
  PA_CHECK_EQ(s.key[2], 16);
  PA_CHECK_EQ(s.key[4], 8);
  PA_CHECK_EQ(s.value[2], 128);
  PA_CHECK_THROWS(kv_cache_shape(10, 16, 8, 100, 2, CacheLayout::kVLLM), InvalidArgument);
  CacheShapes n = kv_cache_shape(10, 16, 8, 100, 2, CacheLayout::kNHD);
  PA_CHECK_EQ(n.key_ndim, 4);
  PA_CHECK_EQ(n.value[3], 100);
  CacheShapes h = kv_cache_shape(10, 16, 8, 100, 2, CacheLayout::kHND);  // [N, K, B, D]
  PA_CHECK_EQ(h.key_ndim, 4);
  PA_CHECK_EQ(h.key[1], 8);
  PA_CHECK_EQ(h.key[2], 16);
  PA_CHECK_EQ(h.value[3], 100);
}

PA_TEST(parsers_reject_unknown_names) {
  PA_CHECK(parse_layout("nhd") == CacheLayout::kNHD);
  PA_CHECK(parse_layout("hnd") == CacheLayout::kHND);
  PA_CHECK_THROWS(parse_layout("hdn"), InvalidArgument);
  PA_CHECK(parse_kv_cache_dtype("fp8") == KVCacheDType::kFp8E4M3);
  PA_CHECK_THROWS(parse_kv_cache_dtype("fp4"), InvalidArgument);
  PA_CHECK(parse_dtype("bfloat16") == DType::kBFloat16);
  PA_CHECK_THROWS(parse_dtype("complex64"), InvalidArgument);
}

int main() { return pagedattn_test::run_all(); }

PA_TEST(decode_plan_validates_like_workspace_size) {
  DecodeShape q;
  q.num_seqs = 1;
  q.num_heads = 32;
  q.num_kv_heads = 8;
  q.head_size = 128;
  q.block_size = 16;
  q.max_blocks_per_seq = 256;
  q.dtype = DType::kBFloat16;
  q.num_kv_heads = 7;  // 32 heads are not a multiple of 7
  PA_CHECK_THROWS(decode_plan(q), InvalidArgument);
  q.num_kv_heads = 8;
  AttentionOptions opt;
  opt.kernel = static_cast<DecodeKernel>(3);
  PA_CHECK_THROWS(decode_plan(q, opt), InvalidArgument);
  opt.kernel = DecodeKernel::kPartitioned;
  opt.partition_size = -16;
  PA_CHECK_THROWS(decode_workspace_size(q, opt), InvalidArgument);
  opt.partition_size = 0;
  q.head_size = 100;  // the "vllm" layout of a 16-bit cache needs a multiple of x = 8
  PA_CHECK_THROWS(decode_plan(q, opt), InvalidArgument);
  q.head_size = 128;
  if (!built_with_cuda()) {
    PA_CHECK_THROWS(decode_plan(q, opt), NotSupported);
    PA_CHECK_THROWS(decode_workspace_size(q, opt), NotSupported);
  } else {
    try {
      const DecodePlanInfo info = decode_plan(q, opt);  // on a machine with a GPU
      PA_CHECK(info.num_partitions >= 1 && info.ctas == 8 * info.num_partitions);
      PA_CHECK_EQ(info.workspace_bytes, decode_workspace_size(q, opt));
    } catch (const NotSupported&) {  // built with CUDA, no usable device here
    }
  }
}

PA_TEST(decode_kernel_names_round_trip) {
  for (DecodeKernel k : {DecodeKernel::kAuto, DecodeKernel::kSinglePass, DecodeKernel::kPartitioned})
    PA_CHECK(parse_decode_kernel(decode_kernel_name(k)) == k);
  PA_CHECK_THROWS(parse_decode_kernel("v2"), InvalidArgument);
}

PA_TEST(prepared_decode_validates_once_and_runs_like_the_eager_call) {
  Problem p;
  std::vector<float> eager(p.out.size(), -1.0f);
  paged_attention(make_view(eager.data(), DType::kFloat32, {p.S, p.H, p.D}), p.qv(), p.kv(), p.vv(), p.btv(),
                  p.lv());
  PreparedDecode prepared(p.ov(), p.qv(), p.kv(), p.vv(), p.btv(), p.lv());
  PA_CHECK(prepared.device() == DeviceKind::kCPU);
  prepared.run();
  for (size_t i = 0; i < eager.size(); ++i) PA_CHECK_EQ(p.out[i], eager[i]);
  // The index contents are checked again on every host run.
  p.bt[4] = 1 << 30;  // sequence 1 (length 5) reads its first block id
  PA_CHECK_THROWS(prepared.run(), OutOfRange);
  // Moved-from and moved-to objects behave.
  p.bt[4] = 3;
  PreparedDecode moved(std::move(prepared));
  moved.run(nullptr);
  // A read-only output is refused by the validation pass, for C++ callers too.
  TensorView ro = p.ov();
  ro.read_only = true;
  PA_CHECK_THROWS(PreparedDecode(ro, p.qv(), p.kv(), p.vv(), p.btv(), p.lv()), InvalidArgument);
  PA_CHECK_THROWS(paged_attention(ro, p.qv(), p.kv(), p.vv(), p.btv(), p.lv()), InvalidArgument);
}

PA_TEST(cpu_varlen_matches_double_causal_reference) {
  // Query rows of each sequence are its last tokens: 0 rows of the empty sequence, the
  // last 2 of the 5-token one, all 13 of the other (a whole prompt, causal).
  Problem p;
  const std::vector<std::int32_t> qsl = {0, 0, 2, 15};
  const int T = 15;
  std::mt19937 gen(99);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(T * p.H * p.D));
  for (auto& v : q) v = nd(gen);
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  AttentionOptions opt;
  std::vector<std::int32_t> qsl_buf = qsl;
  opt.query_start_loc = make_view(qsl_buf.data(), DType::kInt32, {p.S + 1});
  opt.max_query_len = 13;
  TensorView qv = make_view(q.data(), DType::kFloat32, {T, p.H, p.D});
  paged_attention(make_view(out.data(), DType::kFloat32, {T, p.H, p.D}), qv, p.kv(), p.vv(), p.btv(), p.lv(),
                  opt);
  for (int s = 0; s < p.S; ++s) {
    const int L = p.lens[static_cast<size_t>(s)], lo = qsl[static_cast<size_t>(s)];
    const int n = qsl[static_cast<size_t>(s + 1)] - lo;
    for (int j = 0; j < n; ++j) {
      const int pos = L - n + j;
      for (int h = 0; h < p.H; ++h) {
        const int kh = h / (p.H / p.K);
        const float* qr = q.data() + static_cast<size_t>(((lo + j) * p.H + h) * p.D);
        std::vector<double> logit(static_cast<size_t>(pos + 1));
        double mx = -1e300;
        for (int t = 0; t <= pos; ++t) {
          const int blk = p.bt[static_cast<size_t>(s * p.M + t / p.B)];
          double acc = 0;
          for (int e = 0; e < p.D; ++e)
            acc += static_cast<double>(qr[e]) *
                   p.kc[static_cast<size_t>(((blk * p.B + t % p.B) * p.K + kh) * p.D + e)];
          logit[static_cast<size_t>(t)] = acc / std::sqrt(static_cast<double>(p.D));
          mx = std::max(mx, logit[static_cast<size_t>(t)]);
        }
        for (int d = 0; d < p.D; ++d) {
          double sum = 0, o = 0;
          for (int t = 0; t <= pos; ++t) {
            const int blk = p.bt[static_cast<size_t>(s * p.M + t / p.B)];
            const double w = std::exp(logit[static_cast<size_t>(t)] - mx);
            sum += w;
            o += w * p.vc[static_cast<size_t>(((blk * p.B + t % p.B) * p.K + kh) * p.D + d)];
          }
          const double want = o / sum;
          const double got = out[static_cast<size_t>(((lo + j) * p.H + h) * p.D + d)];
          if (!(std::fabs(got - want) <= 1e-5 + 1e-5 * std::fabs(want)))
            PA_FAIL_AT("row " << lo + j << " head " << h << " dim " << d << ": " << got << ", expected "
                              << want);
        }
      }
    }
  }
  // Bad contents are typed errors: decreasing offsets, a query longer than its sequence,
  // a max_query_len below a sequence's rows.
  qsl_buf = {0, 3, 2, 15};
  PA_CHECK_THROWS(paged_attention(make_view(out.data(), DType::kFloat32, {T, p.H, p.D}), qv, p.kv(), p.vv(),
                                  p.btv(), p.lv(), opt),
                  InvalidArgument);
  qsl_buf = {0, 0, 6, 15};  // 6 rows of a 5-token sequence
  PA_CHECK_THROWS(paged_attention(make_view(out.data(), DType::kFloat32, {T, p.H, p.D}), qv, p.kv(), p.vv(),
                                  p.btv(), p.lv(), opt),
                  InvalidArgument);
  qsl_buf = qsl;
  opt.max_query_len = 12;
  PA_CHECK_THROWS(paged_attention(make_view(out.data(), DType::kFloat32, {T, p.H, p.D}), qv, p.kv(), p.vv(),
                                  p.btv(), p.lv(), opt),
                  InvalidArgument);
}
