// The CUDA path of LinearAdapter::convert against the CPU path and the float64 reference, on
// seeded random data with odd sizes and strided layouts. Skipped without a CUDA device.
//
// Tolerances (max |cuda - cpu| over a plane, relative to that plane's largest |cpu| value; the
// same bounds the CPU path meets against convert_reference): float32 1e-4, bfloat16 2e-2,
// float16 4e-3. They follow from the GEMM inputs being in the source dtype (un-rotated keys and
// weights rounded to it) and from both results being rounded to the target dtype.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/kvbridge.h"
#include "src/adapter/convert_cuda.h"
#include "src/adapter/numeric.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/random_adapter.h"

namespace kvbridge {
namespace {

using testing::make_random_adapter;
using testing::spec;

double tolerance(DType dtype) {
  return dtype == DType::kFloat32 ? 1e-4 : dtype == DType::kBFloat16 ? 2e-2 : 4e-3;
}

// How a plane's [tokens, heads, dim] elements sit in its buffer; `pad` unused elements per row.
enum class Layout {
  kCanonical,  // [tokens, heads, dim], dense
  kHF,         // [heads, tokens, dim + pad]: Hugging Face [1, heads, tokens, dim] with padding
  kDimMajor,   // [dim, tokens, heads + pad]: no axis contiguous but heads
};

// A KV cache of one spec on the host, every plane in its own buffer; padding bytes are random.
struct HostKV {
  ModelSpec spec;
  int64_t tokens;
  std::vector<std::vector<unsigned char>> storage;
  std::vector<KVPlane> planes;  // strides; data points into storage

  HostKV(const ModelSpec& s, int64_t t, Layout layout, int64_t pad, uint32_t seed,
         float value_scale = 1.f)
      : spec(s), tokens(t) {
    const int64_t H = s.num_kv_heads, D = s.head_dim;
    const int64_t es = static_cast<int64_t>(dtype_size(s.dtype));
    std::mt19937 rng(seed);
    for (int64_t p = 0; p < 2 * s.num_layers; ++p) {
      KVPlane plane;
      int64_t elems = 0;
      switch (layout) {
        case Layout::kCanonical:
          plane = KVPlane{nullptr, H * D, D, 1};
          elems = t * H * D;
          break;
        case Layout::kHF:
          plane = KVPlane{nullptr, D + pad, t * (D + pad), 1};
          elems = H * t * (D + pad);
          break;
        case Layout::kDimMajor:
          plane = KVPlane{nullptr, H + pad, 1, t * (H + pad)};
          elems = D * t * (H + pad);
          break;
      }
      storage.emplace_back(static_cast<size_t>(std::max<int64_t>(elems, 1) * es));
      for (auto& b : storage.back()) b = static_cast<unsigned char>(rng());
      plane.data = storage.back().data();
      planes.push_back(plane);
    }
    std::normal_distribution<float> dist(0.f, value_scale);
    std::vector<float> dense(static_cast<size_t>(t * H * D));
    const KVView v = view();
    for (int64_t l = 0; l < s.num_layers; ++l)
      for (int k = 0; k < 2; ++k) {
        for (float& x : dense) x = dist(rng);
        detail::store_plane(dense.data(), H * D, s.dtype, t, H, D,
                            v.plane(l, static_cast<KVView::Kind>(k)));
      }
  }

