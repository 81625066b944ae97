#include <gtest/gtest.h>

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kernels/convert_elements.cuh"
#include "src/adapter/numeric.h"
#include "test_util.h"

namespace kvbridge {
namespace {

using testing::HFKV;

// Dense float32 KV [layers, 2, tokens, heads, dim] with helpers to view and index it.
struct FloatKV {
  ModelSpec spec;
  int64_t tokens;
  std::vector<float> data;
  FloatKV(const ModelSpec& s, int64_t t) : spec(s), tokens(t), data(static_cast<size_t>(2 * s.num_layers * t * s.num_kv_heads * s.head_dim)) {}
  float* plane(int64_t layer, int kind) {
    return data.data() + (2 * layer + kind) * tokens * spec.num_kv_heads * spec.head_dim;
  }
  KVView view() {
    return KVView::contiguous(data.data(), DType::kFloat32, {}, spec.num_layers, tokens,
                              spec.num_kv_heads, spec.head_dim);
  }
};

ModelSpec make_spec(const char* name, int64_t layers, int64_t heads, int64_t dim, double base,
                    RopeStyle style, DType dtype = DType::kFloat32) {
  ModelSpec s = testing::small_spec(dtype, layers, heads, dim);
  s.name = name;
  s.rope_base = base;
  s.rope_style = style;
  return s;
}

// The casts store_plane (every convert's output) uses: finite in, finite out.
TEST(Numeric, SaturatingCastsKeepFiniteValuesFinite) {
  EXPECT_EQ(detail::float_to_fp16_saturate(70000.f), 0x7bffu);  // +65504
  EXPECT_EQ(detail::float_to_fp16_saturate(-1e30f), 0xfbffu);   // -65504
  EXPECT_EQ(detail::float_to_fp16_saturate(65519.f), 0x7bffu);  // would round to infinity
  EXPECT_EQ(detail::float_to_fp16_saturate(INFINITY), 0x7c00u);  // infinities stay
  EXPECT_TRUE(std::isnan(detail::fp16_to_float(detail::float_to_fp16_saturate(NAN))));
  const float big = std::numeric_limits<float>::max();  // rounds up to infinity in bfloat16
  EXPECT_TRUE(std::isinf(detail::bf16_to_float(detail::float_to_bf16(big))));
  EXPECT_EQ(detail::float_to_bf16_saturate(big), 0x7f7fu);
  EXPECT_EQ(detail::float_to_bf16_saturate(-big), 0xff7fu);
  EXPECT_EQ(detail::float_to_bf16_saturate(-INFINITY), 0xff80u);
  EXPECT_TRUE(std::isnan(detail::bf16_to_float(detail::float_to_bf16_saturate(NAN))));
  // Below the limits the saturating casts are the plain ones.
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.f, 2000.f);
  for (int i = 0; i < 20000; ++i) {
    const float x = dist(rng);
    ASSERT_EQ(detail::float_to_fp16_saturate(x), detail::float_to_fp16(x)) << x;
    ASSERT_EQ(detail::float_to_bf16_saturate(x * 1e30f), detail::float_to_bf16(x * 1e30f)) << x;
  }
  // store_plane saturates: a float16 plane of out-of-range float32 values is finite.
  const std::vector<float> in = {1e5f, -7e4f, 3.f, -65504.f};
  std::vector<uint16_t> out(4);
  detail::store_plane(in.data(), 4, DType::kFloat16, 1, 1, 4, KVPlane{out.data(), 4, 4, 1});
  EXPECT_EQ(out, (std::vector<uint16_t>{0x7bff, 0xfbff, detail::float_to_fp16(3.f), 0xfbff}));
}

// find_nonfinite reports the first NaN or infinity of a strided view in each dtype.
TEST(Numeric, FindNonFinite) {
  const int64_t L = 3, T = 7, H = 2, D = 5, pad = 3;  // rows of D + pad elements: strided
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t es = dtype == DType::kFloat32 ? 4 : 2;
    std::mt19937 rng(17);
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<float> values(static_cast<size_t>(L * 2 * T * H * (D + pad)));
    for (float& v : values) v = dist(rng);
    auto make = [&](const std::vector<float>& from, std::vector<unsigned char>& bytes) {
      bytes.assign(from.size() * static_cast<size_t>(es), 0);
      for (size_t i = 0; i < from.size(); ++i) {
        if (es == 4) {
          std::memcpy(&bytes[4 * i], &from[i], 4);
        } else {
          const uint16_t b = dtype == DType::kBFloat16 ? detail::float_to_bf16(from[i])
                                                       : detail::float_to_fp16(from[i]);
          std::memcpy(&bytes[2 * i], &b, 2);
        }
      }
      std::vector<KVPlane> planes;
      for (int64_t p = 0; p < 2 * L; ++p)
        planes.push_back(KVPlane{bytes.data() + p * T * H * (D + pad) * es, H * (D + pad),
                                 D + pad, 1});
      return KVView::from_planes(planes, dtype, Device{}, T, H, D);
    };
    std::vector<unsigned char> bytes;
    EXPECT_FALSE(detail::find_nonfinite(make(values, bytes)).has_value());
    for (const float bad : {NAN, INFINITY, -INFINITY}) {
      std::vector<float> copy = values;
      auto at = [&](int64_t l, int kind, int64_t t, int64_t h, int64_t d) -> float& {
        return copy[static_cast<size_t>((((2 * l + kind) * T + t) * H + h) * (D + pad) + d)];
      };
      at(2, KVView::kValue, 6, 0, 0) = bad;
      at(2, KVView::kValue, 4, 1, 3) = bad;
      at(1, KVView::kKey, 5, 0, D) = bad;  // in the padding: not part of the view
      const KVView view = make(copy, bytes);
      const auto found = detail::find_nonfinite(view);
      ASSERT_TRUE(found.has_value());
      EXPECT_EQ(found->layer, 2);
      EXPECT_EQ(found->kind, KVView::kValue);
      EXPECT_EQ(found->token, 4);
      EXPECT_FALSE(detail::find_nonfinite(view.slice_tokens(0, 4)).has_value());
    }
  }
}

TEST(Numeric, HalfAndBFloatRoundTrip) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.f, 3.f);
  for (int i = 0; i < 20000; ++i) {
    const float x = dist(rng) * (i % 7 == 0 ? 1e-5f : 1.f);
    const float b = detail::bf16_to_float(detail::float_to_bf16(x));
    EXPECT_LE(std::fabs(b - x), std::fabs(x) * 0x1p-8f) << x;
    const float h = detail::fp16_to_float(detail::float_to_fp16(x));
    EXPECT_LE(std::fabs(h - x), std::max(std::fabs(x) * 0x1p-11f, 0x1p-25f)) << x;
  }
  EXPECT_EQ(detail::fp16_to_float(detail::float_to_fp16(65504.f)), 65504.f);
  EXPECT_TRUE(std::isinf(detail::fp16_to_float(detail::float_to_fp16(70000.f))));
  EXPECT_TRUE(std::isnan(detail::bf16_to_float(detail::float_to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(detail::fp16_to_float(detail::float_to_fp16(NAN))));
  // Every half value survives half -> float -> half.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    if ((bits & 0x7c00) == 0x7c00 && (bits & 0x3ff)) continue;  // NaN payloads
    ASSERT_EQ(detail::float_to_fp16(detail::fp16_to_float(static_cast<uint16_t>(bits))), bits);
  }
}

