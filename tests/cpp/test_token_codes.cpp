// The target's token codes (FitOptions::target_token_codes): fit, convert against the float64
// reference, file round trip and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"
#include "src/core/dtype_convert.h"
#include "tests/cpp/test_util.h"

namespace kvbridge {
namespace {

using testing::HFKV;

ModelSpec spec_of(const char* name, int64_t layers, int64_t heads, int64_t dim, DType dtype) {
  ModelSpec s = testing::small_spec(dtype, layers, heads, dim);
  s.name = name;
  return s;
}

TokenCodes random_codes(int64_t vocab, int64_t dims, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  TokenCodes c;
  c.vocab = vocab;
  c.dims = dims;
  c.values.resize(static_cast<size_t>(vocab * dims));
  for (float& v : c.values) v = dist(rng);
  return c;
}

// A planted relation without RoPE (rope_aware off, so keys map as they are): every target plane
// is a fixed linear map of all source layers' features at the same token, plus a bias, plus
// fixed weights times the codes of the token and of the one before it (zeros before position 0).
// The fit recovers it (the codes' term and the source maps refitted together), closely but not
// exactly: the maps keep the ridge strengths chosen without the codes.
struct Planted {
  ModelSpec source = spec_of("src", 2, 2, 6, DType::kFloat32);
  ModelSpec target = spec_of("tgt", 3, 1, 8, DType::kFloat32);
  TokenCodes codes = random_codes(41, 3, 1);
  int64_t context = 2;
  std::vector<std::array<std::vector<double>, 2>> w, wz, b;  // [layer][kind]

  Planted() {
    std::mt19937 rng(2);
    std::normal_distribution<double> dist(0, 0.3);
    const int64_t F = source.num_layers * 2 * 12, O = 8, Dz = context * codes.dims;
    for (int64_t j = 0; j < target.num_layers; ++j) {
      std::array<std::vector<double>, 2> a, az, ab;
      for (int k = 0; k < 2; ++k) {
        a[k].resize(static_cast<size_t>(F * O));
        az[k].resize(static_cast<size_t>(Dz * O));
        ab[k].resize(static_cast<size_t>(O));
        for (double& v : a[k]) v = dist(rng);
        for (double& v : az[k]) v = 3 * dist(rng);
        for (double& v : ab[k]) v = dist(rng) + 1;
      }
      w.push_back(a);
      wz.push_back(az);
      b.push_back(ab);
    }
  }

  // Random source KV and ids for T tokens at start_pos (previous: the ids before them), and the
  // planted target KV.
  void sample(int64_t T, int64_t start_pos, uint32_t seed, std::vector<float>& src,
              std::vector<float>& tgt, std::vector<int64_t>& ids,
              std::vector<int64_t>& previous) const {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist;
    const int64_t sw = 12, tw = 8, d = codes.dims;
    src.resize(static_cast<size_t>(source.num_layers * 2 * T * sw));
    for (float& v : src) v = dist(rng);
    ids.resize(static_cast<size_t>(T));
    for (int64_t& id : ids) id = static_cast<int64_t>(rng() % static_cast<uint32_t>(codes.vocab));
    previous.clear();
    for (int64_t i = 0; i < std::min<int64_t>(start_pos, 3); ++i)
      previous.push_back(static_cast<int64_t>(rng() % static_cast<uint32_t>(codes.vocab)));
    tgt.assign(static_cast<size_t>(target.num_layers * 2 * T * tw), 0.f);
    for (int64_t j = 0; j < target.num_layers; ++j)
      for (int k = 0; k < 2; ++k)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t o = 0; o < tw; ++o) {
            double acc = b[j][k][o];
            for (int64_t l = 0; l < source.num_layers; ++l)
              for (int kk = 0; kk < 2; ++kk)
                for (int64_t f = 0; f < sw; ++f)
                  acc += src[((l * 2 + kk) * T + t) * sw + f] *
                         w[j][k][((l * 2 + kk) * sw + f) * tw + o];
            for (int64_t c = 0; c < context; ++c) {
              const int64_t i = t - c;
              if (start_pos + i < 0) continue;
              const int64_t id = i >= 0 ? ids[i] : previous[previous.size() + i];
              for (int64_t e = 0; e < d; ++e)
                acc += codes.values[id * d + e] * wz[j][k][(c * d + e) * tw + o];
            }
            tgt[((j * 2 + k) * T + t) * tw + o] = static_cast<float>(acc);
          }
  }