  KVView view_at(const std::vector<void*>& bases, Device device) const {
    std::vector<KVPlane> p = planes;
    for (size_t i = 0; i < p.size(); ++i) p[i].data = bases[i];
    return KVView::from_planes(std::move(p), spec.dtype, device, tokens, spec.num_kv_heads,
                               spec.head_dim);
  }
  // A CPU view of this object's own buffers (writable through it).
  KVView view() const {
    std::vector<void*> bases;
    for (const auto& s : storage) bases.push_back(const_cast<unsigned char*>(s.data()));
    return view_at(bases, Device{});
  }
};

// A device copy of a HostKV's buffers, byte for byte.
struct DeviceKV {
  const HostKV& host;
  std::vector<void*> ptrs;
  explicit DeviceKV(const HostKV& h) : host(h) {
    for (const auto& s : h.storage) {
      void* p = nullptr;
      CUDA_OK(cudaMalloc(&p, s.size()));
      ptrs.push_back(p);
      CUDA_OK(cudaMemcpy(p, s.data(), s.size(), cudaMemcpyHostToDevice));
    }
    // A copy from pageable memory may still be in flight when cudaMemcpy returns; work on
    // non-blocking streams must not start before it lands.
    CUDA_OK(cudaDeviceSynchronize());
  }
  ~DeviceKV() {
    for (void* p : ptrs) (void)cudaFree(p);
  }
  DeviceKV(const DeviceKV&) = delete;
  DeviceKV& operator=(const DeviceKV&) = delete;
  KVView view() const { return host.view_at(ptrs, Device{DeviceType::kCUDA, 0}); }
  // The device buffers, copied into a new HostKV of the same layout (after the device is idle).
  HostKV download() const {
    CUDA_OK(cudaDeviceSynchronize());
    HostKV out = host;
    for (size_t i = 0; i < ptrs.size(); ++i) {
      CUDA_OK(cudaMemcpy(out.storage[i].data(), ptrs[i], out.storage[i].size(),
                         cudaMemcpyDeviceToHost));
      out.planes[i].data = out.storage[i].data();
    }
    return out;
  }
};

// Largest |got - want| / max |want| over the planes of two host views (a non-finite value in
// `got` where `want` is finite counts as infinite error).
double max_scaled_error(const KVView& got, const KVView& want) {
  const int64_t T = want.tokens(), H = want.kv_heads(), D = want.head_dim();
  std::vector<float> a(static_cast<size_t>(T * H * D)), b(a.size());
  double worst = 0;
  for (int64_t l = 0; l < want.num_layers(); ++l)
    for (int k = 0; k < 2; ++k) {
      detail::load_plane(got.plane(l, static_cast<KVView::Kind>(k)), got.dtype(), T, H, D,
                         a.data(), H * D);
      detail::load_plane(want.plane(l, static_cast<KVView::Kind>(k)), want.dtype(), T, H, D,
                         b.data(), H * D);
      double scale = 0;
      for (float v : b) scale = std::max(scale, static_cast<double>(std::fabs(v)));
      EXPECT_GT(scale, 0.0) << "plane " << l << "/" << k << " is all zeros";
      for (size_t i = 0; i < a.size(); ++i) {
        if (!std::isfinite(a[i]) && std::isfinite(b[i])) return INFINITY;
        worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]) / scale);
      }
    }
  return worst;
}