TEST(Rope, MatchesDirectFormulaAndInverts) {
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    ModelSpec s = make_spec("r", 1, 3, 10, 5000.0, style);
    s.rope_scaling.type = RopeScaling::Type::kLlama3;
    s.rope_scaling.factor = 8;
    s.rope_scaling.original_max_position = 64;
    const auto inv = detail::rope_inv_freq(s, 0);
    // 1031 tokens: more than one block of angles (apply_rope computes them 1024 at a time).
    const int64_t T = 1031, start = 37, ld = 3 * 10 + 4;
    std::mt19937 rng(1);
    std::normal_distribution<double> dist;
    std::vector<double> x(static_cast<size_t>(T * ld));
    for (auto& v : x) v = dist(rng);
    std::vector<double> y = x;
    detail::apply_rope(s, inv, start, false, T, 3, y.data(), ld);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t i = 0; i < 5; ++i) {
          const int64_t a = style == RopeStyle::kHalf ? i : 2 * i;
          const int64_t b = style == RopeStyle::kHalf ? i + 5 : 2 * i + 1;
          const double ang = (start + t) * inv[static_cast<size_t>(i)];
          const double* in = &x[static_cast<size_t>(t * ld + h * 10)];
          const double* out = &y[static_cast<size_t>(t * ld + h * 10)];
          EXPECT_NEAR(out[a], in[a] * std::cos(ang) - in[b] * std::sin(ang), 1e-12);
          EXPECT_NEAR(out[b], in[b] * std::cos(ang) + in[a] * std::sin(ang), 1e-12);
        }
    detail::apply_rope(s, inv, start, true, T, 3, y.data(), ld);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-12);
  }
}

TEST(Rope, ScalingSchemes) {
  ModelSpec s = make_spec("r", 1, 1, 128, 500000.0, RopeStyle::kHalf);
  const auto plain = detail::rope_inv_freq(s, 0);
  s.rope_scaling.type = RopeScaling::Type::kLinear;
  s.rope_scaling.factor = 4;
  const auto linear = detail::rope_inv_freq(s, 0);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_DOUBLE_EQ(linear[i], plain[i] / 4);
  s.rope_scaling = RopeScaling{RopeScaling::Type::kLlama3, 8.0, 1.0, 4.0, 8192};
  const auto llama3 = detail::rope_inv_freq(s, 0);
  EXPECT_DOUBLE_EQ(llama3[0], plain[0]);              // high frequency: unchanged
  EXPECT_DOUBLE_EQ(llama3.back(), plain.back() / 8);  // low frequency: divided by factor
}

// Position-free random KV for `spec`, then keys rotated with its RoPE at start_pos + t.
void fill_position_free(FloatKV& kv, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  for (auto& v : kv.data) v = dist(rng);
}
void rotate_keys(FloatKV& kv, int64_t start_pos) {
  const int64_t w = kv.spec.num_kv_heads * kv.spec.head_dim;
  for (int64_t l = 0; l < kv.spec.num_layers; ++l)
    detail::apply_rope(kv.spec, detail::rope_inv_freq(kv.spec, l), start_pos, false, kv.tokens,
                       kv.spec.num_kv_heads, kv.plane(l, 0), w);
}

// ||out - ref|| / ||ref|| over all elements.
double relative_rms_error(const std::vector<float>& out, const std::vector<float>& ref) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err += std::pow(static_cast<double>(out[i]) - ref[i], 2);
    norm += std::pow(static_cast<double>(ref[i]), 2);
  }
  return std::sqrt(err / norm);
}

struct PlantedPair {
  ModelSpec source;
  ModelSpec target = make_spec("tgt", 2, 3, 6, 50000.0, RopeStyle::kInterleaved);
  std::vector<std::vector<int64_t>> planted;          // [target layer] -> its source layers
  std::vector<std::array<std::vector<float>, 2>> w;  // [target layer][K/V] -> [|planted| sw2, tw]
  std::vector<std::array<std::vector<float>, 2>> b;
  // By default target layer j draws on source layers {j, j + 1} of 3.
  explicit PlantedPair(int64_t source_layers = 3,
                       std::vector<std::vector<int64_t>> layers = {{0, 1}, {1, 2}})
      : source(make_spec("src", source_layers, 2, 8, 10000.0, RopeStyle::kHalf)),
        planted(std::move(layers)) {
    target.rope_scaling = RopeScaling{RopeScaling::Type::kLinear, 2.0, 1.0, 4.0, 8192};
    std::mt19937 rng(42);
    std::normal_distribution<float> dist(0.f, 0.3f);
    const int64_t sw2 = 2 * 2 * 8, tw = 3 * 6;
    w.resize(2);
    b.resize(2);
    for (int j = 0; j < 2; ++j)
      for (int k = 0; k < 2; ++k) {
        w[j][k].resize(planted[j].size() * static_cast<size_t>(sw2 * tw));
        for (auto& v : w[j][k]) v = dist(rng);
        b[j][k].resize(static_cast<size_t>(tw));
        for (auto& v : b[j][k]) v = dist(rng) + 1.f;
      }
  }
  // Builds a (source, target) pair of post-RoPE caches for T tokens.
  void sample(int64_t T, int64_t start_pos, uint32_t seed, FloatKV& src, FloatKV& tgt) const {
    (void)T;
    sample_aligned(nullptr, start_pos, start_pos, seed, src, tgt);
  }
  // Two tokenizations: target token t is the planted map of source token rows[t] (noise where
  // rows[t] is kNoSource), source keys rotated at start_pos + i, target keys at target_start + t.
  void sample_aligned(const std::vector<int64_t>* rows, int64_t start_pos, int64_t target_start,
                      uint32_t seed, FloatKV& src, FloatKV& tgt) const {
    std::mt19937 rng(seed);
    fill_position_free(src, rng);
    fill_position_free(tgt, rng);
    const int64_t sw = 2 * 8, tw = 3 * 6;
    for (int64_t j = 0; j < 2; ++j)
      for (int k = 0; k < 2; ++k)
        for (int64_t t = 0; t < tgt.tokens; ++t) {
          const int64_t i = rows ? (*rows)[static_cast<size_t>(t)] : t;
          if (i == kNoSource) continue;
          for (int64_t o = 0; o < tw; ++o) {
            double acc = b[j][k][o];
            for (size_t s = 0; s < planted[j].size(); ++s)
              for (int kk = 0; kk < 2; ++kk)
                for (int64_t f = 0; f < sw; ++f)
                  acc += src.plane(planted[j][s], kk)[i * sw + f] *
                         w[j][k][((s * 2 + kk) * sw + f) * tw + o];
            tgt.plane(j, k)[t * tw + o] = static_cast<float>(acc);
          }
        }
    rotate_keys(src, start_pos);
    rotate_keys(tgt, target_start);
  }
};

TEST(AdapterFitter, RecoversPlantedMapThroughRope) {
  PlantedPair pair;
  for (auto selection : {FitOptions::Selection::kAuto, FitOptions::Selection::kAll,
                         FitOptions::Selection::kExplicit}) {
    FitOptions o;
    o.selection = selection;
    o.source_layers = {{0, 1}, {1, 2}};
    AdapterFitter fitter(pair.source, pair.target, o);
    for (int i = 0; i < 6; ++i) {
      FloatKV src(pair.source, 97), tgt(pair.target, 97);
      pair.sample(97, 13 + 200 * i, 100 + i, src, tgt);
      fitter.add(src.view(), tgt.view(), 13 + 200 * i);
    }
    const LinearAdapter adapter = fitter.fit();
    for (const LayerFit& lf : adapter.report().layers) {
      EXPECT_GT(lf.r2_key, 0.9999);
      EXPECT_GT(lf.r2_value, 0.9999);
    }
    if (selection == FitOptions::Selection::kAuto) {
      EXPECT_EQ(adapter.report().layers[0].source_layers, (std::vector<int64_t>{0, 1}));
      EXPECT_EQ(adapter.report().layers[1].source_layers, (std::vector<int64_t>{1, 2}));
    }
    // Converting fresh data at a new position reproduces the target's own cache.
    FloatKV src(pair.source, 31), tgt(pair.target, 31), out(pair.target, 31);
    pair.sample(31, 5000, 999, src, tgt);
    adapter.convert(src.view(), 5000, out.view());
    EXPECT_LT(relative_rms_error(out.data, tgt.data), 1e-3);
  }
}

