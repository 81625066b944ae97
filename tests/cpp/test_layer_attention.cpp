// Adapters between specs with per-layer attention (ModelSpec::layer_attention): each source
// layer is un-rotated with its own RoPE and each target layer rotated with its own. The expected
// values here compute the angles from the RoPE formulas directly, not through src/adapter.
#include <gtest/gtest.h>

#include <Eigen/Dense>

#include <cmath>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "src/adapter/numeric.h"
#include "src/io/safetensors.h"
#include "test_util.h"

namespace kvbridge {
namespace {

using testing::HFKV;
using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

LayerAttention attention(double base, RopeScaling scaling = {}, int64_t window = 0) {
  LayerAttention a;
  a.rope_base = base;
  a.rope_scaling = scaling;
  a.sliding_window = window;
  return a;
}

// Source: 4 layers in two groups (base 1e4 with a window; base 5e5 with linear scaling 2.5).
// The spec-wide base (3e3) rules no layer: a convert that used it would be wrong everywhere.
ModelSpec layered_source(DType dtype = DType::kFloat32) {
  ModelSpec s = testing::small_spec(dtype, 4, 3, 10);
  s.name = "src-layered";
  s.rope_base = 3000.0;
  const RopeScaling linear{RopeScaling::Type::kLinear, 2.5, 1.0, 4.0, 8192};
  s.layer_attention = {attention(1e4, {}, 64), attention(1e4, {}, 64), attention(5e5, linear),
                       attention(5e5, linear)};
  return s;
}

// Target: 3 layers of mixed bases in the interleaved style, one with a llama3 scaling.
ModelSpec layered_target(DType dtype = DType::kFloat32) {
  ModelSpec s = testing::small_spec(dtype, 3, 2, 6);
  s.name = "tgt-layered";
  s.rope_style = RopeStyle::kInterleaved;
  const RopeScaling llama3{RopeScaling::Type::kLlama3, 8.0, 1.0, 4.0, 32};
  s.layer_attention = {attention(1e6, llama3), attention(1e4, {}, 512), attention(2e5)};
  return s;
}

// Inverse frequencies from the formulas (none, linear, llama3), written out for the test.
std::vector<double> inv_freq(const LayerAttention& a, int64_t dim) {
  const double pi = 3.14159265358979323846;
  const RopeScaling& s = a.rope_scaling;
  std::vector<double> out;
  for (int64_t i = 0; i < dim / 2; ++i) {
    double f = std::pow(a.rope_base, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
    if (s.type == RopeScaling::Type::kLinear) f /= s.factor;
    if (s.type == RopeScaling::Type::kLlama3) {
      const double wavelen = 2 * pi / f;
      const double lo = static_cast<double>(s.original_max_position) / s.low_freq_factor;
      const double hi = static_cast<double>(s.original_max_position) / s.high_freq_factor;
      if (wavelen > lo) {
        f /= s.factor;
      } else if (wavelen >= hi) {
        const double m = (static_cast<double>(s.original_max_position) / wavelen -
                          s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - m) * f / s.factor + m * f;
      }
    }
    out.push_back(f);
  }
  return out;
}

// Rotates (sign 1) or un-rotates (sign -1) one head vector at position `pos`.
void rotate_head(double* v, int64_t dim, RopeStyle style, const std::vector<double>& inv,
                 double pos, double sign) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = style == RopeStyle::kHalf ? i : 2 * i;
    const int64_t ib = style == RopeStyle::kHalf ? i + half : 2 * i + 1;
    const double angle = pos * inv[static_cast<size_t>(i)];
    const double c = std::cos(angle), s = sign * std::sin(angle);
    const double a = v[ia], b = v[ib];
    v[ia] = a * c - b * s;
    v[ib] = b * c + a * s;
  }
}

// Rows [tokens, heads * dim] of layer l's keys (kind 0) or values (1) of a view, in float64.
Mat plane_rows(const KVView& kv, int64_t l, int kind) {
  const int64_t T = kv.tokens(), w = kv.kv_heads() * kv.head_dim();
  std::vector<float> buf(static_cast<size_t>(T * w));
  detail::load_plane(kv.plane(l, static_cast<KVView::Kind>(kind)), kv.dtype(), T, kv.kv_heads(),
                     kv.head_dim(), buf.data(), w);
  return Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
             buf.data(), T, w)
      .cast<double>();
}