// True when every byte of `after` outside the viewed elements equals `before`'s.
bool padding_unchanged(const HostKV& before, const HostKV& after, const KVView& viewed_before) {
  const int64_t es = static_cast<int64_t>(dtype_size(before.spec.dtype));
  for (size_t p = 0; p < before.storage.size(); ++p) {
    std::vector<bool> element(before.storage[p].size(), false);
    const KVPlane& pl = viewed_before.plane(static_cast<int64_t>(p / 2),
                                            static_cast<KVView::Kind>(p % 2));
    const auto* base = before.storage[p].data();
    for (int64_t t = 0; t < viewed_before.tokens(); ++t)
      for (int64_t h = 0; h < viewed_before.kv_heads(); ++h)
        for (int64_t d = 0; d < viewed_before.head_dim(); ++d) {
          const int64_t off =
              static_cast<const unsigned char*>(pl.data) - base +
              (t * pl.token_stride + h * pl.head_stride + d * pl.dim_stride) * es;
          for (int64_t i = 0; i < es; ++i) element[static_cast<size_t>(off + i)] = true;
        }
    for (size_t i = 0; i < element.size(); ++i)
      if (!element[i] && before.storage[p][i] != after.storage[p][i]) return false;
  }
  return true;
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// One conversion scenario: the source view is tokens [slice, slice + tokens) of a buffer of
// slice + tokens + 4 tokens, the target view likewise, converted at start_pos.
struct Scenario {
  const char* name;
  ModelSpec source, target;
  std::vector<std::vector<int64_t>> layers;
  bool rope_aware = true;
  Layout src_layout = Layout::kHF, dst_layout = Layout::kHF;
  int64_t src_pad = 3, dst_pad = 2;
  int64_t tokens = 37, start_pos = 1001, slice = 0;
};

LayerAttention layer_attention(double base, RopeScaling scaling = {}, int64_t window = 0) {
  LayerAttention a;
  a.rope_base = base;
  a.rope_scaling = scaling;
  a.sliding_window = window;
  return a;
}

// Per-layer attention on both sides: a source of two RoPE groups (Gemma 3-like: windowed base
// 1e4, then base 1e6) and a target of three distinct RoPEs, so the tables are per set and the
// gather and epilogue pick each layer's.
Scenario per_layer_scenario(DType dtype) {
  const RopeScaling linear{RopeScaling::Type::kLinear, 2.0, 1.0, 4.0, 8192};
  const RopeScaling llama3{RopeScaling::Type::kLlama3, 8.0, 1.0, 4.0, 64};
  ModelSpec source = spec("src", 3, 3, 10, dtype, 3000.0, RopeStyle::kHalf);
  source.layer_attention = {layer_attention(1e4, {}, 512), layer_attention(1e4, {}, 512),
                            layer_attention(1e6)};
  ModelSpec target = spec("tgt", 4, 5, 6, dtype, 30000.0, RopeStyle::kInterleaved);
  target.layer_attention = {layer_attention(1e6, llama3), layer_attention(1e4, {}, 64),
                            layer_attention(5e5, linear), layer_attention(1e4, {}, 64)};
  Scenario sc{"per_layer_attention", source, target, {{0}, {0, 2}, {1, 2}, {0, 1, 2}}};
  sc.tokens = 41;
  return sc;
}

std::vector<Scenario> scenarios(DType dtype) {
  const RopeScaling linear{RopeScaling::Type::kLinear, 2.0, 1.0, 4.0, 8192};
  const RopeScaling llama3{RopeScaling::Type::kLlama3, 8.0, 1.0, 4.0, 64};
  const ModelSpec s3 = spec("src", 3, 3, 10, dtype, 10000.0, RopeStyle::kHalf);
  const ModelSpec t4 = spec("tgt", 4, 5, 6, dtype, 30000.0, RopeStyle::kInterleaved, linear);
  const std::vector<std::vector<int64_t>> map4 = {{0}, {0, 2}, {1, 2}, {0, 1, 2}};
  std::vector<Scenario> v;
  v.push_back({"hf_layouts_odd_sizes", s3, t4, map4});
  Scenario one{"one_token", s3, t4, map4};
  one.tokens = 1;
  one.start_pos = 0;
  one.src_layout = Layout::kCanonical;
  v.push_back(one);
  Scenario dim_major{"dim_major_llama3_interleaved_source",
                     spec("src", 2, 1, 6, dtype, 5000.0, RopeStyle::kInterleaved, llama3),
                     spec("tgt", 3, 2, 10, dtype, 20000.0, RopeStyle::kHalf),
                     {{1}, {0, 1}, {0}}};
  dim_major.src_layout = Layout::kDimMajor;
  dim_major.dst_layout = Layout::kDimMajor;
  dim_major.tokens = 29;
  dim_major.start_pos = 77;
  v.push_back(dim_major);
  Scenario sliced{"token_slices", s3, t4, map4};
  sliced.slice = 11;
  sliced.start_pos = 511;
  sliced.dst_layout = Layout::kCanonical;
  v.push_back(sliced);
  Scenario naive{"not_rope_aware", s3, t4, map4};
  naive.rope_aware = false;
  v.push_back(naive);
  // Source and target of different dtypes; the layer map skips source layer 1 entirely.
  const DType other = dtype == DType::kFloat32    ? DType::kBFloat16
                      : dtype == DType::kBFloat16 ? DType::kFloat16
                                                  : DType::kFloat32;
  Scenario mixed{"mixed_dtypes", s3,
                 spec("tgt", 2, 3, 6, other, 500000.0, RopeStyle::kHalf, llama3), {{0, 2}, {2}}};
  mixed.tokens = 53;
  v.push_back(mixed);
  v.push_back(per_layer_scenario(dtype));
  return v;
}

// Converts on the device and on the CPU; checks the CUDA result against convert and
// convert_reference and that nothing outside the target view was written.
void check_scenario(const Scenario& sc, const LinearAdapter& adapter, void* stream = nullptr) {
  SCOPED_TRACE(sc.name);
  const int64_t buffer_tokens = sc.slice + sc.tokens + 4;
  const HostKV src(sc.source, buffer_tokens, sc.src_layout, sc.src_pad, 11);
  const HostKV dst_init(sc.target, buffer_tokens, sc.dst_layout, sc.dst_pad, 12);
  const DeviceKV d_src(src), d_dst(dst_init);
  const KVView src_view = d_src.view().slice_tokens(sc.slice, sc.tokens);
  const KVView dst_view = d_dst.view().slice_tokens(sc.slice, sc.tokens);
  if (stream) {
    adapter.convert(src_view, sc.start_pos, dst_view, stream);
    CUDA_OK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  } else {
    adapter.convert(src_view, sc.start_pos, dst_view);
  }
  const HostKV got = d_dst.download();

  HostKV cpu = dst_init, ref = dst_init;
  const KVView host_src = src.view().slice_tokens(sc.slice, sc.tokens);
  adapter.convert(host_src, sc.start_pos, cpu.view().slice_tokens(sc.slice, sc.tokens));
  adapter.convert_reference(host_src, sc.start_pos, ref.view().slice_tokens(sc.slice, sc.tokens));
  const KVView got_view = got.view().slice_tokens(sc.slice, sc.tokens);

  const double tol = std::max(tolerance(sc.source.dtype), tolerance(sc.target.dtype));
  EXPECT_LE(max_scaled_error(got_view, cpu.view().slice_tokens(sc.slice, sc.tokens)), tol)
      << "CUDA vs CPU convert";
  EXPECT_LE(max_scaled_error(got_view, ref.view().slice_tokens(sc.slice, sc.tokens)), tol)
      << "CUDA vs convert_reference";
  EXPECT_TRUE(padding_unchanged(dst_init, got, dst_init.view().slice_tokens(sc.slice, sc.tokens)))
      << "bytes outside the target view were written";
}

class CudaConvert : public CudaTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaConvert, MatchesCpuAndReference) {
  uint64_t seed = 1;
  for (const Scenario& sc : scenarios(GetParam())) {
    const LinearAdapter adapter =
        make_random_adapter(sc.source, sc.target, sc.layers, sc.rope_aware, seed++);
    check_scenario(sc, adapter);
  }
}