// Source 6 layers: all-layer accumulators take 569,536 bytes, the probe 323,776. A budget between
// the two makes "auto" probe first, then keep a few candidates per target layer.
TEST(AdapterFitter, TwoPassSelectionWithinMemoryBudget) {
  PlantedPair pair(6, {{1, 4}, {0, 5}});
  FitOptions o;
  o.max_memory_bytes = 400000;
  AdapterFitter fitter(pair.source, pair.target, o);
  ASSERT_EQ(fitter.passes(), 2);
  EXPECT_EQ(fitter.pass(), 0);
  EXPECT_EQ(fitter.memory_bytes(), 323776);
  EXPECT_THROW(fitter.fit(), InvalidArgument);
  EXPECT_THROW(fitter.candidate_layers(), InvalidArgument);
  EXPECT_THROW(fitter.next_pass(), InvalidArgument);  // no samples yet
  auto add_all = [&] {
    for (int i = 0; i < 8; ++i) {
      FloatKV src(pair.source, 97), tgt(pair.target, 97);
      pair.sample(97, 13 + 200 * i, 100 + i, src, tgt);
      fitter.add(src.view(), tgt.view(), 13 + 200 * i);
    }
  };
  add_all();
  const int64_t probe_train = fitter.train_tokens(), probe_held = fitter.holdout_tokens();
  fitter.next_pass();
  EXPECT_EQ(fitter.pass(), 1);
  EXPECT_EQ(fitter.train_tokens() + fitter.holdout_tokens(), 0);
  EXPECT_LE(fitter.memory_bytes(), o.max_memory_bytes);
  EXPECT_THROW(fitter.next_pass(), InvalidArgument);  // already in the last pass
  const auto candidates = fitter.candidate_layers();
  ASSERT_EQ(candidates.size(), 2u);
  for (size_t j = 0; j < 2; ++j) {
    EXPECT_LT(candidates[j].size(), 6u);  // the budget cannot hold every layer
    for (int64_t l : pair.planted[j])
      EXPECT_NE(std::find(candidates[j].begin(), candidates[j].end(), l), candidates[j].end())
          << "target layer " << j << " lost planted source layer " << l;
  }
  add_all();
  EXPECT_EQ(fitter.train_tokens(), probe_train);  // the same split as the probe pass
  EXPECT_EQ(fitter.holdout_tokens(), probe_held);
  const LinearAdapter adapter = fitter.fit();
  for (size_t j = 0; j < 2; ++j) {
    const LayerFit& lf = adapter.report().layers[j];
    EXPECT_EQ(lf.source_layers, pair.planted[j]);
    EXPECT_GT(lf.r2_key, 0.9999);
    EXPECT_GT(lf.r2_value, 0.9999);
  }
  FloatKV src(pair.source, 31), tgt(pair.target, 31), out(pair.target, 31);
  pair.sample(31, 5000, 999, src, tgt);
  adapter.convert(src.view(), 5000, out.view());
  EXPECT_LT(relative_rms_error(out.data, tgt.data), 1e-3);
  // The block accumulators give the same maps as one pass over exactly the chosen layers.
  FitOptions explicit_options;
  explicit_options.selection = FitOptions::Selection::kExplicit;
  explicit_options.source_layers = pair.planted;
  AdapterFitter direct(pair.source, pair.target, explicit_options);
  for (int i = 0; i < 8; ++i) {
    FloatKV s(pair.source, 97), t(pair.target, 97);
    pair.sample(97, 13 + 200 * i, 100 + i, s, t);
    direct.add(s.view(), t.view(), 13 + 200 * i);
  }
  const LinearAdapter direct_adapter = direct.fit();
  FloatKV direct_out(pair.target, 31);
  direct_adapter.convert(src.view(), 5000, direct_out.view());
  double diff = 0;
  for (size_t i = 0; i < out.data.size(); ++i)
    diff = std::max(diff, std::abs(static_cast<double>(out.data[i]) - direct_out.data[i]));
  EXPECT_LT(diff, 1e-4);
  for (size_t j = 0; j < 2; ++j) {
    EXPECT_NEAR(adapter.report().layers[j].r2_key, direct_adapter.report().layers[j].r2_key, 1e-9);
    EXPECT_NEAR(adapter.report().layers[j].r2_value, direct_adapter.report().layers[j].r2_value,
                1e-9);
  }

  // One pass when everything fits; nothing fits: an error at construction. "all" never probes.
  o.max_memory_bytes = 569536;
  AdapterFitter one_pass(pair.source, pair.target, o);
  EXPECT_EQ(one_pass.passes(), 1);
  EXPECT_EQ(one_pass.memory_bytes(), 569536);
  EXPECT_THROW(one_pass.next_pass(), InvalidArgument);
  o.max_memory_bytes = 323775;
  EXPECT_THROW(AdapterFitter(pair.source, pair.target, o), InvalidArgument);
  o.max_memory_bytes = 400000;
  o.selection = FitOptions::Selection::kAll;
  EXPECT_THROW(AdapterFitter(pair.source, pair.target, o), InvalidArgument);
}

TEST(AdapterFitter, NaiveFitCannotFollowRope) {
  PlantedPair pair;
  FitOptions o;
  o.rope_aware = false;
  o.selection = FitOptions::Selection::kAll;
  AdapterFitter fitter(pair.source, pair.target, o);
  for (int i = 0; i < 6; ++i) {
    FloatKV src(pair.source, 97), tgt(pair.target, 97);
    pair.sample(97, 13 + 200 * i, 100 + i, src, tgt);
    fitter.add(src.view(), tgt.view(), 13 + 200 * i);
  }
  const auto report = fitter.fit().report();
  // Post-RoPE keys rotate with position, so no fixed linear map explains them (the values the
  // pair plants depend on position-free source keys too).
  for (const LayerFit& lf : report.layers) {
    EXPECT_LT(lf.r2_key, 0.9);
    EXPECT_LT(lf.r2_value, 0.9);
  }
}

// Seeded random samples with odd sizes for comparisons with a direct float64 ridge regression:
// features x [tokens, Ls * Fl] (every source layer's keys then values, no RoPE) and targets y
// [tokens, Lt * 2 * W], target layer j a random dense map of source layers mixed[j] plus noise.
// Samples go in one token at a time so that the test sees which tokens the fitter holds out.
struct DirectRidgeData {
  using Mat = Eigen::MatrixXd;
  int64_t Fl = 0, W = 0;
  Mat x, y;
  std::vector<int64_t> train, held;

  DirectRidgeData(AdapterFitter& fitter, const ModelSpec& source, const ModelSpec& target,
                  const std::vector<std::vector<int64_t>>& mixed, int64_t tokens, uint32_t seed) {
    Fl = 2 * source.num_kv_heads * source.head_dim;
    W = target.num_kv_heads * target.head_dim;
    const int64_t Ls = source.num_layers, Lt = target.num_layers;
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist;
    Mat mix = Mat::Zero(Ls * Fl, Lt * 2 * W);
    for (int64_t j = 0; j < Lt; ++j)
      for (int64_t l : mixed[static_cast<size_t>(j)])
        for (int64_t f = 0; f < Fl; ++f)
          for (int64_t c = 0; c < 2 * W; ++c) mix(l * Fl + f, j * 2 * W + c) = 0.3 * dist(rng);
    x.resize(tokens, Ls * Fl);
    y.resize(tokens, Lt * 2 * W);
    for (int64_t t = 0; t < tokens; ++t) {
      FloatKV src(source, 1), tgt(target, 1);
      for (auto& v : src.data) v = dist(rng) * 2.f + 0.5f;
      for (int64_t i = 0; i < Ls * Fl; ++i) x(t, i) = src.data[static_cast<size_t>(i)];
      for (int64_t i = 0; i < Lt * 2 * W; ++i) {
        tgt.data[static_cast<size_t>(i)] =
            static_cast<float>(x.row(t).dot(mix.col(i)) + 0.5 * dist(rng) + 1.0);
        y(t, i) = tgt.data[static_cast<size_t>(i)];
      }
      const int64_t before = fitter.holdout_tokens();
      fitter.add(src.view(), tgt.view(), t);
      (fitter.holdout_tokens() > before ? held : train).push_back(t);
    }
  }