  KVView view(std::vector<float>& data, const ModelSpec& s, int64_t T) const {
    return KVView::contiguous(data.data(), DType::kFloat32, {}, s.num_layers, T, s.num_kv_heads,
                              s.head_dim);
  }

  FitOptions options() const {
    FitOptions o;
    o.selection = FitOptions::Selection::kAll;
    o.rope_aware = false;
    o.target_token_codes = codes;
    o.token_context = context;
    return o;
  }

  LinearAdapter fit(const FitOptions& o) const {
    AdapterFitter fitter(source, target, o);
    for (uint32_t s = 0; s < 4; ++s) {
      std::vector<float> src, tgt;
      std::vector<int64_t> ids, previous;
      const int64_t start = s == 0 ? 0 : 17 * s;
      sample(1000, start, 10 + s, src, tgt, ids, previous);
      fitter.add(view(src, source, 1000), view(tgt, target, 1000), start,
                 TargetTokens{TokenSpan(ids), previous});
    }
    return fitter.fit();
  }
};

TEST(TokenCodes, FitRecoversThePlantedTermAndConvertReproducesIt) {
  const Planted p;
  const LinearAdapter adapter = p.fit(p.options());
  ASSERT_TRUE(adapter.has_token_codes());
  EXPECT_EQ(adapter.token_context(), 2);
  EXPECT_EQ(adapter.token_codes().values, p.codes.values);
  const int64_t O = 8, Dz = 6;
  for (int64_t j = 0; j < p.target.num_layers; ++j) {
    const LayerFit& lf = adapter.report().layers[static_cast<size_t>(j)];
    EXPECT_GT(lf.r2_key, 0.999) << j;
    EXPECT_GT(lf.r2_value, 0.999) << j;
    EXPECT_TRUE(std::isfinite(lf.token_ridge_key) && std::isfinite(lf.token_ridge_value));
    for (int k = 0; k < 2; ++k) {
      const std::vector<float>& wz = adapter.token_weights(j, k);
      ASSERT_EQ(static_cast<int64_t>(wz.size()), Dz * O);
      for (size_t i = 0; i < wz.size(); ++i) EXPECT_NEAR(wz[i], p.wz[j][k][i], 5e-3) << j << k;
    }
  }
  // A fresh sample, starting inside a sequence: convert gives the planted target.
  std::vector<float> src, tgt, out(static_cast<size_t>(p.target.num_layers * 2 * 90 * O));
  std::vector<int64_t> ids, previous;
  p.sample(90, 40, 99, src, tgt, ids, previous);
  adapter.convert(p.view(src, p.source, 90), 40, p.view(out, p.target, 90),
                  TargetTokens{TokenSpan(ids), previous});
  double err = 0, norm = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    err += std::pow(static_cast<double>(out[i]) - tgt[i], 2);
    norm += std::pow(static_cast<double>(tgt[i]), 2);
  }
  EXPECT_LT(std::sqrt(err / norm), 3e-2);

  // Without the codes the same data fits far worse: the term is what the fit found.
  FitOptions plain = p.options();
  plain.target_token_codes = TokenCodes();
  const LinearAdapter without = p.fit(plain);
  EXPECT_FALSE(without.has_token_codes());
  EXPECT_TRUE(without.token_weights(0, 0).empty());
  EXPECT_TRUE(std::isnan(without.report().layers[0].token_ridge_key));
  EXPECT_LT(without.report().layers[0].r2_key, adapter.report().layers[0].r2_key - 0.1);
}

