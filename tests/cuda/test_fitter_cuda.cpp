// AdapterFitter on CUDA views against the same fitter on CPU views of the same seeded random
// samples (odd sizes, padded strided layouts, float32 and bfloat16, aligned and plain adds, one
// and two passes), and the device product loop against a plain float64 reference. The
// comparisons of whole fits skip without a CUDA device; the loop test runs everywhere. The
// errors of CUDA views (no CUDA path, no device, mixed devices) are in tests/cpp.
//
// Tolerances: both fitters build identical float64 features (one builder) and differ only in
// the summation order of their products, so held-out R² agree to 1e-9 and the float32 weights to
// 1e-6 of their largest magnitude (float64 differences of order 1e-12, then one float32
// rounding). One ridge value per fit keeps near-ties of the ridge search out of the comparison.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvbridge/kvbridge.h"
#include "src/adapter/fitter_cuda.h"
#include "src/core/dtype_convert.h"
#include "tests/cuda/cuda_test_util.h"

namespace kvbridge {
namespace {

using testing::spec;

// A KV cache on the host in Hugging Face's padded layout: each plane [heads, tokens, dim + pad],
// in its own buffer; the padding holds random bytes too.
struct HostKV {
  ModelSpec spec;
  int64_t tokens = 0, pad = 0;
  std::vector<std::vector<unsigned char>> storage;
  std::vector<KVPlane> planes;

  HostKV(const ModelSpec& s, int64_t t, int64_t padding, std::mt19937& rng)
      : spec(s), tokens(t), pad(padding) {
    const int64_t H = s.num_kv_heads, D = s.head_dim;
    std::uniform_int_distribution<int> byte(0, 255);
    for (int64_t p = 0; p < 2 * s.num_layers; ++p) {
      storage.emplace_back(static_cast<size_t>(H * t * (D + pad)) * dtype_size(s.dtype));
      for (auto& b : storage.back()) b = static_cast<unsigned char>(byte(rng));
      planes.push_back(KVPlane{storage.back().data(), D + pad, t * (D + pad), 1});
    }
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t p = 0; p < 2 * s.num_layers; ++p)
      for (int64_t i = 0; i < t; ++i)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) set(p, i, h, d, normal(rng));
  }
  void set(int64_t plane, int64_t t, int64_t h, int64_t d, float v) {
    const KVPlane& p = planes[static_cast<size_t>(plane)];
    const int64_t at = t * p.token_stride + h * p.head_stride + d * p.dim_stride;
    auto* base = static_cast<unsigned char*>(p.data);
    if (spec.dtype == DType::kFloat32) {
      std::memcpy(base + at * 4, &v, 4);
    } else {
      const uint16_t bits = detail::float_to_bf16(v);
      std::memcpy(base + at * 2, &bits, 2);
    }
  }
  float get(int64_t plane, int64_t t, int64_t h, int64_t d) const {
    const KVPlane& p = planes[static_cast<size_t>(plane)];
    const int64_t at = t * p.token_stride + h * p.head_stride + d * p.dim_stride;
    const auto* base = static_cast<const unsigned char*>(p.data);
    if (spec.dtype == DType::kFloat32) {
      float v;
      std::memcpy(&v, base + at * 4, 4);
      return v;
    }
    uint16_t bits;
    std::memcpy(&bits, base + at * 2, 2);
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &wide, 4);
    return v;
  }
  KVView view() const {
    return KVView::from_planes(planes, spec.dtype, Device{}, tokens, spec.num_kv_heads,
                               spec.head_dim);
  }
};

// The same planes (padding included) in device memory of cuda:0.
struct DeviceKV {
  std::vector<void*> buffers;
  KVView view;
  explicit DeviceKV(const HostKV& h) {
    std::vector<KVPlane> planes = h.planes;
    for (size_t p = 0; p < planes.size(); ++p) {
      void* d = nullptr;
      CUDA_OK(cudaMalloc(&d, h.storage[p].size()));
      buffers.push_back(d);
      CUDA_OK(cudaMemcpy(d, h.storage[p].data(), h.storage[p].size(), cudaMemcpyHostToDevice));
      planes[p].data = d;
    }
    view = KVView::from_planes(planes, h.spec.dtype, Device{DeviceType::kCUDA, 0}, h.tokens,
                               h.spec.num_kv_heads, h.spec.head_dim);
  }
  ~DeviceKV() {
    for (void* b : buffers) (void)cudaFree(b);
  }
  DeviceKV(const DeviceKV&) = delete;
  DeviceKV& operator=(const DeviceKV&) = delete;
};