  struct Fit {
    double r2 = -HUGE_VAL, ridge = 0;
    Mat w;  // [|S| Fl, W]
  };
  // The best ridge fit of target layer j's keys (kind 0) or values on source layers S (in that
  // order), by held-out R² summed token by token; ridge strengths relative to each source
  // layer's mean feature variance; LDLT per strength.
  Fit direct(const std::vector<int64_t>& S, int64_t j, int kind,
             const std::vector<double>& grid) const {
    const int64_t F = static_cast<int64_t>(S.size()) * Fl;
    auto features = [&](const std::vector<int64_t>& rows) {
      Mat out(static_cast<int64_t>(rows.size()), F);
      for (size_t a = 0; a < S.size(); ++a)
        out.middleCols(static_cast<int64_t>(a) * Fl, Fl) = x(rows, Eigen::seqN(S[a] * Fl, Fl));
      return out;
    };
    const Mat xt = features(train), xh = features(held);
    const Eigen::RowVectorXd mu = xt.colwise().mean();
    const Mat xc = xt.rowwise() - mu;
    const Mat cov = xc.transpose() * xc / static_cast<double>(train.size());
    Eigen::VectorXd scale(F);
    for (int64_t a = 0; a < static_cast<int64_t>(S.size()); ++a)
      scale.segment(a * Fl, Fl).setConstant(cov.block(a * Fl, a * Fl, Fl, Fl).trace() /
                                            static_cast<double>(Fl));
    const Mat yt = y(train, Eigen::seqN((2 * j + kind) * W, W));
    const Mat yh = y(held, Eigen::seqN((2 * j + kind) * W, W));
    const Eigen::RowVectorXd mu_y = yt.colwise().mean();
    const Mat g = xc.transpose() * (yt.rowwise() - mu_y) / static_cast<double>(train.size());
    const double sst = (yh.rowwise() - yh.colwise().mean()).squaredNorm();
    Fit best;
    for (double alpha : grid) {
      const Mat a = cov + Mat((alpha * scale).asDiagonal());
      const Mat w = a.ldlt().solve(g);
      const Eigen::RowVectorXd b = mu_y - mu * w;
      const double r2 = 1 - ((xh * w).rowwise() + b - yh).squaredNorm() / sst;
      if (r2 > best.r2) best = {r2, alpha, w};
    }
    return best;
  }

  // The adapter's weights of target layer j (rows in ascending source layers) against `w`, rows
  // in the order of S.
  static double weight_error(const LinearAdapter& adapter, int64_t j, int kind,
                             const std::vector<int64_t>& S, const Mat& w, int64_t Fl, int64_t W) {
    std::vector<int64_t> sorted = S;
    std::sort(sorted.begin(), sorted.end());
    const std::vector<float>& got = adapter.weights(j, kind);
    EXPECT_EQ(static_cast<int64_t>(got.size()), w.size());
    double err = 0;
    for (size_t r = 0; r < sorted.size(); ++r) {
      const int64_t i = std::find(S.begin(), S.end(), sorted[r]) - S.begin();
      for (int64_t f = 0; f < Fl; ++f)
        for (int64_t c = 0; c < W; ++c)
          err = std::max(err, std::abs(got[static_cast<size_t>(
                                           (static_cast<int64_t>(r) * Fl + f) * W + c)] -
                                       w(i * Fl + f, c)));
    }
    return err;
  }
};

// The fitter's closed-form held-out selection and its LAPACK solve against a direct float64
// ridge regression, on seeded random data with odd sizes.
TEST(AdapterFitter, MatchesDirectFloat64Ridge) {
  const ModelSpec source = make_spec("src", 3, 3, 6, 10000.0, RopeStyle::kHalf);
  const ModelSpec target = make_spec("tgt", 2, 1, 10, 30000.0, RopeStyle::kInterleaved);
  FitOptions o;
  o.selection = FitOptions::Selection::kExplicit;
  o.source_layers = {{0, 2}, {1}};
  o.rope_aware = false;
  o.holdout = 0.3;
  o.seed = 5;
  AdapterFitter fitter(source, target, o);
  const DirectRidgeData data(fitter, source, target, o.source_layers, 211, 17);
  const LinearAdapter adapter = fitter.fit();
  for (int64_t j = 0; j < 2; ++j) {
    const auto& S = o.source_layers[static_cast<size_t>(j)];
    const LayerFit& lf = adapter.report().layers[static_cast<size_t>(j)];
    EXPECT_EQ(lf.source_layers, S);
    EXPECT_TRUE(lf.selection.empty());
    for (int kind = 0; kind < 2; ++kind) {
      const auto best = data.direct(S, j, kind, o.ridge_grid);
      EXPECT_EQ(kind ? lf.ridge_value : lf.ridge_key, best.ridge) << "layer " << j;
      EXPECT_NEAR(kind ? lf.r2_value : lf.r2_key, best.r2, 1e-9) << "layer " << j;
      EXPECT_GT(best.r2, 0.5);  // a real fit, not a degenerate one
      EXPECT_LT(DirectRidgeData::weight_error(adapter, j, kind, S, best.w, data.Fl, data.W),
                1e-5 * std::max(1.0, best.w.cwiseAbs().maxCoeff()))
          << "layer " << j;
    }
  }
}

// kAuto's selection: every step it reports (the held-out R² of the chosen layers so far with one
// more, from Cholesky factors extended a layer at a time) and the final maps equal a direct
// float64 ridge regression of that set, on seeded random data with odd sizes.
TEST(AdapterFitter, AutoSelectionStepsMatchDirectFloat64Ridge) {
  const ModelSpec source = make_spec("src", 5, 3, 6, 10000.0, RopeStyle::kHalf);
  const ModelSpec target = make_spec("tgt", 2, 1, 14, 30000.0, RopeStyle::kInterleaved);
  for (int64_t exact : {1, 2, 4}) {
    FitOptions o;
    o.rope_aware = false;
    o.holdout = 0.3;
    o.seed = 3;
    o.max_source_layers = 4;
    o.min_gain = -1e9;  // every step up to max_source_layers, so that there is a path to check
    o.exact_candidates = exact;
    AdapterFitter fitter(source, target, o);
    const DirectRidgeData data(fitter, source, target, {{0, 3}, {1, 2, 4}}, 337, 23);
    const LinearAdapter adapter = fitter.fit();
    for (int64_t j = 0; j < 2; ++j) {
      const LayerFit& lf = adapter.report().layers[static_cast<size_t>(j)];
      ASSERT_EQ(lf.source_layers.size(), 4u);
      std::vector<int64_t> chosen;  // in the order added
      size_t accepted = 0, round_size = 0;
      for (const SelectionStep& st : lf.selection) {
        std::vector<int64_t> S = chosen;
        S.push_back(st.source_layer);
        for (int kind = 0; kind < 2; ++kind) {
          const double r2 = data.direct(S, j, kind, o.ridge_grid).r2;
          EXPECT_NEAR(kind ? st.r2_value : st.r2_key, r2, 1e-9 * std::max(1.0, std::abs(r2)))
              << "exact " << exact << " layer " << j << " step " << st.source_layer;
        }
        ++round_size;
        if (st.accepted) {
          chosen = S;
          ++accepted;
          EXPECT_LE(round_size, accepted == 1 ? 1u : static_cast<size_t>(exact));
          round_size = 0;
        }
      }
      ASSERT_EQ(accepted, 4u);
      std::vector<int64_t> sorted = chosen;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_EQ(lf.source_layers, sorted);
      for (int kind = 0; kind < 2; ++kind) {
        const auto best = data.direct(chosen, j, kind, o.ridge_grid);
        EXPECT_EQ(kind ? lf.ridge_value : lf.ridge_key, best.ridge);
        EXPECT_NEAR(kind ? lf.r2_value : lf.r2_key, best.r2, 1e-9);
        EXPECT_LT(DirectRidgeData::weight_error(adapter, j, kind, chosen, best.w, data.Fl, data.W),
                  1e-5 * std::max(1.0, best.w.cwiseAbs().maxCoeff()));
      }
    }
    // The planted layers come first (each target layer's are its best predictors).
    const auto& steps0 = adapter.report().layers[0].selection;
    std::vector<int64_t> first;
    for (const SelectionStep& st : steps0)
      if (st.accepted && first.size() < 2) first.push_back(st.source_layer);
    std::sort(first.begin(), first.end());
    EXPECT_EQ(first, (std::vector<int64_t>{0, 3})) << "exact " << exact;
  }
}