// Overwrites an HFKV's random bytes with normal values (random bytes may be NaN).
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

LinearAdapter fit_layered(const ModelSpec& source, const ModelSpec& target) {
  FitOptions o;
  o.selection = FitOptions::Selection::kExplicit;
  o.source_layers = {{0, 3}, {1, 2}, {0, 1, 2, 3}};  // each target layer draws on both groups
  AdapterFitter fitter(source, target, o);
  HFKV fs(source, 223, 1, 5), ft(target, 223, 3, 6);
  fill_normal(fs, source, 223, 5);
  fill_normal(ft, target, 223, 6);
  fitter.add(fs.view(), ft.view(), 0);
  return fitter.fit();
}

// The conversion written out: per target layer j, features [un-rotated K_l | V_l] of each of its
// source layers l (keys un-rotated at source positions with layer l's frequencies), times the
// adapter's weights plus bias, keys rotated at target positions with layer j's frequencies.
// rows: nullptr, or the source token of each target token.
std::vector<Mat> expected_convert(const LinearAdapter& adapter, const KVView& src,
                                  int64_t start_pos, int64_t tokens, const int64_t* rows,
                                  int64_t target_start) {
  const ModelSpec &s = adapter.source(), &t = adapter.target();
  const int64_t sw = s.num_kv_heads * s.head_dim, tw = t.num_kv_heads * t.head_dim;
  std::vector<Mat> out;  // [target layer * 2 + kind] -> [tokens, tw]
  for (int64_t j = 0; j < t.num_layers; ++j) {
    const auto& layers = adapter.report().layers[static_cast<size_t>(j)].source_layers;
    Mat x(tokens, static_cast<int64_t>(layers.size()) * 2 * sw);
    for (size_t si = 0; si < layers.size(); ++si) {
      const int64_t l = layers[si];
      const std::vector<double> inv = inv_freq(s.layer_attention[static_cast<size_t>(l)],
                                               s.head_dim);
      for (int kind = 0; kind < 2; ++kind) {
        const Mat p = plane_rows(src, l, kind);
        for (int64_t r = 0; r < tokens; ++r) {
          const int64_t i = rows ? rows[r] : r;
          Eigen::RowVectorXd v = p.row(i);
          if (kind == 0)
            for (int64_t h = 0; h < s.num_kv_heads; ++h)
              rotate_head(v.data() + h * s.head_dim, s.head_dim, s.rope_style, inv,
                          static_cast<double>(start_pos + i), -1);
          x.block(r, (static_cast<int64_t>(si) * 2 + kind) * sw, 1, sw) = v;
        }
      }
    }
    const std::vector<double> inv = inv_freq(t.layer_attention[static_cast<size_t>(j)],
                                             t.head_dim);
    for (int kind = 0; kind < 2; ++kind) {
      const auto& w = adapter.weights(j, kind);
      const auto& b = adapter.bias(j, kind);
      const Mat W = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic,
                                                   Eigen::RowMajor>>(w.data(), x.cols(), tw)
                        .cast<double>();
      Mat y = x * W;
      for (int64_t r = 0; r < tokens; ++r) {
        for (int64_t o = 0; o < tw; ++o) y(r, o) += b[static_cast<size_t>(o)];
        if (kind == 0)
          for (int64_t h = 0; h < t.num_kv_heads; ++h)
            rotate_head(y.row(r).data() + h * t.head_dim, t.head_dim, t.rope_style, inv,
                        static_cast<double>(target_start + r), 1);
      }
      out.push_back(std::move(y));
    }
  }
  return out;
}