// Wide codes whose planted terms all lie in a 2-dimensional subspace of code space, the same
// for every map and context slot: compressed to 2 dimensions they lose nothing, to 1 they do.
TEST(TokenCodes, CompressionKeepsTheDirectionsTheTermsUse) {
  Planted p;
  p.codes = random_codes(41, 12, 4);
  std::mt19937 rng(5);
  std::normal_distribution<double> dist;
  std::vector<double> q(12 * 2);
  for (double& v : q) v = dist(rng);
  const int64_t O = 8;
  for (auto& maps : p.wz)
    for (auto& wz : maps) {
      wz.assign(static_cast<size_t>(2 * 12 * O), 0.0);
      for (int64_t c = 0; c < 2; ++c)
        for (int64_t a = 0; a < 2; ++a) {
          std::vector<double> v(static_cast<size_t>(O));
          for (double& x : v) x = dist(rng);
          for (int64_t e = 0; e < 12; ++e)
            for (int64_t o = 0; o < O; ++o)
              wz[static_cast<size_t>((c * 12 + e) * O + o)] += q[e * 2 + a] * v[o];
        }
    }
  FitOptions o = p.options();
  o.token_code_dims = 2;
  const LinearAdapter two = p.fit(o);
  ASSERT_EQ(two.token_codes().dims, 2);
  ASSERT_EQ(two.token_codes().vocab, 41);
  EXPECT_EQ(two.token_weights(1, 0).size(), static_cast<size_t>(2 * 2 * O));
  o.token_code_dims = 1;
  const LinearAdapter one = p.fit(o);
  ASSERT_EQ(one.token_codes().dims, 1);
  o.token_code_dims = 0;
  const LinearAdapter full = p.fit(o);
  ASSERT_EQ(full.token_codes().dims, 12);
  for (int64_t j = 0; j < p.target.num_layers; ++j) {
    const LayerFit &a = two.report().layers[static_cast<size_t>(j)],
                   &b = full.report().layers[static_cast<size_t>(j)],
                   &c = one.report().layers[static_cast<size_t>(j)];
    EXPECT_GT(a.r2_key, 0.99) << j;
    EXPECT_NEAR(a.r2_key, b.r2_key, 1e-3) << j;
    EXPECT_NEAR(a.r2_value, b.r2_value, 1e-3) << j;
    EXPECT_LT(c.r2_key, a.r2_key - 0.01) << j;
  }
  // Converting with the compressed codes gives what the full ones give.
  std::vector<float> src, tgt, x(static_cast<size_t>(p.target.num_layers * 2 * 60 * O)), y(x.size());
  std::vector<int64_t> ids, previous;
  p.sample(60, 0, 77, src, tgt, ids, previous);
  two.convert(p.view(src, p.source, 60), 0, p.view(x, p.target, 60), TargetTokens{TokenSpan(ids), {}});
  full.convert(p.view(src, p.source, 60), 0, p.view(y, p.target, 60), TargetTokens{TokenSpan(ids), {}});
  double err = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += std::pow(static_cast<double>(x[i]) - y[i], 2);
    norm += std::pow(static_cast<double>(y[i]), 2);
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-2);
}

// Data where the codes explain part of random targets, in a dtype (the fast path's tolerance
// against the float64 reference depends on it).
LinearAdapter fit_on_codes(const ModelSpec& source, const ModelSpec& target,
                           const TokenCodes& codes, int64_t context) {
  FitOptions o;
  o.selection = FitOptions::Selection::kExplicit;
  o.source_layers = {{0}, {0, 2}, {1, 2}};
  o.target_token_codes = codes;
  o.token_context = context;
  AdapterFitter fitter(source, target, o);
  const int64_t T = 223, tw = target.num_kv_heads * target.head_dim;
  HFKV fs(source, T, 1, 5), ft(target, T, 3, 6);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::vector<int64_t> ids(static_cast<size_t>(T));
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % static_cast<uint32_t>(codes.vocab));
  std::vector<float> plane(static_cast<size_t>(T * tw));
  for (int64_t l = 0; l < source.num_layers; ++l)
    for (int k = 0; k < 2; ++k) {
      std::vector<float> sp(static_cast<size_t>(T * source.num_kv_heads * source.head_dim));
      for (float& v : sp) v = dist(rng);
      detail::store_plane(sp.data(), source.num_kv_heads * source.head_dim, source.dtype, T,
                          source.num_kv_heads, source.head_dim,
                          fs.view().plane(l, static_cast<KVView::Kind>(k)));
    }
  for (int64_t l = 0; l < target.num_layers; ++l)
    for (int k = 0; k < 2; ++k) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t o = 0; o < tw; ++o)
          plane[t * tw + o] = 0.3f * dist(rng) +
                              codes.values[ids[t] * codes.dims + o % codes.dims] * (1 + l + k);
      detail::store_plane(plane.data(), tw, target.dtype, T, target.num_kv_heads,
                          target.head_dim, ft.view().plane(l, static_cast<KVView::Kind>(k)));
    }
  fitter.add(fs.view(), ft.view(), 0, TargetTokens{TokenSpan(ids), {}});
  return fitter.fit();
}