// Overwrites an HFKV's random bytes with normal values in its dtype (random bytes may be NaN).
void fill_normal(HFKV& kv, const ModelSpec& spec, int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  const int64_t w = spec.num_kv_heads * spec.head_dim;
  std::vector<float> dense(static_cast<size_t>(tokens * w));
  for (int64_t l = 0; l < spec.num_layers; ++l)
    for (int k = 0; k < 2; ++k) {
      for (auto& v : dense) v = dist(rng);
      detail::store_plane(dense.data(), w, spec.dtype, tokens, spec.num_kv_heads, spec.head_dim,
                          kv.view().plane(l, static_cast<KVView::Kind>(k)));
    }
}

// An adapter on odd shapes (explicit, non-consecutive source layer sets) fitted on normal data;
// gains: the target's key norm (FitOptions::target_key_norm), or none.
LinearAdapter fit_odd(const ModelSpec& source, const ModelSpec& target, bool rope_aware,
                      const std::vector<std::vector<float>>& gains) {
  FitOptions o;
  o.selection = FitOptions::Selection::kExplicit;
  o.source_layers = {{0}, {0, 2}, {1, 2}, {0, 1, 2}};
  o.rope_aware = rope_aware;
  o.target_key_norm = gains;
  AdapterFitter fitter(source, target, o);
  HFKV fs(source, 211, 1, 5), ft(target, 211, 3, 6);
  fill_normal(fs, source, 211, 5);
  fill_normal(ft, target, 211, 6);
  fitter.add(fs.view(), ft.view(), 0);
  return fitter.fit();
}

// fit_odd's adapter for a dtype. The target's 42 outputs per plane cross the bfloat16 kernels'
// 16- and 32-column blocks.
struct OddPair {
  ModelSpec source, target;
  LinearAdapter adapter;
  explicit OddPair(DType dtype)
      : source(make_spec("src", 3, 3, 10, 10000.0, RopeStyle::kHalf, dtype)),
        target(make_spec("tgt", 4, 3, 14, 30000.0, RopeStyle::kInterleaved, dtype)),
        adapter(fit_odd(source, target, true, {})) {}
};

// Every plane of `fast` within the float32 path's tolerance for `dtype` of the reference's
// largest magnitude (per plane).
void expect_near_reference(const KVView& fast, const KVView& ref, DType dtype) {
  const double tol = dtype == DType::kFloat32 ? 1e-4 : dtype == DType::kBFloat16 ? 2e-2 : 4e-3;
  const int64_t T = ref.tokens(), w = ref.kv_heads() * ref.head_dim();
  std::vector<float> a(static_cast<size_t>(T * w)), b(a.size());
  for (int64_t l = 0; l < ref.num_layers(); ++l)
    for (int k = 0; k < 2; ++k) {
      const auto kind = static_cast<KVView::Kind>(k);
      detail::load_plane(fast.plane(l, kind), dtype, T, ref.kv_heads(), ref.head_dim(), a.data(), w);
      detail::load_plane(ref.plane(l, kind), dtype, T, ref.kv_heads(), ref.head_dim(), b.data(), w);
      double scale = 0;
      for (float v : b) scale = std::max(scale, static_cast<double>(std::fabs(v)));
      ASSERT_GT(scale, 0.0);
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_NEAR(a[i], b[i], tol * scale) << l << " " << k << " " << i;
    }
}

// Converts src (tokens at start..) into *fast (strided) with the fast path, and checks it against
// the float64 reference.
void convert_near_reference(const LinearAdapter& adapter, const HFKV& src, int64_t start,
                            HFKV& fast, DType dtype) {
  const KVView out = fast.view();
  HFKV ref(adapter.target(), out.tokens(), 0, 2);
  adapter.convert(src.view(), start, out);
  adapter.convert_reference(src.view(), start, ref.view());
  expect_near_reference(out, ref.view(), dtype);
}

// (dtype, tokens): 37 tokens convert in one block; 601 in several, in parallel when there are
// several OpenMP threads (the float32 path blocks tokens to bound its memory, the float64
// reference does not; for these shapes 2 or more blocks in float32, 3 or more in bfloat16 and
// float16), the last one shorter.
class ConvertVsReference : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

TEST_P(ConvertVsReference, StridedOddSizes) {
  const DType dtype = std::get<0>(GetParam());
  const OddPair pair(dtype);
  const ModelSpec &source = pair.source, &target = pair.target;
  const LinearAdapter& adapter = pair.adapter;

  const int64_t T = std::get<1>(GetParam()), start = 1001;
  HFKV src(source, T, 3, 7);
  fill_normal(src, source, T, 8);
  HFKV fast(target, T, 2, 1);
  convert_near_reference(adapter, src, start, fast, dtype);
}

INSTANTIATE_TEST_SUITE_P(DTypes, ConvertVsReference,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16,
                                                              DType::kFloat16),
                                            ::testing::Values(int64_t{37}, int64_t{601})));

// CUDA views where no CUDA path can run them (no device here, or a build without CUDA) are
// refused with Unavailable before any of their memory is touched: the pointers are fake.
TEST(ConvertDevice, CudaViewsWithoutDeviceAreUnavailable) {
  PlantedPair pair;
  FitOptions o;
  o.selection = FitOptions::Selection::kAll;
  AdapterFitter fitter(pair.source, pair.target, o);
  FloatKV fs(pair.source, 40), ft(pair.target, 40);
  std::mt19937 rng(2);
  fill_position_free(fs, rng);
  fill_position_free(ft, rng);
  fitter.add(fs.view(), ft.view());
  const LinearAdapter adapter = fitter.fit();

  const Device cuda{DeviceType::kCUDA, 0};
  auto fake = [&](const ModelSpec& s, uintptr_t base) {
    return KVView::contiguous(reinterpret_cast<void*>(base), s.dtype, cuda, s.num_layers, 7,
                              s.num_kv_heads, s.head_dim);
  };
  const KVView src = fake(pair.source, 0x1000), dst = fake(pair.target, 0x100000);
  if (cuda_device_count() == 0) {
    EXPECT_THROW(adapter.convert(src, 0, dst), Unavailable);
    EXPECT_THROW(adapter.convert(src, 0, dst, nullptr), Unavailable);
    try {
      adapter.convert(src, 3, dst);
    } catch (const Unavailable& e) {
      EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
    }
  } else {
    // With a device the fake addresses are recognised as not being device memory.
    EXPECT_THROW(adapter.convert(src, 0, dst), InvalidArgument);
  }
  // Whatever the build: mixed devices and the float64 reference on CUDA views are bad arguments.
  FloatKV out(pair.target, 7), in(pair.source, 7);
  EXPECT_THROW(adapter.convert(src, 0, out.view()), InvalidArgument);
  EXPECT_THROW(adapter.convert(in.view(), 0, dst), InvalidArgument);
  EXPECT_THROW(adapter.convert_reference(src, 0, dst), InvalidArgument);
  // The stream overload on CPU views is the CPU path (the stream is ignored).
  fill_position_free(in, rng);
  FloatKV a(pair.target, 7), b(pair.target, 7);
  adapter.convert(in.view(), 5, a.view());
  adapter.convert(in.view(), 5, b.view(), reinterpret_cast<void*>(0x1234));
  EXPECT_EQ(a.data, b.data);
}