TEST(LayerAttention, InverseFrequenciesPerLayerAndDistinctSets) {
  const ModelSpec s = layered_source();
  const detail::LayerInvFreq f = detail::layer_inv_freq(s);
  ASSERT_EQ(f.num_sets(), 2);  // four layers, two distinct RoPEs (windows do not count)
  EXPECT_EQ(f.set_of, (std::vector<int64_t>{0, 0, 1, 1}));
  for (int64_t l = 0; l < 4; ++l) {
    const auto want = inv_freq(s.layer_attention[static_cast<size_t>(l)], s.head_dim);
    ASSERT_EQ(f[l].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(f[l][i], want[i], 1e-15 * want[0]);
    EXPECT_EQ(detail::rope_inv_freq(s, l), f[l]);
  }
  // Without entries: one set, from the spec-wide fields.
  ModelSpec plain = s;
  plain.layer_attention.clear();
  const detail::LayerInvFreq p = detail::layer_inv_freq(plain);
  EXPECT_EQ(p.num_sets(), 1);
  const auto flat = inv_freq(attention(3000.0), s.head_dim);
  for (size_t i = 0; i < flat.size(); ++i) EXPECT_NEAR(p[3][i], flat[i], 1e-15);
  EXPECT_EQ(detail::layer_inv_freq(layered_target()).num_sets(), 3);
}

// The float64 reference against the conversion written out above, strided odd-sized views, with
// and without an alignment (repeats and an out-of-order entry; positions from both sides).
TEST(LayerAttention, ReferenceConvertIsPerLayerUnrotateGemmRotate) {
  const ModelSpec source = layered_source(), target = layered_target();
  const LinearAdapter adapter = fit_layered(source, target);
  const int64_t T = 53, start = 777;
  HFKV src(source, T, 3, 7);
  fill_normal(src, source, T, 8);
  const int64_t tw = target.num_kv_heads * target.head_dim;
  auto check = [&](const KVView& got, const std::vector<Mat>& want) {
    double worst = 0, scale = 0;
    for (int64_t j = 0; j < target.num_layers; ++j)
      for (int kind = 0; kind < 2; ++kind) {
        const Mat g = plane_rows(got, j, kind);
        const Mat& w = want[static_cast<size_t>(2 * j + kind)];
        ASSERT_EQ(g.rows(), w.rows());
        ASSERT_EQ(g.cols(), tw);
        worst = std::max(worst, (g - w).cwiseAbs().maxCoeff());
        scale = std::max(scale, w.cwiseAbs().maxCoeff());
      }
    // The reference computes in float64 and stores float32: rounding of the output only.
    EXPECT_LT(worst, 1e-6 * scale);
  };
  {
    HFKV out(target, T, 2, 1);
    adapter.convert_reference(src.view(), start, out.view());
    check(out.view(), expected_convert(adapter, src.view(), start, T, nullptr, start));
  }
  {
    std::vector<int64_t> rows;
    for (int64_t t = 0; t < 41; ++t) rows.push_back((t * 7) % T);
    rows[5] = rows[4];  // a repeat
    const int64_t tstart = 31;
    HFKV out(target, 41, 1, 2);
    adapter.convert_reference(src.view(), start, out.view(), rows, tstart);
    check(out.view(), expected_convert(adapter, src.view(), start, 41, rows.data(), tstart));
  }
}

// The CPU float32 / bfloat16 / float16 paths against the float64 reference with the tolerances
// of include/kvbridge/adapter.h (1e-4, 2e-2, 4e-3 of each plane's largest magnitude); 601
// tokens convert in several blocks, each with its own per-set tables.
class LayeredConvertVsReference
    : public ::testing::TestWithParam<std::tuple<DType, int64_t, bool>> {};

TEST_P(LayeredConvertVsReference, StridedOddSizes) {
  const auto [dtype, T, aligned] = GetParam();
  const ModelSpec source = layered_source(dtype), target = layered_target(dtype);
  const LinearAdapter adapter = fit_layered(source, target);
  const int64_t start = 1001;
  HFKV src(source, T, 3, 7);
  fill_normal(src, source, T, 8);
  HFKV fast(target, T, 2, 1), ref(target, T, 0, 2);
  if (aligned) {
    std::vector<int64_t> rows(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) rows[static_cast<size_t>(t)] = (t * 5 + 3) % T;
    adapter.convert(src.view(), start, fast.view(), rows, 17);
    adapter.convert_reference(src.view(), start, ref.view(), rows, 17);
  } else {
    adapter.convert(src.view(), start, fast.view());
    adapter.convert_reference(src.view(), start, ref.view());
  }
  const double tol = dtype == DType::kFloat32 ? 1e-4 : dtype == DType::kBFloat16 ? 2e-2 : 4e-3;
  for (int64_t l = 0; l < target.num_layers; ++l)
    for (int k = 0; k < 2; ++k) {
      const Mat a = plane_rows(fast.view(), l, k), b = plane_rows(ref.view(), l, k);
      const double scale = b.cwiseAbs().maxCoeff();
      ASSERT_GT(scale, 0.0);
      EXPECT_LE((a - b).cwiseAbs().maxCoeff(), tol * scale) << "layer " << l << " kind " << k;
    }
}

INSTANTIATE_TEST_SUITE_P(DTypes, LayeredConvertVsReference,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16,
                                                              DType::kFloat16),
                                            ::testing::Values(int64_t{37}, int64_t{601}),
                                            ::testing::Bool()));