// The fast path against the float64 reference, with RoPE, strided, in several blocks, aligned
// and not, starting inside a sequence; the file keeps the codes (and the conversion).
class TokenCodesVsReference : public ::testing::TestWithParam<DType> {};

TEST_P(TokenCodesVsReference, StridedOddSizesAlignedAndFile) {
  const DType dtype = GetParam();
  const ModelSpec source = spec_of("src", 3, 3, 10, dtype);
  const ModelSpec target = spec_of("tgt", 3, 3, 14, dtype);
  const TokenCodes codes = random_codes(29, 5, 3);
  const LinearAdapter adapter = fit_on_codes(source, target, codes, 3);
  ASSERT_TRUE(adapter.has_token_codes());
  for (int64_t j = 0; j < target.num_layers; ++j)
    for (int k = 0; k < 2; ++k) ASSERT_FALSE(adapter.token_weights(j, k).empty()) << j << k;

  const double tol = dtype == DType::kFloat32 ? 1e-4 : 2e-2;
  const int64_t S = 450, T = 601, start = 1001;
  HFKV src(source, S, 3, 7);
  {
    std::mt19937 rng(8);
    std::normal_distribution<float> dist;
    std::vector<float> sp(static_cast<size_t>(S * source.num_kv_heads * source.head_dim));
    for (int64_t l = 0; l < source.num_layers; ++l)
      for (int k = 0; k < 2; ++k) {
        for (float& v : sp) v = dist(rng);
        detail::store_plane(sp.data(), source.num_kv_heads * source.head_dim, dtype, S,
                            source.num_kv_heads, source.head_dim,
                            src.view().plane(l, static_cast<KVView::Kind>(k)));
      }
  }
  std::mt19937 rng(9);
  std::vector<int64_t> alignment(static_cast<size_t>(T)), ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    alignment[static_cast<size_t>(t)] = std::min<int64_t>(S - 1, t * S / T + (rng() % 3));
    ids[static_cast<size_t>(t)] = static_cast<int64_t>(rng() % 29);
  }
  const TargetTokens tokens{TokenSpan(ids), {4, 28}};
  HFKV fast(target, T, 2, 1), ref(target, T, 0, 2);
  adapter.convert(src.view(), start, fast.view(), alignment, start + 3, tokens);
  adapter.convert_reference(src.view(), start, ref.view(), alignment, start + 3, tokens);
  const int64_t tw = target.num_kv_heads * target.head_dim;
  std::vector<float> a(static_cast<size_t>(T * tw)), b(a.size());
  for (int64_t l = 0; l < target.num_layers; ++l)
    for (int k = 0; k < 2; ++k) {
      const auto kind = static_cast<KVView::Kind>(k);
      detail::load_plane(fast.view().plane(l, kind), dtype, T, 3, 14, a.data(), tw);
      detail::load_plane(ref.view().plane(l, kind), dtype, T, 3, 14, b.data(), tw);
      double scale = 0;
      for (float v : b) scale = std::max(scale, static_cast<double>(std::fabs(v)));
      ASSERT_GT(scale, 0.0);
      for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], tol * scale) << l << k << i;
    }

  // Unaligned: the previous ids matter (a different one changes the first token only).
  HFKV plain(target, S, 1, 3), other(target, S, 1, 3);
  const TargetTokens own{TokenSpan(ids.data(), static_cast<size_t>(S)), {4, 28}};
  const TargetTokens changed{TokenSpan(ids.data(), static_cast<size_t>(S)), {4, 27}};
  adapter.convert(src.view(), start, plain.view(), own);
  adapter.convert(src.view(), start, other.view(), changed);
  EXPECT_FALSE(testing::same_elements(plain.view().slice_tokens(0, 1),
                                      other.view().slice_tokens(0, 1)));
  EXPECT_TRUE(testing::same_elements(plain.view().slice_tokens(2, S - 2),
                                     other.view().slice_tokens(2, S - 2)));

  testing::TempDir dir;
  const std::string path = dir.path + "/a.safetensors";
  adapter.save(path);
  const LinearAdapter loaded = LinearAdapter::load(path);
  ASSERT_TRUE(loaded.has_token_codes());
  EXPECT_EQ(loaded.token_context(), 3);
  EXPECT_EQ(loaded.token_codes().values, codes.values);
  EXPECT_EQ(loaded.fingerprint(), adapter.fingerprint());
  EXPECT_EQ(loaded.report().layers[1].token_ridge_value,
            adapter.report().layers[1].token_ridge_value);
  HFKV again(target, T, 2, 1);
  loaded.convert(src.view(), start, again.view(), alignment, start + 3, tokens);
  EXPECT_TRUE(testing::same_elements(again.view(), fast.view()));
}