TEST(AdapterFitter, BadInput) {
  PlantedPair pair;
  FitOptions o;
  AdapterFitter fitter(pair.source, pair.target, o);
  EXPECT_THROW(fitter.fit(), InvalidArgument);  // empty
  FloatKV src(pair.source, 10), tgt(pair.target, 10), short_tgt(pair.target, 9);
  std::mt19937 rng(1);
  fill_position_free(src, rng);
  fill_position_free(tgt, rng);
  EXPECT_THROW(fitter.add(src.view(), short_tgt.view()), InvalidArgument);
  EXPECT_THROW(fitter.add(tgt.view(), src.view()), InvalidArgument);  // swapped specs
  // Positions: start_pos + tokens must neither overflow nor pass 2^53 (exact RoPE angles).
  EXPECT_THROW(fitter.add(src.view(), tgt.view(), -1), InvalidArgument);
  EXPECT_THROW(fitter.add(src.view(), tgt.view(), INT64_MAX - 5), InvalidArgument);
  EXPECT_THROW(fitter.add(src.view(), tgt.view(), (int64_t{1} << 53) - 9), InvalidArgument);
  src.data[17] = NAN;
  EXPECT_THROW(fitter.add(src.view(), tgt.view()), InvalidArgument);
  EXPECT_EQ(fitter.train_tokens() + fitter.holdout_tokens(), 0);  // nothing accumulated
  o.selection = FitOptions::Selection::kExplicit;
  o.source_layers = {{0}};
  EXPECT_THROW(AdapterFitter(pair.source, pair.target, o), InvalidArgument);
  o.source_layers = {{0}, {3}};
  EXPECT_THROW(AdapterFitter(pair.source, pair.target, o), InvalidArgument);
  o = FitOptions{};
  o.holdout = 0;
  EXPECT_THROW(AdapterFitter(pair.source, pair.target, o), InvalidArgument);
  o = FitOptions{};
  o.max_memory_bytes = 1000;
  EXPECT_THROW(AdapterFitter(pair.source, pair.target, o), InvalidArgument);
}

// A monotone alignment of `target` tokens onto `source` ones as two tokenizations give it: runs
// of target tokens share a source token, source tokens are skipped, and (missing) the first
// target tokens have none.
std::vector<int64_t> tokenization_alignment(int64_t source, int64_t target, uint32_t seed,
                                            int64_t missing = 0) {
  std::mt19937 rng(seed);
  std::vector<int64_t> a(static_cast<size_t>(target), kNoSource);
  for (int64_t j = missing; j < target; ++j)
    a[static_cast<size_t>(j)] = std::min<int64_t>(source - 1, (j - missing) * source / target +
                                                                  static_cast<int64_t>(rng() % 2));
  std::sort(a.begin() + missing, a.end());
  return a;
}

TEST(AdapterFitter, RecoversPlantedMapThroughTwoTokenizations) {
  PlantedPair pair;
  FitOptions o;
  o.alignment_policy = "seen";
  AdapterFitter fitter(pair.source, pair.target, o);
  int64_t paired = 0;
  for (int i = 0; i < 6; ++i) {
    const int64_t ts = 61 + 7 * i, tt = 89 - 5 * i;  // source and target token counts differ
    const auto rows = tokenization_alignment(ts, tt, 10 + i, /*missing=*/2);
    FloatKV src(pair.source, ts), tgt(pair.target, tt);
    pair.sample_aligned(&rows, 13 + 200 * i, 13 + 200 * i, 100 + i, src, tgt);
    fitter.add(src.view(), tgt.view(), 13 + 200 * i, rows);
    paired += tt - 2;
  }
  EXPECT_EQ(fitter.train_tokens() + fitter.holdout_tokens(), paired);  // the -1 rows are skipped
  const LinearAdapter adapter = fitter.fit();
  EXPECT_EQ(adapter.report().alignment_policy, "seen");
  for (const LayerFit& lf : adapter.report().layers) {
    EXPECT_GT(lf.r2_key, 0.9999);
    EXPECT_GT(lf.r2_value, 0.9999);
  }
  // Fresh data: the aligned convert reproduces the target's cache, source and target at
  // different positions.
  const int64_t ts = 40, tt = 57;
  auto rows = tokenization_alignment(ts, tt, 77);
  FloatKV src(pair.source, ts), tgt(pair.target, tt), out(pair.target, tt);
  pair.sample_aligned(&rows, 3000, 4100, 999, src, tgt);
  adapter.convert(src.view(), 3000, out.view(), rows, 4100);
  EXPECT_LT(relative_rms_error(out.data, tgt.data), 1e-3);
  // The same data without the alignment is a different (wrong) answer: the check can fail.
  FloatKV same(pair.target, ts);
  adapter.convert(src.view(), 3000, same.view());
  std::vector<float> first(tgt.data.begin(), tgt.data.begin() + 10);
  EXPECT_NE(std::vector<float>(same.data.begin(), same.data.begin() + 10), first);
}

// Positions and entries of an aligned convert or add are checked before anything is touched.
TEST(AdapterFitter, AlignmentBadInput) {
  PlantedPair pair;
  AdapterFitter fitter(pair.source, pair.target);
  FloatKV src(pair.source, 10), tgt(pair.target, 12);
  std::mt19937 rng(1);
  fill_position_free(src, rng);
  fill_position_free(tgt, rng);
  std::vector<int64_t> rows = tokenization_alignment(10, 12, 3);
  EXPECT_THROW(fitter.add(src.view(), tgt.view(), 0, std::vector<int64_t>(11, 0)),
               InvalidArgument);  // length
  rows[4] = 10;
  EXPECT_THROW(fitter.add(src.view(), tgt.view(), 0, rows), InvalidArgument);  // out of range
  rows[4] = -2;
  EXPECT_THROW(fitter.add(src.view(), tgt.view(), 0, rows), InvalidArgument);
  EXPECT_EQ(fitter.train_tokens() + fitter.holdout_tokens(), 0);
  FitOptions bad;
  bad.alignment_policy = "nearest";
  EXPECT_THROW(AdapterFitter(pair.source, pair.target, bad), InvalidArgument);

  for (int i = 0; i < 3; ++i) fitter.add(src.view(), tgt.view(), 100 * i,
                                         tokenization_alignment(10, 12, 3 + i, 1));
  const LinearAdapter adapter = fitter.fit();
  FloatKV out(pair.target, 12);
  rows = tokenization_alignment(10, 12, 3, /*missing=*/1);
  EXPECT_THROW(adapter.convert(src.view(), 0, out.view(), rows, 0), InvalidArgument);  // -1
  rows[0] = 0;
  EXPECT_THROW(adapter.convert(src.view(), 0, out.view(), std::vector<int64_t>(5, 0), 0),
               InvalidArgument);
  EXPECT_THROW(adapter.convert(src.view(), 0, out.view(), rows, -1), InvalidArgument);
  EXPECT_THROW(adapter.convert(src.view(), 0, out.view(), rows, (int64_t{1} << 53) - 3),
               InvalidArgument);
  EXPECT_THROW(adapter.convert(src.view(), -1, out.view(), rows, 0), InvalidArgument);
  EXPECT_THROW(adapter.convert(src.view(), 0, out.view()), InvalidArgument);  // counts differ
  adapter.convert(src.view(), 0, out.view(), rows, 0);
}

// Gathers the aligned source by hand (keys moved from source position start + a(j) to target
// position tstart + j) so the plain float64 reference gives what the aligned one must.
void gathered_source(const ModelSpec& spec, const KVView& src, int64_t start,
                     const std::vector<int64_t>& rows, int64_t tstart, FloatKV& out) {
  const int64_t w = spec.num_kv_heads * spec.head_dim, n = static_cast<int64_t>(rows.size());
  for (int64_t l = 0; l < spec.num_layers; ++l)
    for (int k = 0; k < 2; ++k) {
      const auto inv = detail::rope_inv_freq(spec, l);
      float* p = out.plane(l, k);
      detail::load_plane(src.plane(l, static_cast<KVView::Kind>(k)), src.dtype(), n,
                         spec.num_kv_heads, spec.head_dim, p, w, rows.data());
      if (k == 0) {
        detail::apply_rope(spec, inv, start, true, n, spec.num_kv_heads, p, w, rows.data());
        detail::apply_rope(spec, inv, tstart, false, n, spec.num_kv_heads, p, w);
      }
    }
}