// A planted linear map in position-free space between two per-layer specs: source and target
// keys are rotated with each layer's own base, so only a fitter that un-rotates each layer with
// its own frequencies finds it.
struct LayeredPlanted {
  ModelSpec source = layered_source(), target = layered_target();
  std::vector<std::vector<int64_t>> planted{{0, 2}, {1, 3}, {2}};
  std::vector<std::array<Mat, 2>> w;  // [target layer][kind]: [|planted| * 2 sw, tw]
  std::vector<std::array<Eigen::RowVectorXd, 2>> b;

  LayeredPlanted() {
    std::mt19937 rng(42);
    std::normal_distribution<double> dist(0.0, 0.3);
    const int64_t sw = source.num_kv_heads * source.head_dim;
    const int64_t tw = target.num_kv_heads * target.head_dim;
    for (const auto& layers : planted) {
      std::array<Mat, 2> wj;
      std::array<Eigen::RowVectorXd, 2> bj;
      for (int k = 0; k < 2; ++k) {
        wj[k] = Mat::NullaryExpr(static_cast<int64_t>(layers.size()) * 2 * sw, tw,
                                 [&] { return dist(rng); });
        bj[k] = Eigen::RowVectorXd::NullaryExpr(tw, [&] { return dist(rng) + 1.0; });
      }
      w.push_back(wj);
      b.push_back(bj);
    }
  }

  // Position-free source rows, the planted target, then keys rotated per layer (own base).
  void sample(int64_t T, int64_t start, uint32_t seed, HFKV& src, HFKV& tgt) const {
    std::mt19937 rng(seed);
    std::normal_distribution<double> dist;
    const int64_t sh = source.num_kv_heads, sd = source.head_dim, sw = sh * sd;
    const int64_t th = target.num_kv_heads, td = target.head_dim, tw = th * td;
    std::vector<std::array<Mat, 2>> free(static_cast<size_t>(source.num_layers));
    for (auto& lk : free)
      for (auto& p : lk) p = Mat::NullaryExpr(T, sw, [&] { return dist(rng); });
    auto store = [](const Mat& m, const ModelSpec& spec, const KVPlane& plane) {
      const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> f =
          m.cast<float>();
      detail::store_plane(f.data(), f.cols(), spec.dtype, f.rows(), spec.num_kv_heads,
                          spec.head_dim, plane);
    };
    for (int64_t l = 0; l < source.num_layers; ++l) {
      const auto inv = inv_freq(source.layer_attention[static_cast<size_t>(l)], sd);
      Mat k = free[static_cast<size_t>(l)][0];
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < sh; ++h)
          rotate_head(k.row(t).data() + h * sd, sd, source.rope_style, inv,
                      static_cast<double>(start + t), 1);
      store(k, source, src.view().plane(l, KVView::kKey));
      store(free[static_cast<size_t>(l)][1], source, src.view().plane(l, KVView::kValue));
    }
    for (size_t j = 0; j < planted.size(); ++j) {
      Mat x(T, static_cast<int64_t>(planted[j].size()) * 2 * sw);
      for (size_t si = 0; si < planted[j].size(); ++si)
        for (int k = 0; k < 2; ++k)
          x.middleCols((static_cast<int64_t>(si) * 2 + k) * sw, sw) =
              free[static_cast<size_t>(planted[j][si])][k];
      const auto inv = inv_freq(target.layer_attention[j], td);
      for (int k = 0; k < 2; ++k) {
        Mat y = (x * w[j][k]).rowwise() + b[j][k];
        if (k == 0)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < th; ++h)
              rotate_head(y.row(t).data() + h * td, td, target.rope_style, inv,
                          static_cast<double>(start + t), 1);
        (void)tw;
        store(y, target, tgt.view().plane(static_cast<int64_t>(j), static_cast<KVView::Kind>(k)));
      }
    }
  }
};