INSTANTIATE_TEST_SUITE_P(DTypes, TokenCodesVsReference,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16));

TEST(TokenCodes, BadInput) {
  const Planted p;
  FitOptions o = p.options();
  o.target_token_codes.values.pop_back();
  EXPECT_THROW((void)AdapterFitter(p.source, p.target, o), InvalidArgument);  // not vocab * dims
  o = p.options();
  o.target_token_codes.values[5] = std::numeric_limits<float>::infinity();
  EXPECT_THROW((void)AdapterFitter(p.source, p.target, o), InvalidArgument);
  for (int64_t context : {0, 9}) {
    o = p.options();
    o.token_context = context;
    EXPECT_THROW((void)AdapterFitter(p.source, p.target, o), InvalidArgument) << context;
  }

  AdapterFitter fitter(p.source, p.target, p.options());
  std::vector<float> src, tgt;
  std::vector<int64_t> ids, previous;
  p.sample(20, 5, 3, src, tgt, ids, previous);
  const KVView s = p.view(src, p.source, 20), t = p.view(tgt, p.target, 20);
  EXPECT_THROW(fitter.add(s, t, 5), InvalidArgument);  // no ids
  std::vector<int64_t> short_ids(ids.begin(), ids.end() - 1);
  EXPECT_THROW(fitter.add(s, t, 5, TargetTokens{TokenSpan(short_ids), previous}),
               InvalidArgument);
  std::vector<int64_t> bad = ids;
  bad[7] = p.codes.vocab;
  EXPECT_THROW(fitter.add(s, t, 5, TargetTokens{TokenSpan(bad), previous}), InvalidArgument);
  EXPECT_THROW(fitter.add(s, t, 5, TargetTokens{TokenSpan(ids), {}}), InvalidArgument);
  EXPECT_EQ(fitter.train_tokens() + fitter.holdout_tokens(), 0);
  EXPECT_NO_THROW(fitter.add(s, t, 5, TargetTokens{TokenSpan(ids), previous}));

  const LinearAdapter adapter = p.fit(p.options());
  std::vector<float> out(tgt.size());
  const KVView d = p.view(out, p.target, 20);
  EXPECT_THROW(adapter.convert(s, 5, d), InvalidArgument);  // the ids are needed
  EXPECT_THROW(adapter.convert(s, 5, d, TargetTokens{TokenSpan(bad), previous}), InvalidArgument);
  EXPECT_THROW(adapter.convert(s, 5, d, TargetTokens{TokenSpan(ids), {}}), InvalidArgument);
  EXPECT_NO_THROW(adapter.convert(s, 0, d, TargetTokens{TokenSpan(ids), {}}));  // at position 0

  // Only the CPU path adds the codes' term: CUDA views are refused whatever the build or device.
  const Device cuda{DeviceType::kCUDA, 0};
  auto fake = [&](const ModelSpec& m, uintptr_t base) {
    return KVView::contiguous(reinterpret_cast<void*>(base), m.dtype, cuda, m.num_layers, 20,
                              m.num_kv_heads, m.head_dim);
  };
  try {
    adapter.convert(fake(p.source, 0x1000), 5, fake(p.target, 0x100000),
                    TargetTokens{TokenSpan(ids), previous});
    ADD_FAILURE() << "no exception";
  } catch (const Unavailable& e) {
    EXPECT_NE(std::string(e.what()).find("token codes"), std::string::npos) << e.what();
  }
  EXPECT_THROW(adapter.token_weights(3, 0), InvalidArgument);
}

}  // namespace
}  // namespace kvbridge