// (dtype, target tokens): odd sizes, one block and several; strided views; an alignment with
// repeats, skips and out-of-order entries.
class AlignedConvertVsReference
    : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

TEST_P(AlignedConvertVsReference, StridedOddSizes) {
  const DType dtype = std::get<0>(GetParam());
  const OddPair pair(dtype);
  const ModelSpec &source = pair.source, &target = pair.target;
  const LinearAdapter& adapter = pair.adapter;

  const int64_t T = std::get<1>(GetParam()), S = T / 2 + 17, start = 1001, tstart = 77;
  std::vector<int64_t> rows = tokenization_alignment(S, T, 9);
  std::swap(rows[3], rows[T - 2]);  // out of order
  HFKV src(source, S, 3, 7);
  fill_normal(src, source, S, 8);
  HFKV fast(target, T, 2, 1), ref(target, T, 0, 2);
  adapter.convert(src.view(), start, fast.view(), rows, tstart);
  adapter.convert_reference(src.view(), start, ref.view(), rows, tstart);
  // The aligned reference equals the plain reference of the hand-gathered source (float32
  // source, so the gather's rounding is exact).
  if (dtype == DType::kFloat32) {
    FloatKV g(source, T), plain(target, T);
    gathered_source(source, src.view(), start, rows, tstart, g);
    adapter.convert_reference(g.view(), tstart, plain.view());
    const int64_t w = target.num_kv_heads * target.head_dim;
    std::vector<float> b(static_cast<size_t>(T * w));
    for (int64_t l = 0; l < target.num_layers; ++l)
      for (int k = 0; k < 2; ++k) {
        detail::load_plane(ref.view().plane(l, static_cast<KVView::Kind>(k)), dtype, T,
                           target.num_kv_heads, target.head_dim, b.data(), w);
        const float* p = plain.plane(l, k);
        for (size_t i = 0; i < b.size(); ++i) ASSERT_NEAR(b[i], p[i], 1e-5 * (1 + std::fabs(p[i])));
      }
  }
  expect_near_reference(fast.view(), ref.view(), dtype);
  // The identity alignment at equal positions is the plain convert, bit for bit.
  if (S >= T) return;
  std::vector<int64_t> identity(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) identity[static_cast<size_t>(i)] = i;
  HFKV x(target, S, 1, 3), y(target, S, 1, 4);
  adapter.convert(src.view(), start, x.view(), identity, start);
  adapter.convert(src.view(), start, y.view());
  EXPECT_TRUE(testing::same_elements(x.view(), y.view()));
}

INSTANTIATE_TEST_SUITE_P(DTypes, AlignedConvertVsReference,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16,
                                                              DType::kFloat16),
                                            ::testing::Values(int64_t{37}, int64_t{211})));

// The CUDA kernels' per-element functions (kernels/convert_elements.cuh), run on the host in the
// order the device runs them (RoPE tables, gather, GEMM, epilogue) with float32 features, against
// the float64 reference of the aligned convert: the device arithmetic and indexing, checked where
// no device is.
TEST(ConvertElements, HostRunOfTheDevicePipelineMatchesReference) {
  for (const bool interleaved_source : {false, true}) {
    ModelSpec source = make_spec("src", 2, 3, 10, 10000.0,
                                 interleaved_source ? RopeStyle::kInterleaved : RopeStyle::kHalf);
    ModelSpec target = make_spec("tgt", 3, 2, 6, 30000.0,
                                 interleaved_source ? RopeStyle::kHalf : RopeStyle::kInterleaved);
    FitOptions o;
    o.selection = FitOptions::Selection::kAll;
    AdapterFitter fitter(source, target, o);
    HFKV fs(source, 150, 1, 5), ft(target, 150, 3, 6);
    fill_normal(fs, source, 150, 5);
    fill_normal(ft, target, 150, 6);
    fitter.add(fs.view(), ft.view(), 0);
    const LinearAdapter adapter = fitter.fit();

    const int64_t S = 29, T = 43, start = 517, tstart = 9;
    std::vector<int64_t> rows = tokenization_alignment(S, T, 4);
    std::swap(rows[0], rows[T - 1]);
    HFKV src(source, S, 3, 7);
    fill_normal(src, source, S, 8);
    HFKV dev(target, T, 2, 1), ref(target, T, 0, 2);
    adapter.convert_reference(src.view(), start, ref.view(), rows, tstart);

    const int64_t sh = source.num_kv_heads, sd = source.head_dim, th = target.num_kv_heads,
                  td = target.head_dim, sw = sh * sd, tw = th * td;
    const auto sinv = detail::rope_inv_freq(source, 0), tinv = detail::rope_inv_freq(target, 0);
    std::vector<cuda::CosSin> stab(static_cast<size_t>(T * sd / 2)),
        ttab(static_cast<size_t>(T * td / 2));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < sd / 2; ++i)
        stab[static_cast<size_t>(t * sd / 2 + i)] =
            cuda::rope_entry(start, rows.data(), t, sinv[static_cast<size_t>(i)]);
      for (int64_t i = 0; i < td / 2; ++i)
        ttab[static_cast<size_t>(t * td / 2 + i)] =
            cuda::rope_entry(tstart, nullptr, t, tinv[static_cast<size_t>(i)]);
    }
    const int64_t ldf = source.num_layers * 2 * sw;
    std::vector<float> features(static_cast<size_t>(T * ldf));
    for (int64_t l = 0; l < source.num_layers; ++l)
      for (int p = 0; p < sh * sd; ++p) {
        const cuda::PairIndex ix = cuda::pair_index(p, static_cast<int>(sh),
                                                    static_cast<int>(sd), interleaved_source);
        const KVPlane plane = src.view().plane(l, static_cast<KVView::Kind>(ix.kind));
        for (int64_t t = 0; t < T; ++t)
          cuda::gather_pair(plane, cuda::source_row(rows.data(), t), ix,
                            ix.kind == 0 ? &stab[static_cast<size_t>(t * sd / 2 + ix.pair)]
                                         : nullptr,
                            features.data() + t * ldf + l * 2 * sw + ix.kind * sw + ix.head * sd);
      }
    std::vector<float> y(static_cast<size_t>(T * 2 * tw));
    for (int64_t j = 0; j < target.num_layers; ++j) {
      ASSERT_EQ(adapter.report().layers[static_cast<size_t>(j)].source_layers.size(),
                static_cast<size_t>(source.num_layers));
      for (int64_t t = 0; t < T; ++t)
        for (int kind = 0; kind < 2; ++kind)
          for (int64_t c = 0; c < tw; ++c) {
            double acc = 0;  // float32 products summed exactly enough: the GEMM's tolerance
            const auto& w = adapter.weights(j, kind);
            for (int64_t f = 0; f < ldf; ++f)
              acc += static_cast<double>(features[static_cast<size_t>(t * ldf + f)]) *
                     w[static_cast<size_t>(f * tw + c)];
            y[static_cast<size_t>(t * 2 * tw + kind * tw + c)] = static_cast<float>(acc);
          }
      for (int p = 0; p < th * td; ++p) {
        const cuda::PairIndex ix = cuda::pair_index(p, static_cast<int>(th),
                                                    static_cast<int>(td), !interleaved_source);
        const auto& bias = adapter.bias(j, ix.kind);
        const KVPlane plane = dev.view().plane(j, static_cast<KVView::Kind>(ix.kind));
        for (int64_t t = 0; t < T; ++t)
          cuda::epilogue_pair<float>(
              y.data() + t * 2 * tw + ix.kind * tw + ix.head * td,
              bias[static_cast<size_t>(ix.head * td + ix.a)],
              bias[static_cast<size_t>(ix.head * td + ix.b)], ix,
              ix.kind == 0 ? &ttab[static_cast<size_t>(t * td / 2 + ix.pair)] : nullptr, plane,
              t);
      }
    }
    std::vector<float> a(static_cast<size_t>(T * tw)), b(a.size());
    for (int64_t l = 0; l < target.num_layers; ++l)
      for (int k = 0; k < 2; ++k) {
        detail::load_plane(dev.view().plane(l, static_cast<KVView::Kind>(k)), DType::kFloat32, T,
                           th, td, a.data(), tw);
        detail::load_plane(ref.view().plane(l, static_cast<KVView::Kind>(k)), DType::kFloat32, T,
                           th, td, b.data(), tw);
        double scale = 0;
        for (float v : b) scale = std::max(scale, static_cast<double>(std::fabs(v)));
        ASSERT_GT(scale, 0.0);
        for (size_t i = 0; i < a.size(); ++i)
          ASSERT_NEAR(a[i], b[i], 1e-4 * scale) << interleaved_source << " " << l << " " << k;
      }
  }
}