TEST(LayerAttention, FitterRecoversPlantedMapWithPerLayerBases) {
  const LayeredPlanted pair;
  auto fit = [&](const ModelSpec& source, const ModelSpec& target) {
    FitOptions o;
    o.selection = FitOptions::Selection::kExplicit;
    o.source_layers = pair.planted;
    AdapterFitter fitter(source, target, o);
    for (int i = 0; i < 5; ++i) {
      HFKV src(pair.source, 97, 1, 10 + i), tgt(pair.target, 97, 2, 20 + i);
      pair.sample(97, 13 + 300 * i, 100 + i, src, tgt);
      fitter.add(src.view(), tgt.view(), 13 + 300 * i);
    }
    return fitter.fit();
  };
  const LinearAdapter adapter = fit(pair.source, pair.target);
  for (const LayerFit& lf : adapter.report().layers) {
    EXPECT_GT(lf.r2_key, 0.9999);
    EXPECT_GT(lf.r2_value, 0.9999);
  }
  // Fresh data at new positions: the convert reproduces the target's own cache.
  HFKV src(pair.source, 41, 3, 1), tgt(pair.target, 41, 0, 2), out(pair.target, 41, 1, 3);
  pair.sample(41, 4321, 999, src, tgt);
  adapter.convert(src.view(), 4321, out.view());
  for (int64_t j = 0; j < pair.target.num_layers; ++j)
    for (int k = 0; k < 2; ++k) {
      const Mat want = plane_rows(tgt.view(), j, k), got = plane_rows(out.view(), j, k);
      EXPECT_LT((got - want).norm(), 1e-3 * want.norm()) << "layer " << j << " kind " << k;
    }

  // The same data described without the entries (one base for every layer): the keys of the
  // target layers whose frequencies then differ cannot be fitted.
  ModelSpec flat_source = pair.source, flat_target = pair.target;
  flat_source.layer_attention.clear();
  flat_target.layer_attention.clear();
  const LinearAdapter wrong = fit(flat_source, flat_target);
  for (const LayerFit& lf : wrong.report().layers) EXPECT_LT(lf.r2_key, 0.9);
}

// Specs with entries round-trip through the adapter file (the JSON holds layer_attention);
// specs without them write no such key, so their files are what they were before it existed.
TEST(LayerAttention, AdapterFileRoundTrip) {
  const ModelSpec source = layered_source(), target = layered_target();
  const LinearAdapter adapter = fit_layered(source, target);
  testing::TempDir dir;
  const std::string path = dir.path + "/layered.safetensors";
  adapter.save(path);
  const LinearAdapter loaded = LinearAdapter::load(path);
  EXPECT_EQ(loaded.source(), source);
  EXPECT_EQ(loaded.target(), target);
  EXPECT_EQ(loaded.fingerprint(), adapter.fingerprint());
  const auto meta = io::read_safetensors(path).metadata;
  EXPECT_NE(meta.at("source_spec").find("\"layer_attention\""), std::string::npos);
  EXPECT_NE(meta.at("target_spec").find("\"sliding_window\":512"), std::string::npos);
  // The loaded adapter converts exactly as the saved one.
  HFKV src(source, 29, 1, 4);
  fill_normal(src, source, 29, 4);
  HFKV a(target, 29, 0, 5), b(target, 29, 0, 6);
  adapter.convert(src.view(), 3, a.view());
  loaded.convert(src.view(), 3, b.view());
  for (int64_t j = 0; j < target.num_layers; ++j)
    for (int k = 0; k < 2; ++k)
      EXPECT_EQ(plane_rows(a.view(), j, k), plane_rows(b.view(), j, k));

  ModelSpec flat_source = source, flat_target = target;
  flat_source.layer_attention.clear();
  flat_target.layer_attention.clear();
  const LinearAdapter flat = fit_layered(flat_source, flat_target);
  const std::string flat_path = dir.path + "/flat.safetensors";
  flat.save(flat_path);
  const auto flat_meta = io::read_safetensors(flat_path).metadata;
  EXPECT_EQ(flat_meta.at("source_spec").find("layer_attention"), std::string::npos);
  EXPECT_EQ(flat_meta.at("format_version"), "2");
  EXPECT_TRUE(LinearAdapter::load(flat_path).source().layer_attention.empty());
}

}  // namespace
}  // namespace kvbridge