// Target layer j's keys and values a fixed random linear function of source layer
// planted[j]'s (plus noise): selection has clear winners, so both fitters must pick them.
void plant(const HostKV& src, HostKV& tgt, const std::vector<int64_t>& planted, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t Hs = src.spec.num_kv_heads, Ds = src.spec.head_dim;
  const int64_t Ht = tgt.spec.num_kv_heads, Dt = tgt.spec.head_dim;
  const int64_t Fl = 2 * Hs * Ds, O = Ht * Dt;
  for (size_t j = 0; j < planted.size(); ++j) {
    std::vector<float> w(static_cast<size_t>(Fl * 2 * O));
    for (auto& v : w) v = normal(rng) / std::sqrt(static_cast<float>(Fl));
    std::vector<float> x(static_cast<size_t>(Fl));
    for (int64_t t = 0; t < src.tokens; ++t) {
      for (int64_t f = 0; f < Fl; ++f) {
        const int64_t kind = f / (Hs * Ds), h = f % (Hs * Ds) / Ds, d = f % Ds;
        x[static_cast<size_t>(f)] = src.get(2 * planted[j] + kind, t, h, d);
      }
      for (int64_t o = 0; o < 2 * O; ++o) {
        double acc = 0.1 * normal(rng);
        for (int64_t f = 0; f < Fl; ++f)
          acc += x[static_cast<size_t>(f)] * w[static_cast<size_t>(f * 2 * O + o)];
        const int64_t kind = o / O, h = o % O / Dt, d = o % Dt;
        tgt.set(2 * static_cast<int64_t>(j) + kind, t, h, d, static_cast<float>(acc));
      }
    }
  }
}

void expect_same_fit(const LinearAdapter& gpu, const LinearAdapter& cpu) {
  const FitReport &g = gpu.report(), &c = cpu.report();
  EXPECT_EQ(g.train_tokens, c.train_tokens);
  EXPECT_EQ(g.holdout_tokens, c.holdout_tokens);
  ASSERT_EQ(g.layers.size(), c.layers.size());
  for (size_t j = 0; j < c.layers.size(); ++j) {
    SCOPED_TRACE("target layer " + std::to_string(j));
    EXPECT_EQ(g.layers[j].source_layers, c.layers[j].source_layers);
    EXPECT_NEAR(g.layers[j].r2_key, c.layers[j].r2_key, 1e-9);
    EXPECT_NEAR(g.layers[j].r2_value, c.layers[j].r2_value, 1e-9);
    EXPECT_EQ(g.layers[j].ridge_key, c.layers[j].ridge_key);
    EXPECT_EQ(g.layers[j].ridge_value, c.layers[j].ridge_value);
    if (g.layers[j].source_layers != c.layers[j].source_layers) continue;
    for (int kind = 0; kind < 2; ++kind) {
      const auto& wg = gpu.weights(static_cast<int64_t>(j), kind);
      const auto& wc = cpu.weights(static_cast<int64_t>(j), kind);
      ASSERT_EQ(wg.size(), wc.size());
      double largest = 0, worst = 0;
      for (size_t i = 0; i < wc.size(); ++i) {
        largest = std::max(largest, std::fabs(static_cast<double>(wc[i])));
        worst = std::max(worst, std::fabs(static_cast<double>(wg[i]) - wc[i]));
      }
      EXPECT_GT(largest, 0.0);
      EXPECT_LE(worst, 1e-6 * largest) << "kind " << kind;
      const auto& bg = gpu.bias(static_cast<int64_t>(j), kind);
      const auto& bc = cpu.bias(static_cast<int64_t>(j), kind);
      ASSERT_EQ(bg.size(), bc.size());
      for (size_t i = 0; i < bc.size(); ++i)
        EXPECT_NEAR(bg[i], bc[i], 1e-6 * (1 + std::fabs(bc[i])));
    }
  }
}

// --- The product loop against a float64 reference (no device needed) ---------------------------

// Plain column-major BLAS on the host, written from the definitions.
class ReferenceColumnMajor final : public detail::ColumnMajorProducts {
 public:
  void upload(double* dst, const double* src, int64_t count) override {
    std::copy(src, src + count, dst);
    ++uploads;
  }
  void syrk_lower(int n, int k, const double* a, int lda, double* c, int ldc) override {
    for (int col = 0; col < n; ++col)
      for (int row = col; row < n; ++row) {
        double s = 0;
        for (int i = 0; i < k; ++i) s += a[row + i * lda] * a[col + i * lda];
        c[row + col * ldc] += s;
      }
  }
  void gemm_nt(int m, int n, int k, const double* a, int lda, const double* b, int ldb, double* c,
               int ldc) override {
    for (int col = 0; col < n; ++col)
      for (int row = 0; row < m; ++row) {
        double s = 0;
        for (int i = 0; i < k; ++i) s += a[row + i * lda] * b[col + i * ldb];
        c[row + col * ldc] += s;
      }
  }
  int uploads = 0;
};