// The target's key norm (FitOptions::target_key_norm): gains per target layer of either sign,
// one of them 0, on odd shapes. Their magnitudes stay away from 0 otherwise: a gain near 0
// multiplies the map's error in that dimension in the head's scale, and with it the bfloat16
// path's rounding, beyond the tolerance the comparison with the reference uses.
std::vector<std::vector<float>> random_gains(const ModelSpec& target, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(0.3f, 3.0f);
  std::vector<std::vector<float>> gains(static_cast<size_t>(target.num_layers));
  for (auto& g : gains) {
    for (int64_t i = 0; i < target.head_dim; ++i) g.push_back(rng() % 4 ? dist(rng) : -dist(rng));
    g[static_cast<size_t>(rng() % g.size())] = 0.0f;
  }
  return gains;
}


// Against the same maps without the norm, in float64 (reference) and without RoPE so the
// relation is per element: values are unchanged; each key head is the plain map's, its zero-gain
// dimensions 0 and the rest scaled by sqrt(used / sum_i (k_i / g_i)^2), recomputed here.
TEST(KeyNorm, PutsEachKeyHeadOnTheTargetsSet) {
  const ModelSpec source = make_spec("src", 3, 3, 10, 10000.0, RopeStyle::kHalf);
  const ModelSpec target = make_spec("tgt", 4, 3, 14, 30000.0, RopeStyle::kInterleaved);
  const auto gains = random_gains(target, 11);
  const LinearAdapter plain = fit_odd(source, target, false, {});
  const LinearAdapter normed = fit_odd(source, target, false, gains);
  ASSERT_FALSE(plain.has_key_norm());
  ASSERT_TRUE(normed.has_key_norm());
  EXPECT_TRUE(plain.key_norm(2).empty());
  EXPECT_EQ(normed.key_norm(2), gains[2]);
  EXPECT_NE(plain.fingerprint(), normed.fingerprint());
  for (int kind = 0; kind < 2; ++kind) EXPECT_EQ(plain.weights(3, kind), normed.weights(3, kind));

  const int64_t T = 53;
  HFKV src(source, T, 2, 9);
  fill_normal(src, source, T, 10);
  FloatKV a(target, T), b(target, T);
  plain.convert_reference(src.view(), 7, a.view());
  normed.convert_reference(src.view(), 7, b.view());
  const int64_t H = target.num_kv_heads, D = target.head_dim;
  for (int64_t l = 0; l < target.num_layers; ++l) {
    const std::vector<float>& g = gains[static_cast<size_t>(l)];
    ASSERT_EQ(std::vector<float>(a.plane(l, 1), a.plane(l, 1) + T * H * D),
              std::vector<float>(b.plane(l, 1), b.plane(l, 1) + T * H * D));
    int64_t used = 0;
    for (float v : g) used += v != 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* ka = a.plane(l, 0) + (t * H + h) * D;
        const float* kb = b.plane(l, 0) + (t * H + h) * D;
        double sum = 0, on_set = 0;
        for (int64_t i = 0; i < D; ++i)
          if (g[static_cast<size_t>(i)] != 0) sum += std::pow(ka[i] / g[static_cast<size_t>(i)], 2);
        ASSERT_GT(sum, 0.0);
        const double scale = std::sqrt(static_cast<double>(used) / sum);
        for (int64_t i = 0; i < D; ++i) {
          const double gi = g[static_cast<size_t>(i)];
          ASSERT_NEAR(kb[i], gi != 0 ? ka[i] * scale : 0.0, 1e-5 * std::fabs(ka[i] * scale) + 1e-7)
              << l << " " << t << " " << h << " " << i;
          if (gi != 0) on_set += std::pow(kb[i] / gi, 2);
        }
        ASSERT_NEAR(on_set / static_cast<double>(used), 1.0, 1e-4);
      }
  }
}

// The fast path against the float64 reference with the norm, with RoPE, strided, in several
// blocks, and the file keeps the gains (and with them the fingerprint and the conversion).
class KeyNormVsReference : public ::testing::TestWithParam<DType> {};

TEST_P(KeyNormVsReference, StridedOddSizesAndFile) {
  const DType dtype = GetParam();
  const ModelSpec source = make_spec("src", 3, 3, 10, 10000.0, RopeStyle::kHalf, dtype);
  const ModelSpec target = make_spec("tgt", 4, 3, 14, 30000.0, RopeStyle::kInterleaved, dtype);
  const LinearAdapter adapter = fit_odd(source, target, true, random_gains(target, 12));
  const int64_t T = 601, start = 1001;
  HFKV src(source, T, 3, 7);
  fill_normal(src, source, T, 8);
  HFKV fast(target, T, 2, 1);
  convert_near_reference(adapter, src, start, fast, dtype);

  testing::TempDir dir;
  const std::string path = dir.path + "/a.safetensors";
  adapter.save(path);
  const LinearAdapter loaded = LinearAdapter::load(path);
  ASSERT_TRUE(loaded.has_key_norm());
  for (int64_t l = 0; l < target.num_layers; ++l) EXPECT_EQ(loaded.key_norm(l), adapter.key_norm(l));
  EXPECT_EQ(loaded.fingerprint(), adapter.fingerprint());
  HFKV again(target, T, 2, 1);
  loaded.convert(src.view(), start, again.view());
  EXPECT_TRUE(testing::same_elements(again.view(), fast.view()));
}

INSTANTIATE_TEST_SUITE_P(DTypes, KeyNormVsReference,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16));

TEST(KeyNorm, BadGainsAndCudaViews) {
  const ModelSpec source = make_spec("src", 3, 3, 10, 10000.0, RopeStyle::kHalf);
  const ModelSpec target = make_spec("tgt", 4, 3, 14, 30000.0, RopeStyle::kInterleaved);
  auto gains = random_gains(target, 13);
  FitOptions o;
  o.target_key_norm = gains;
  o.target_key_norm.pop_back();
  EXPECT_THROW((void)AdapterFitter(source, target, o), InvalidArgument);  // a layer short
  o.target_key_norm = gains;
  o.target_key_norm[1].push_back(1.0f);
  EXPECT_THROW((void)AdapterFitter(source, target, o), InvalidArgument);  // not head_dim
  o.target_key_norm = gains;
  o.target_key_norm[2][3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW((void)AdapterFitter(source, target, o), InvalidArgument);
  o.target_key_norm = gains;
  EXPECT_NO_THROW((void)AdapterFitter(source, target, o));

  // Only the CPU path applies the norm: CUDA views are refused whatever the build or device.
  const LinearAdapter adapter = fit_odd(source, target, true, gains);
  const Device cuda{DeviceType::kCUDA, 0};
  auto fake = [&](const ModelSpec& s, uintptr_t base) {
    return KVView::contiguous(reinterpret_cast<void*>(base), s.dtype, cuda, s.num_layers, 7,
                              s.num_kv_heads, s.head_dim);
  };
  try {
    adapter.convert(fake(source, 0x1000), 0, fake(target, 0x100000));
    ADD_FAILURE() << "no exception";
  } catch (const Unavailable& e) {
    EXPECT_NE(std::string(e.what()).find("key norm"), std::string::npos) << e.what();
  }
  EXPECT_THROW(adapter.key_norm(4), InvalidArgument);
}

}  // namespace
}  // namespace kvbridge