TEST_P(CudaConvert, TokenBlocksAndWorkspaceGrowth) {
  const Scenario base = scenarios(GetParam())[0];
  const LinearAdapter adapter = make_random_adapter(base.source, base.target, base.layers, true, 7);
  Scenario small = base;
  small.tokens = 5;
  check_scenario(small, adapter);  // a small workspace first; the calls below grow it
  auto& budget = detail::cuda_scratch_budget();
  const int64_t saved = budget.load();
  const int64_t per_token = detail::cuda_scratch_bytes_per_token(base.source, base.target, 3);
  budget = 8 * per_token;  // blocks of at most 8 tokens
  Scenario blocked = base;
  blocked.tokens = 61;
  blocked.slice = 3;
  check_scenario(blocked, adapter);
  budget = saved;
  blocked.tokens = 97;
  check_scenario(blocked, adapter);
  EXPECT_EQ(detail::cuda_block_tokens(61, per_token, 8 * per_token), 8);
  EXPECT_EQ(detail::cuda_block_tokens(61, per_token, 1), 1);
  EXPECT_EQ(detail::cuda_block_tokens(61, per_token, int64_t{1} << 40), 61);
  EXPECT_EQ(detail::cuda_block_tokens(17, 1, 8), 6);  // 3 balanced blocks, not 8 + 8 + 1
}