TEST(FitterCudaProducts, ChunkedLoopMatchesRowMajorReference) {
  const int64_t rows = 37, ldx = 23, ldy = 11;
  std::mt19937 rng(5);
  std::normal_distribution<double> normal(0, 1);
  std::vector<double> x(static_cast<size_t>(rows * ldx)), y(static_cast<size_t>(rows * ldy));
  for (auto& v : x) v = normal(rng);
  for (auto& v : y) v = normal(rng);
  // Row-major accumulators: the upper triangle of X_a^T X_a, X_a^T X_b, X_a^T Y_b; each starts
  // from random values, which the products must add to.
  struct Case {
    bool symmetric, from_y;
    int64_t first, count, a_col, b_col, m, n;
  };
  const std::vector<Case> cases = {{true, false, 2, 30, 3, 3, 5, 5},
                                   {false, false, 0, 37, 1, 9, 4, 6},
                                   {false, true, 10, 27, 0, 2, 7, 5},
                                   {false, true, 0, 19, 16, 0, 7, 11}};
  for (int64_t chunk : {1, 4, 7, 36, 37, 100}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    std::vector<std::vector<double>> acc, expected;
    std::vector<detail::FitterProduct> products;
    for (const Case& c : cases) {
      acc.emplace_back(static_cast<size_t>(c.m * c.n));
      for (auto& v : acc.back()) v = normal(rng);
    }
    expected = acc;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      products.push_back({c.symmetric, c.from_y, c.first, c.count, c.a_col, c.b_col, c.m, c.n,
                          acc[i].data()});
      for (int64_t r = 0; r < c.m; ++r)
        for (int64_t col = c.symmetric ? r : 0; col < c.n; ++col) {
          double s = 0;
          for (int64_t t = c.first; t < c.first + c.count; ++t)
            s += x[static_cast<size_t>(t * ldx + c.a_col + r)] *
                 (c.from_y ? y[static_cast<size_t>(t * ldy + c.b_col + col)]
                           : x[static_cast<size_t>(t * ldx + c.b_col + col)]);
          expected[i][static_cast<size_t>(r * c.n + col)] += s;
        }
    }
    // The device copy of the accumulators: one buffer, 32-double aligned offsets, addresses sorted.
    std::vector<std::pair<const double*, int64_t>> offsets;
    int64_t total = 0;
    for (auto& a : acc) {
      offsets.emplace_back(a.data(), total);
      total += (static_cast<int64_t>(a.size()) + 31) / 32 * 32;
    }
    std::vector<double> device(static_cast<size_t>(total));
    for (size_t i = 0; i < acc.size(); ++i)
      std::copy(acc[i].begin(), acc[i].end(), device.begin() + offsets[i].second);
    std::sort(offsets.begin(), offsets.end(), [](const auto& a, const auto& b) {
      return std::less<const double*>()(a.first, b.first);
    });
    const int64_t staged = std::min(chunk, rows);
    std::vector<double> sx(static_cast<size_t>(staged * ldx)), sy(static_cast<size_t>(staged * ldy));
    ReferenceColumnMajor blas;
    detail::accumulate_in_chunks(blas, x.data(), ldx, y.data(), ldy, rows, products, chunk,
                                 sx.data(), sy.data(), device.data(), offsets);
    EXPECT_EQ(blas.uploads, 2 * ((rows + chunk - 1) / chunk));
    for (size_t i = 0; i < cases.size(); ++i) {
      int64_t at = 0;
      for (const auto& o : offsets)
        if (o.first == acc[i].data()) at = o.second;
      for (size_t e = 0; e < acc[i].size(); ++e)
        EXPECT_NEAR(device[static_cast<size_t>(at) + e], expected[i][e],
                    1e-12 * (1 + std::fabs(expected[i][e])))
            << "case " << i << " element " << e;
    }
  }
}

// --- CUDA fitter against CPU fitter -------------------------------------------------------------

class FitterCudaVsCpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// Fits the same samples with views on the host and on cuda:0; plain adds at two start positions
// and one aligned add with unpaired target tokens.
void fit_both(const ModelSpec& s, const ModelSpec& t, const FitOptions& o, bool planted,
              uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<HostKV> sources, targets;
  for (int64_t tokens : {211, 97, 53}) {
    sources.emplace_back(s, tokens, 3, rng);
    targets.emplace_back(t, tokens, 1, rng);
    if (planted) plant(sources.back(), targets.back(), {2, 0}, seed + 1);
  }
  std::vector<int64_t> alignment(static_cast<size_t>(targets[2].tokens));
  for (size_t j = 0; j < alignment.size(); ++j)
    alignment[j] = j % 7 == 3 ? kNoSource : static_cast<int64_t>((j * 5) % alignment.size());
  std::vector<std::unique_ptr<DeviceKV>> dsrc, dtgt;
  for (size_t i = 0; i < sources.size(); ++i) {
    dsrc.push_back(std::make_unique<DeviceKV>(sources[i]));
    dtgt.push_back(std::make_unique<DeviceKV>(targets[i]));
  }
  AdapterFitter cpu(s, t, o), gpu(s, t, o);
  ASSERT_EQ(cpu.passes(), gpu.passes());
  for (int pass = 0; pass < cpu.passes(); ++pass) {
    for (AdapterFitter* f : {&cpu, &gpu}) {
      const bool on_gpu = f == &gpu;
      const auto src = [&](size_t i) { return on_gpu ? dsrc[i]->view : sources[i].view(); };
      const auto tgt = [&](size_t i) { return on_gpu ? dtgt[i]->view : targets[i].view(); };
      f->add(src(0), tgt(0), 0);
      f->add(src(1), tgt(1), 1000);
      f->add(src(2), tgt(2), 17, alignment);
    }
    EXPECT_EQ(gpu.train_tokens(), cpu.train_tokens());
    EXPECT_EQ(gpu.holdout_tokens(), cpu.holdout_tokens());
    EXPECT_EQ(gpu.memory_bytes(), cpu.memory_bytes());
    if (pass + 1 < cpu.passes()) {
      cpu.next_pass();
      gpu.next_pass();
      EXPECT_EQ(gpu.candidate_layers(), cpu.candidate_layers());
    }
  }
  expect_same_fit(gpu.fit(), cpu.fit());
  // fit() leaves the device accumulators in place: more samples and a second fit still agree.
  cpu.add(sources[1].view(), targets[1].view(), 3);
  gpu.add(dsrc[1]->view, dtgt[1]->view, 3);
  expect_same_fit(gpu.fit(), cpu.fit());
}

TEST_F(FitterCudaVsCpu, ExplicitLayersFloat32) {
  const ModelSpec s = spec("s", 3, 3, 10, DType::kFloat32, 10000, RopeStyle::kHalf);
  const ModelSpec t = spec("t", 2, 2, 6, DType::kFloat32, 500000, RopeStyle::kInterleaved);
  FitOptions o;
  o.selection = FitOptions::Selection::kExplicit;
  o.source_layers = {{0, 2}, {1}};
  o.ridge_grid = {1e-2};
  fit_both(s, t, o, /*planted=*/false, 11);
}

TEST_F(FitterCudaVsCpu, AllLayersBFloat16) {
  const ModelSpec s = spec("s", 3, 3, 10, DType::kBFloat16, 10000, RopeStyle::kInterleaved);
  const ModelSpec t = spec("t", 2, 2, 6, DType::kBFloat16, 10000, RopeStyle::kHalf);
  FitOptions o;
  o.selection = FitOptions::Selection::kAll;
  o.ridge_grid = {3e-2};
  o.holdout = 0.25;
  fit_both(s, t, o, /*planted=*/false, 12);
}

TEST_F(FitterCudaVsCpu, AutoTwoPassesPlanted) {
  const ModelSpec s = spec("s", 3, 3, 10, DType::kFloat32, 10000, RopeStyle::kHalf);
  const ModelSpec t = spec("t", 2, 2, 6, DType::kFloat32, 10000, RopeStyle::kHalf);
  FitOptions o;
  o.selection = FitOptions::Selection::kAuto;
  o.rope_aware = false;  // the planted maps act on the stored keys
  o.ridge_grid = {1e-3};
  o.holdout = 0.3;
  // Between the probe pass (about 0.31 MB here) and one pass over all layers (about 0.49 MB).
  o.max_memory_bytes = 400000;
  ASSERT_EQ(AdapterFitter(s, t, o).passes(), 2);
  fit_both(s, t, o, /*planted=*/true, 13);
}

}  // namespace
}  // namespace kvbridge