// Per-layer tables in token blocks: each block fills one table per distinct frequency set.
TEST_P(CudaConvert, PerLayerAttentionInTokenBlocks) {
  const Scenario base = per_layer_scenario(GetParam());
  const LinearAdapter adapter = make_random_adapter(base.source, base.target, base.layers, true, 9);
  auto& budget = detail::cuda_scratch_budget();
  const int64_t saved = budget.load();
  budget = 7 * detail::cuda_scratch_bytes_per_token(base.source, base.target, 3, 2, 3);
  Scenario blocked = base;
  blocked.tokens = 59;
  blocked.slice = 2;
  check_scenario(blocked, adapter);
  budget = saved;
}

TEST_P(CudaConvert, ExplicitStreamsFromSeveralThreads) {
  const Scenario base = scenarios(GetParam())[0];
  const LinearAdapter adapter = make_random_adapter(base.source, base.target, base.layers, true, 8);
  std::vector<std::thread> threads;
  std::vector<std::string> failures(3);
  for (int i = 0; i < 3; ++i)
    threads.emplace_back([&, i] {
      cudaStream_t stream = nullptr;
      try {
        CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        for (int round = 0; round < 3; ++round) {
          Scenario sc = base;
          sc.tokens = 20 + 7 * i + round;
          sc.start_pos = 100 * i + round;
          check_scenario(sc, adapter, stream);
        }
      } catch (const std::exception& e) {
        failures[static_cast<size_t>(i)] = e.what();
      }
      if (stream) (void)cudaStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  for (const auto& f : failures) EXPECT_EQ(f, "");
}

INSTANTIATE_TEST_SUITE_P(DTypes, CudaConvert,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

// float16 GEMM inputs: weights far outside float16's range (both ways) still convert accurately,
// thanks to the per-layer power-of-two weight scale.
TEST_F(CudaTest, Float16WeightsOutsideHalfRange) {
  const ModelSpec s = spec("src", 2, 3, 10, DType::kFloat16, 10000.0, RopeStyle::kHalf);
  const ModelSpec t = spec("tgt", 2, 2, 6, DType::kFloat16, 50000.0, RopeStyle::kInterleaved);
  const std::vector<std::vector<int64_t>> map = {{0, 1}, {1}};
  struct Case {
    float weight_scale, bias_scale, value_scale;
  };
  // max |w| about 1e5 (above 65504) with inputs ~1e-2; max |w| about 2e-6 (float16 subnormal)
  // with inputs ~1e2. Outputs stay well inside float16's range in both.
  for (const Case c : {Case{5e5f, 1.f, 1e-2f}, Case{1e-5f, 1e-4f, 1e2f}}) {
    SCOPED_TRACE(c.weight_scale);
    const LinearAdapter adapter = make_random_adapter(s, t, map, true, 21, c.weight_scale,
                                                      c.bias_scale);
    float max_w = 0;
    for (int64_t j = 0; j < 2; ++j)
      for (float w : adapter.weights(j, 0)) max_w = std::max(max_w, std::fabs(w));
    if (c.weight_scale > 1) {
      EXPECT_GT(max_w, 65504.f);
    } else {
      EXPECT_LT(max_w, 6.1e-5f);
    }
    const HostKV src(s, 41, Layout::kHF, 1, 31, c.value_scale);
    const HostKV dst_init(t, 41, Layout::kCanonical, 0, 32);
    const DeviceKV d_src(src), d_dst(dst_init);
    adapter.convert(d_src.view(), 9, d_dst.view());
    const HostKV got = d_dst.download();
    HostKV cpu = dst_init;
    const KVView cpu_view = cpu.view();
    adapter.convert(src.view(), 9, cpu_view);
    EXPECT_LE(max_scaled_error(got.view(), cpu_view), tolerance(DType::kFloat16));
  }
}

TEST_F(CudaTest, ZeroTokens) {
  const Scenario sc = scenarios(DType::kBFloat16)[0];
  const LinearAdapter adapter = make_random_adapter(sc.source, sc.target, sc.layers, true, 3);
  const HostKV src(sc.source, 4, Layout::kHF, 1, 1), dst(sc.target, 4, Layout::kHF, 1, 2);
  const DeviceKV d_src(src), d_dst(dst);
  adapter.convert(d_src.view().slice_tokens(2, 0), 5, d_dst.view().slice_tokens(2, 0));
  // Null data is allowed for zero tokens and must not be looked at.
  const Device cuda{DeviceType::kCUDA, 0};
  adapter.convert(KVView::contiguous(nullptr, sc.source.dtype, cuda, 3, 0, 3, 10), 0,
                  KVView::contiguous(nullptr, sc.target.dtype, cuda, 4, 0, 5, 6));
  const HostKV after = d_dst.download();
  EXPECT_EQ(after.storage, dst.storage);
}

TEST_F(CudaTest, BadViews) {
  const Scenario sc = scenarios(DType::kFloat32)[0];
  const LinearAdapter adapter = make_random_adapter(sc.source, sc.target, sc.layers, true, 4);
  const HostKV src(sc.source, 9, Layout::kHF, 1, 1), dst(sc.target, 9, Layout::kHF, 1, 2);
  const HostKV short_dst(sc.target, 8, Layout::kHF, 1, 2);
  const DeviceKV d_src(src), d_dst(dst), d_short(short_dst);
  EXPECT_THROW(adapter.convert(d_dst.view(), 0, d_src.view()), InvalidArgument);  // swapped
  EXPECT_THROW(adapter.convert(d_src.view(), 0, d_short.view()), InvalidArgument);
  EXPECT_THROW(adapter.convert(d_src.view(), -1, d_dst.view()), InvalidArgument);
  EXPECT_THROW(adapter.convert(d_src.view(), 0, dst.view()), InvalidArgument);  // cuda -> cpu
  EXPECT_THROW(adapter.convert(src.view(), 0, d_dst.view()), InvalidArgument);  // cpu -> cuda
  EXPECT_THROW(adapter.convert_reference(d_src.view(), 0, d_dst.view()), InvalidArgument);
  // Host memory described as device memory, and a device that does not exist.
  std::vector<void*> host_bases;
  for (const auto& s : src.storage) host_bases.push_back(const_cast<unsigned char*>(s.data()));
  EXPECT_THROW(adapter.convert(src.view_at(host_bases, Device{DeviceType::kCUDA, 0}), 0,
                               d_dst.view()),
               InvalidArgument);
  const Device missing{DeviceType::kCUDA, cuda_device_count()};
  EXPECT_THROW(
      adapter.convert(src.view_at(d_src.ptrs, missing), 0, dst.view_at(d_dst.ptrs, missing)),
      InvalidArgument);
  // Nothing was written by the rejected calls.
  EXPECT_EQ(d_dst.download().storage, dst.storage);
}

TEST_F(CudaTest, AdapterDestroyedWhileWorkIsQueued) {
  const Scenario sc = scenarios(DType::kBFloat16)[0];
  const HostKV src(sc.source, 300, Layout::kHF, 1, 1), dst(sc.target, 300, Layout::kHF, 1, 2);
  const DeviceKV d_src(src), d_dst(dst);
  HostKV cpu = dst;
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    const LinearAdapter adapter = make_random_adapter(sc.source, sc.target, sc.layers, true, 5);
    adapter.convert(src.view(), 40, cpu.view());
    adapter.convert(d_src.view(), 40, d_dst.view(), stream);
  }  // destroyed without synchronising: it must wait for its work before freeing
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
  EXPECT_LE(max_scaled_error(d_dst.download().view(), cpu.view()),
            tolerance(DType::kBFloat16));
}

}  // namespace
}  // namespace kvbridge
