// Bridge: native vs converted loads, write-back, quality gate, tokenizer and namespace isolation,
// the last-token rule, validation and stats. Adapters are fitted on planted linear maps through
// RoPE; the KV the bridge converts is fresh seeded random data.
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "src/adapter/numeric.h"
#include "src/io/safetensors.h"
#include "test_util.h"

namespace kvbridge {
namespace {

ModelSpec spec_of(const char* name, int64_t layers, int64_t heads, int64_t dim, double base,
                  const char* tokenizer = "tok") {
  ModelSpec s = testing::small_spec(DType::kFloat32, layers, heads, dim);
  s.name = name;
  s.rope_base = base;
  s.tokenizer = tokenizer;
  return s;
}

// float32 KV of one sequence. Stored as Hugging Face per-layer tensors [1, heads, tokens, dim]
// with `pad` spare elements after each row, so views of it are strided.
struct FloatKV {
  ModelSpec spec;
  int64_t tokens, pad;
  std::vector<std::vector<float>> planes;  // 2 per layer, K then V
  FloatKV(const ModelSpec& s, int64_t t, int64_t p = 0) : spec(s), tokens(t), pad(p) {
    planes.assign(static_cast<size_t>(2 * s.num_layers),
                  std::vector<float>(static_cast<size_t>(s.num_kv_heads * t * (s.head_dim + p))));
  }
  float& at(int64_t layer, int kind, int64_t t, int64_t h, int64_t d) {
    return planes[static_cast<size_t>(2 * layer + kind)]
                 [static_cast<size_t>((h * tokens + t) * (spec.head_dim + pad) + d)];
  }
  void randomize(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (auto& p : planes)
      for (auto& v : p) v = dist(rng);
  }
  KVView view() {
    std::vector<TensorView> keys, values;
    const int64_t row = spec.head_dim + pad;
    for (size_t i = 0; i < planes.size(); ++i) {
      TensorView t;
      t.data = planes[i].data();
      t.shape = {1, spec.num_kv_heads, tokens, spec.head_dim};
      t.strides = {spec.num_kv_heads * tokens * row, tokens * row, row, 1};
      (i % 2 == 0 ? keys : values).push_back(t);
    }
    return KVView::from_hf_layers(keys, values);
  }
};

// Reads `view` (float32) into a dense [layers, 2, tokens, heads, dim] vector.
std::vector<float> dense(const KVView& view) {
  std::vector<float> out(static_cast<size_t>(2 * view.num_layers() * view.tokens() *
                                             view.kv_heads() * view.head_dim()));
  copy_kv(view, KVView::contiguous(out.data(), DType::kFloat32, {}, view.num_layers(),
                                   view.tokens(), view.kv_heads(), view.head_dim()));
  return out;
}

std::vector<float> load_kv(const Load& load, const ModelSpec& spec) {
  std::vector<float> out(static_cast<size_t>(2 * spec.num_layers * load.tokens() *
                                             spec.num_kv_heads * spec.head_dim));
  load.copy_to(KVView::contiguous(out.data(), DType::kFloat32, {}, spec.num_layers,
                                  load.tokens(), spec.num_kv_heads, spec.head_dim));
  return out;
}

// The target's KV for `src_view` converted by `adapter` at start_pos (float32 or float64 path).
std::vector<float> converted(const LinearAdapter& adapter, const KVView& src_view,
                             int64_t start_pos, bool reference) {
  const ModelSpec& t = adapter.target();
  std::vector<float> out(static_cast<size_t>(2 * t.num_layers * src_view.tokens() *
                                             t.num_kv_heads * t.head_dim));
  const KVView dst = KVView::contiguous(out.data(), DType::kFloat32, {}, t.num_layers,
                                        src_view.tokens(), t.num_kv_heads, t.head_dim);
  if (reference) {
    adapter.convert_reference(src_view, start_pos, dst);
  } else {
    adapter.convert(src_view, start_pos, dst);
  }
  return out;
}

// Tokens [begin, begin + count) of a dense [layers, 2, tokens, heads, dim] vector.
std::vector<float> token_range(const std::vector<float>& kv, const ModelSpec& s, int64_t tokens,
                               int64_t begin, int64_t count) {
  const int64_t row = s.num_kv_heads * s.head_dim;
  std::vector<float> out;
  for (int64_t p = 0; p < 2 * s.num_layers; ++p)
    out.insert(out.end(), kv.begin() + (p * tokens + begin) * row,
               kv.begin() + (p * tokens + begin + count) * row);
  return out;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return worst / std::max(scale, 1e-30);
}

// Fits source -> target on planted affine maps (every source layer feeds every target layer),
// keys rotated with each model's RoPE. noise: the target is independent noise instead (R² ~ 0).
std::shared_ptr<const LinearAdapter> fit_planted(const ModelSpec& source, const ModelSpec& target,
                                                 uint64_t seed, bool noise = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  const int64_t sw = source.num_kv_heads * source.head_dim;
  const int64_t tw = target.num_kv_heads * target.head_dim;
  const int64_t features = 2 * source.num_layers * sw;
  std::vector<float> w(static_cast<size_t>(2 * target.num_layers * features * tw));
  for (auto& v : w) v = 0.3f * dist(rng);
  FitOptions options;
  options.selection = FitOptions::Selection::kAll;
  AdapterFitter fitter(source, target, options);
  const auto src_inv = detail::rope_inv_freq(source, 0);
  const auto tgt_inv = detail::rope_inv_freq(target, 0);
  for (int sample = 0; sample < 4; ++sample) {
    const int64_t T = 101, start = 11 + 300 * sample;
    FloatKV src(source, T), tgt(target, T);
    std::vector<float> x(static_cast<size_t>(T * features));  // position-free source features
    for (auto& v : x) v = dist(rng);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t l = 0; l < source.num_layers; ++l)
        for (int k = 0; k < 2; ++k)
          for (int64_t f = 0; f < sw; ++f)
            src.at(l, k, t, f / source.head_dim, f % source.head_dim) =
                x[static_cast<size_t>(t * features + (2 * l + k) * sw + f)];
      for (int64_t j = 0; j < target.num_layers; ++j)
        for (int k = 0; k < 2; ++k)
          for (int64_t o = 0; o < tw; ++o) {
            double acc = 0.5;
            if (noise) {
              acc = dist(rng);
            } else {
              const float* wj = &w[static_cast<size_t>((2 * j + k) * features * tw)];
              for (int64_t f = 0; f < features; ++f)
                acc += static_cast<double>(x[static_cast<size_t>(t * features + f)]) *
                       wj[f * tw + o];
            }
            tgt.at(j, k, t, o / target.head_dim, o % target.head_dim) = static_cast<float>(acc);
          }
    }
    // Planes are [heads, tokens, dim]: rotate each head's [tokens, dim] block.
    for (int64_t l = 0; l < source.num_layers; ++l)
      for (int64_t h = 0; h < source.num_kv_heads; ++h)
        detail::apply_rope(source, src_inv, start, false, T, 1, &src.at(l, 0, 0, h, 0),
                           source.head_dim);
    for (int64_t j = 0; j < target.num_layers; ++j)
      for (int64_t h = 0; h < target.num_kv_heads; ++h)
        detail::apply_rope(target, tgt_inv, start, false, T, 1, &tgt.at(j, 0, 0, h, 0),
                           target.head_dim);
    fitter.add(src.view(), tgt.view(), start);
  }
  return std::make_shared<const LinearAdapter>(fitter.fit());
}

class BridgeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    src_ = new ModelSpec(spec_of("src", 3, 2, 8, 10000.0));
    src2_ = new ModelSpec(spec_of("src2", 2, 1, 4, 20000.0));
    tgt_ = new ModelSpec(spec_of("tgt", 2, 3, 6, 50000.0));
    good_ = new std::shared_ptr<const LinearAdapter>(fit_planted(*src_, *tgt_, 1));
    good2_ = new std::shared_ptr<const LinearAdapter>(fit_planted(*src2_, *tgt_, 2));
    bad_ = new std::shared_ptr<const LinearAdapter>(fit_planted(*src_, *tgt_, 3, true));
  }
  static void TearDownTestSuite() {
    delete src_;
    delete src2_;
    delete tgt_;
    delete good_;
    delete good2_;
    delete bad_;
  }

  StoreOptions store_options() const {
    StoreOptions o;
    o.capacity_bytes = 64 << 20;
    o.chunk_tokens = 16;
    o.num_shards = 4;
    return o;
  }

  // Saves src (randomized) as the source's cache of `tokens` and tgt's first 20 tokens
  // (randomized) as the target's own, of which the store keeps 16 (whole chunks): the setup of a
  // converted load that extends a native prefix.
  void save_source_and_native_head(Bridge& bridge, const std::vector<int64_t>& tokens,
                                   FloatKV& src, FloatKV& tgt) const {
    src.randomize(14);
    tgt.randomize(15);
    bridge.save(*src_, tokens, src.view());
    const std::vector<int64_t> head(tokens.begin(), tokens.begin() + 20);
    bridge.save(*tgt_, head, tgt.view().slice_tokens(0, 20));
  }

  static ModelSpec *src_, *src2_, *tgt_;
  static std::shared_ptr<const LinearAdapter> *good_, *good2_, *bad_;
};
ModelSpec *BridgeTest::src_, *BridgeTest::src2_, *BridgeTest::tgt_;
std::shared_ptr<const LinearAdapter> *BridgeTest::good_, *BridgeTest::good2_, *BridgeTest::bad_;

// Planted data must give a near-perfect and a useless adapter, or the gate tests mean nothing.
TEST_F(BridgeTest, FittedAdaptersHaveExpectedQuality) {
  EXPECT_GT(Bridge::quality(**good_), 0.999);
  EXPECT_GT(Bridge::quality(**good2_), 0.999);
  EXPECT_LT(Bridge::quality(**bad_), 0.2);
  double lowest = 1;
  for (const LayerFit& l : (*good_)->report().layers)
    lowest = std::min({lowest, l.r2_key, l.r2_value});
  EXPECT_EQ(Bridge::quality(**good_), lowest);
}

TEST_F(BridgeTest, ConvertedEqualsAdapterConvertAndWritesBack) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(53, 7);
  FloatKV src(*src_, 53, 3);
  src.randomize(11);
  EXPECT_EQ(bridge.save(*src_, tokens, src.view()), 48);

  const Load first = bridge.load(*tgt_, tokens);
  ASSERT_TRUE(first);
  EXPECT_TRUE(first.converted());
  EXPECT_EQ(first.tokens(), 48);
  EXPECT_EQ(first.native_tokens(), 0);
  EXPECT_EQ(first.source(), "src");
  EXPECT_EQ(first.quality(), Bridge::quality(**good_));
  const std::vector<float> got = load_kv(first, *tgt_);
  const KVView src48 = src.view().slice_tokens(0, 48);
  // The bridge runs the same float32 convert on the same stored bytes: identical results.
  EXPECT_EQ(got, converted(**good_, src48, 0, false));
  // Against the float64 reference: float32 arithmetic over 96 features, unit-scale data.
  EXPECT_LT(max_rel_diff(got, converted(**good_, src48, 0, true)), 1e-5);

  const Load second = bridge.load(*tgt_, tokens);
  EXPECT_FALSE(second.converted());
  EXPECT_EQ(second.tokens(), 48);
  EXPECT_EQ(second.native_tokens(), 48);
  EXPECT_EQ(second.source(), "tgt");
  EXPECT_TRUE(std::isnan(second.quality()));
  EXPECT_EQ(load_kv(second, *tgt_), got);

  const BridgeStats s = bridge.stats();
  EXPECT_EQ(s.saves, 1);
  EXPECT_EQ(s.loads, 2);
  EXPECT_EQ(s.converted_hits, 1);
  EXPECT_EQ(s.native_hits, 1);
  EXPECT_EQ(s.misses, 0);
  EXPECT_EQ(s.conversions, 1);
  EXPECT_EQ(s.converted_tokens, 48);
  EXPECT_EQ(s.native_tokens, 48);
  EXPECT_EQ(s.written_back_tokens, 48);
  EXPECT_GT(s.convert_seconds, 0);
  EXPECT_GT(s.lookup_seconds, 0);
}

// A probe reports what the load after it serves, field by field.
void expect_probe_matches(const Load& probe, const Load& load) {
  EXPECT_EQ(probe.tokens(), load.tokens());
  EXPECT_EQ(probe.native_tokens(), load.native_tokens());
  EXPECT_EQ(probe.converted(), load.converted());
  EXPECT_EQ(probe.source(), load.source());
  EXPECT_TRUE(probe.quality() == load.quality() ||
              (std::isnan(probe.quality()) && std::isnan(load.quality())));
  EXPECT_EQ(probe.converted_from(), load.converted_from());
  EXPECT_EQ(probe.adapter(), load.adapter());
  EXPECT_EQ(probe.recompute_tail(), load.recompute_tail());
}

// probe() finds what load() would serve without converting, copying or writing anything; each
// probe here is followed by the load it describes.
TEST_F(BridgeTest, ProbeReportsTheLoadWithoutConverting) {
  KVStore store(store_options());
  BridgeOptions options;
  options.recompute_tail = 5;
  Bridge bridge(store, options);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(53, 19);
  FloatKV src(*src_, 53, 2);
  src.randomize(23);
  bridge.save(*src_, tokens, src.view());

  const Load planned = bridge.probe(*tgt_, tokens);
  EXPECT_TRUE(planned.converted());
  EXPECT_EQ(planned.tokens(), 47);  // 53 - 1 - the tail of 5
  EXPECT_EQ(planned.recompute_tail(), 5);
  std::vector<float> room(static_cast<size_t>(2 * tgt_->num_layers * 47 * tgt_->num_kv_heads *
                                              tgt_->head_dim));
  EXPECT_THROW(planned.copy_to(KVView::contiguous(room.data(), DType::kFloat32, {},
                                                  tgt_->num_layers, 47, tgt_->num_kv_heads,
                                                  tgt_->head_dim)),
               InvalidArgument);
  BridgeStats st = bridge.stats();
  EXPECT_EQ(st.probes, 1);
  EXPECT_EQ(st.loads, 0);
  EXPECT_EQ(st.conversions, 0);
  EXPECT_EQ(st.converted_hits + st.native_hits + st.misses, 0);
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 0);  // nothing written back

  expect_probe_matches(planned, bridge.load(*tgt_, tokens));
  // The write-back kept 32 tokens (whole chunks): those are native now, the rest converted again.
  const Load planned_again = bridge.probe(*tgt_, tokens);
  EXPECT_EQ(planned_again.native_tokens(), 32);
  expect_probe_matches(planned_again, bridge.load(*tgt_, tokens));
  // A prompt nothing was saved for, and a one-token prompt: misses, as loads.
  const auto other = testing::random_tokens(20, 77);
  const Load planned_miss = bridge.probe(*tgt_, other);
  EXPECT_EQ(planned_miss.tokens(), 0);
  expect_probe_matches(planned_miss, bridge.load(*tgt_, other));
  const std::vector<int64_t> one{tokens[0]};
  EXPECT_EQ(bridge.probe(*tgt_, one).tokens(), 0);
  st = bridge.stats();
  EXPECT_EQ(st.probes, 4);
  EXPECT_EQ(st.loads, 3);
  EXPECT_EQ(st.conversions, 2);
  // Bad input is refused as load() refuses it.
  const std::vector<int64_t> bad{1, -2, 3};
  EXPECT_THROW(bridge.probe(*tgt_, bad), InvalidArgument);

  // Without a tail the whole conversion is written back: then a native hit naming the adapter.
  KVStore store2(store_options());
  Bridge bridge2(store2);
  bridge2.add_adapter(*good_);
  bridge2.save(*src_, tokens, src.view());
  const Load planned2 = bridge2.probe(*tgt_, tokens);  // (arguments' order is unspecified)
  expect_probe_matches(planned2, bridge2.load(*tgt_, tokens));
  const Load planned_native = bridge2.probe(*tgt_, tokens);
  EXPECT_FALSE(planned_native.converted());
  EXPECT_EQ(planned_native.native_tokens(), 48);
  EXPECT_EQ(planned_native.adapter(), (*good_)->fingerprint());
  expect_probe_matches(planned_native, bridge2.load(*tgt_, tokens));
}

TEST_F(BridgeTest, WithoutWriteBackEveryLoadConverts) {
  KVStore store(store_options());
  BridgeOptions options;
  options.write_back = false;
  Bridge bridge(store, options);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(35, 18);
  FloatKV src(*src_, 35);
  src.randomize(28);
  bridge.save(*src_, tokens, src.view());
  EXPECT_TRUE(bridge.load(*tgt_, tokens).converted());
  EXPECT_TRUE(bridge.load(*tgt_, tokens).converted());
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 0);
  EXPECT_EQ(bridge.stats().conversions, 2);
  EXPECT_EQ(bridge.stats().written_back_tokens, 0);
}

TEST_F(BridgeTest, NativeWinsOverEqualConvertedPrefix) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(40, 8);
  FloatKV src(*src_, 40), tgt(*tgt_, 40, 1);
  src.randomize(12);
  tgt.randomize(13);
  bridge.save(*src_, tokens, src.view());
  bridge.save(*tgt_, tokens, tgt.view());
  const Load load = bridge.load(*tgt_, tokens);
  EXPECT_FALSE(load.converted());
  EXPECT_EQ(load.tokens(), 32);
  EXPECT_EQ(load_kv(load, *tgt_), dense(tgt.view().slice_tokens(0, 32)));
  EXPECT_EQ(bridge.stats().conversions, 0);
}

// A longer convertible prefix beats a shorter native one; only the missing suffix is converted
// (at its absolute positions), and that equals converting everything and keeping the tail.
TEST_F(BridgeTest, LongerConvertedPrefixExtendsNativeOne) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(61, 9);
  FloatKV src(*src_, 61, 2), tgt(*tgt_, 61);
  save_source_and_native_head(bridge, tokens, src, tgt);

  const Load load = bridge.load(*tgt_, tokens);
  ASSERT_TRUE(load.converted());
  EXPECT_EQ(load.tokens(), 48);
  EXPECT_EQ(load.native_tokens(), 16);
  const std::vector<float> got = load_kv(load, *tgt_);
  EXPECT_EQ(token_range(got, *tgt_, 48, 0, 16), dense(tgt.view().slice_tokens(0, 16)));
  const std::vector<float> tail = token_range(got, *tgt_, 48, 16, 32);
  EXPECT_EQ(tail, converted(**good_, src.view().slice_tokens(16, 32), 16, false));
  const std::vector<float> whole = converted(**good_, src.view().slice_tokens(0, 48), 0, true);
  EXPECT_LT(max_rel_diff(tail, token_range(whole, *tgt_, 48, 16, 32)), 1e-5);
  EXPECT_EQ(bridge.stats().converted_tokens, 32);
  EXPECT_EQ(bridge.stats().written_back_tokens, 32);
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 48);
}

// An adapter that takes the target's token codes: the Bridge hands it the ids of the tokens it
// converts and of the ones before them (the native prefix's last), so a load extending a native
// prefix equals the adapter's own convert of that range with those ids.
TEST_F(BridgeTest, TokenCodesGetTheTargetsIds) {
  const auto tokens = testing::random_tokens(61, 19, 500);
  FitOptions options;
  options.selection = FitOptions::Selection::kAll;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist;
  options.target_token_codes.vocab = 500;
  options.target_token_codes.dims = 4;
  for (int i = 0; i < 2000; ++i) options.target_token_codes.values.push_back(dist(rng));
  AdapterFitter fitter(*src_, *tgt_, options);
  for (int i = 0; i < 4; ++i) {
    FloatKV a(*src_, 61), b(*tgt_, 61);
    a.randomize(60 + i);
    b.randomize(70 + i);
    // Targets that depend on the ids, so the codes' term is fitted (and used below).
    const std::vector<float>& codes = options.target_token_codes.values;
    for (int64_t j = 0; j < 2; ++j)
      for (int k = 0; k < 2; ++k)
        for (int64_t t = 0; t < 61; ++t)
          for (int64_t o = 0; o < 18; ++o)
            b.at(j, k, t, o / 6, o % 6) += 3 * codes[static_cast<size_t>(tokens[t] * 4 + o % 4)];
    fitter.add(a.view(), b.view(), 0, TargetTokens{TokenSpan(tokens), {}});
  }
  auto adapter = std::make_shared<const LinearAdapter>(fitter.fit());
  ASSERT_TRUE(adapter->has_token_codes());
  for (int64_t j = 0; j < 2; ++j) ASSERT_FALSE(adapter->token_weights(j, 1).empty()) << j;

  KVStore store(store_options());
  BridgeOptions bo;
  bo.min_quality = -std::numeric_limits<double>::infinity();
  Bridge bridge(store, bo);
  bridge.add_adapter(adapter);
  FloatKV src(*src_, 61, 2), tgt(*tgt_, 61);
  save_source_and_native_head(bridge, tokens, src, tgt);
  const Load load = bridge.load(*tgt_, tokens);
  ASSERT_TRUE(load.converted());
  EXPECT_EQ(load.native_tokens(), 16);
  ASSERT_EQ(load.tokens(), 48);
  std::vector<float> want(static_cast<size_t>(2 * 2 * 32 * 18));
  const std::vector<int64_t> ids(tokens.begin() + 16, tokens.begin() + 48);
  adapter->convert(src.view().slice_tokens(16, 32), 16,
                   KVView::contiguous(want.data(), DType::kFloat32, {}, 2, 32, 3, 6),
                   TargetTokens{TokenSpan(ids), {tokens[15]}});
  EXPECT_EQ(token_range(load_kv(load, *tgt_), *tgt_, 48, 16, 32), want);
}

TEST_F(BridgeTest, LongestSourceWinsAmongAdapters) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  bridge.add_adapter(*good2_);
  const auto tokens = testing::random_tokens(70, 10);
  FloatKV a(*src_, 40), b(*src2_, 70);
  a.randomize(16);
  b.randomize(17);
  const std::vector<int64_t> first40(tokens.begin(), tokens.begin() + 40);
  bridge.save(*src_, first40, a.view());
  bridge.save(*src2_, tokens, b.view());
  const Load load = bridge.load(*tgt_, tokens);
  EXPECT_EQ(load.source(), "src2");
  EXPECT_EQ(load.tokens(), 64);
  EXPECT_EQ(load_kv(load, *tgt_), converted(**good2_, b.view().slice_tokens(0, 64), 0, false));
}

TEST_F(BridgeTest, QualityGate) {
  KVStore store(store_options());
  Bridge bridge(store);  // default min_quality 0.5
  bridge.add_adapter(*bad_);
  const auto tokens = testing::random_tokens(33, 11);
  FloatKV src(*src_, 33);
  src.randomize(18);
  bridge.save(*src_, tokens, src.view());
  EXPECT_FALSE(bridge.load(*tgt_, tokens));
  BridgeStats s = bridge.stats();
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.conversions, 0);
  EXPECT_EQ(s.adapters_skipped_quality, 1);
  EXPECT_EQ(s.adapters, 1);
  EXPECT_EQ(s.adapters_below_quality, 1);

  BridgeOptions open;
  open.min_quality = -std::numeric_limits<double>::infinity();
  Bridge ungated(store, open);
  ungated.add_adapter(*bad_);
  const Load load = ungated.load(*tgt_, tokens);
  EXPECT_TRUE(load.converted());
  EXPECT_EQ(ungated.stats().adapters_below_quality, 0);
}

TEST_F(BridgeTest, TokenizerMismatchNeverConverts) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(40, 12);
  FloatKV src(*src_, 40);
  src.randomize(19);
  bridge.save(*src_, tokens, src.view());
  ModelSpec other_tok = *tgt_;
  other_tok.tokenizer = "another-tokenizer";
  EXPECT_FALSE(bridge.load(other_tok, tokens));
  EXPECT_EQ(bridge.stats().conversions, 0);
  EXPECT_EQ(bridge.stats().adapters_skipped_stale, 1);

  // An adapter between models with different (or unknown) tokenizers is refused outright.
  ModelSpec s = spec_of("s", 1, 1, 4, 10000.0, "tok-a");
  ModelSpec t = spec_of("t", 1, 1, 4, 10000.0, "tok-b");
  EXPECT_THROW(bridge.add_adapter(fit_planted(s, t, 4)), InvalidArgument);
  s.tokenizer = t.tokenizer = "";
  EXPECT_THROW(bridge.add_adapter(fit_planted(s, t, 4)), InvalidArgument);
}

// Across tokenizers with the caller's tokenizations of one 12-byte text: the source has a BOS
// and one token per byte, the target a BOS and four 3-byte tokens, plus one prompt token past the
// verified text. The adapter is fitted on aligned random samples (its quality does not matter
// here, the gate is off): the load must equal the adapter's aligned convert.
TEST_F(BridgeTest, AcrossTokenizersWithTheCallersTokenizations) {
  const ModelSpec s = spec_of("s", 2, 1, 4, 10000.0, "tok-a");
  const ModelSpec t = spec_of("t", 1, 2, 6, 30000.0, "tok-b");
  Tokenization source, target;
  source.ids.push_back(1);
  source.spans.push_back({0, 0});
  source.roles.push_back("bos");
  for (int64_t i = 0; i < 12; ++i) {
    source.ids.push_back(100 + i);
    source.spans.push_back({i, i + 1});
    source.roles.push_back("");
  }
  target.ids.push_back(7);
  target.spans.push_back({0, 0});
  target.roles.push_back("bos");
  for (int64_t j = 0; j < 4; ++j) {
    target.ids.push_back(200 + j);
    target.spans.push_back({3 * j, 3 * j + 3});
    target.roles.push_back("");
  }
  const std::vector<int64_t> rows =
      align(source.spans, target.spans, AlignPolicy::kSeen, source.roles, target.roles);
  ASSERT_EQ(rows, (std::vector<int64_t>{0, 3, 6, 9, 12}));

  FitOptions options;
  options.selection = FitOptions::Selection::kAll;
  options.alignment_policy = "seen";
  AdapterFitter fitter(s, t, options);
  for (int i = 0; i < 8; ++i) {
    FloatKV a(s, 13), b(t, 5);
    a.randomize(40 + i);
    b.randomize(80 + i);
    fitter.add(a.view(), b.view(), 0, rows);
  }
  auto adapter = std::make_shared<const LinearAdapter>(fitter.fit());

  StoreOptions o = store_options();
  o.chunk_tokens = 1;
  KVStore store(o);
  BridgeOptions bo;
  bo.min_quality = -std::numeric_limits<double>::infinity();
  Bridge bridge(store, bo);
  // Without an alignment policy the pair is refused; with one it is accepted.
  EXPECT_THROW(bridge.add_adapter(fit_planted(s, t, 4)), InvalidArgument);
  bridge.add_adapter(adapter);
  FloatKV src(s, 13, 2);
  src.randomize(5);
  EXPECT_EQ(bridge.save(s, source.ids, src.view()), 13);

  std::vector<int64_t> prompt = target.ids;
  prompt.push_back(9);  // past the verified text
  // The caller tokenized the text under the source's tokenizer before the call.
  const SourceTokenizations sources{{"tok-a", source}};
  // The plain load never uses an adapter across tokenizers.
  EXPECT_FALSE(bridge.load(t, prompt));
  // Nothing of t's own is cached: the source's tokenization is wanted.
  using Ids = std::vector<std::string>;
  EXPECT_EQ(bridge.wanted_tokenizers(t, prompt), Ids{"tok-a"});
  const Load planned = bridge.probe(t, prompt, target, sources);
  EXPECT_EQ(bridge.stats().cross_tokenizer_loads, 0);  // a probe is not a load
  const Load hit = bridge.load(t, prompt, target, sources);
  expect_probe_matches(planned, hit);
  ASSERT_TRUE(hit);
  EXPECT_TRUE(hit.converted());
  EXPECT_EQ(hit.tokens(), 5);
  std::vector<float> want(static_cast<size_t>(2 * 5 * 12));
  adapter->convert(src.view(), 0,
                   KVView::contiguous(want.data(), DType::kFloat32, {}, 1, 5, 2, 6), rows, 0);
  // The same float32 convert of the same stored bytes: identical results.
  EXPECT_EQ(load_kv(hit, t), want);
  BridgeStats st = bridge.stats();
  EXPECT_EQ(st.aligned_hits, 1);
  EXPECT_EQ(st.cross_tokenizer_loads, 1);
  EXPECT_EQ(st.unverified_tokens, 1);
  EXPECT_EQ(st.written_back_tokens, 5);
  // The written-back prefix covers all an aligned candidate could serve (n - 1, tail 0): no
  // tokenization is wanted, and the plain load serves what the one across tokenizers does.
  EXPECT_EQ(bridge.wanted_tokenizers(t, prompt), Ids{});
  EXPECT_EQ(bridge.load(t, prompt).tokens(), bridge.load(t, prompt, target, sources).tokens());
  // Not counted as a load or a probe; short prompts want nothing; bad ids are refused.
  EXPECT_EQ(bridge.wanted_tokenizers(t, std::vector<int64_t>{7}), Ids{});
  EXPECT_THROW(bridge.wanted_tokenizers(t, std::vector<int64_t>{7, -1}), InvalidArgument);
  EXPECT_EQ(bridge.stats().loads, st.loads + 2);
  EXPECT_EQ(bridge.stats().probes, st.probes);

  // Only the source's first 7 tokens cached (BOS and 6 bytes): the target prefix whose text lies
  // inside them is BOS and the first two 3-byte tokens.
  KVStore store2(o);
  Bridge bridge2(store2, bo);
  bridge2.add_adapter(adapter);
  std::vector<int64_t> first7(source.ids.begin(), source.ids.begin() + 7);
  bridge2.save(s, first7, src.view().slice_tokens(0, 7));
  const Load part_planned = bridge2.probe(t, prompt, target, sources);
  const Load part = bridge2.load(t, prompt, target, sources);
  expect_probe_matches(part_planned, part);
  EXPECT_EQ(part.tokens(), 3);
  // (A 3-token GEMM against the 5-token one: equal up to float32 rounding.)
  EXPECT_LT(max_rel_diff(load_kv(part, t), token_range(want, t, 5, 0, 3)), 1e-6);
  // 3 of 5 written back: an aligned candidate could still serve more.
  EXPECT_EQ(bridge2.wanted_tokenizers(t, prompt), Ids{"tok-a"});
  // Disabled, the adapter serves nothing, and no tokenization is wanted for it.
  ASSERT_TRUE(bridge2.disable_adapter(adapter->fingerprint()));
  EXPECT_EQ(bridge2.wanted_tokenizers(t, prompt), Ids{});
  // With a recompute tail of 3 an aligned candidate serves at most 5 - 3 = 2 tokens: wanted
  // while the own prefix is shorter, not once it is as long.
  BridgeOptions tailed = bo;
  tailed.recompute_tail = 3;
  KVStore store4(o);
  Bridge bridge4(store4, tailed);
  bridge4.add_adapter(adapter);
  EXPECT_EQ(bridge4.wanted_tokenizers(t, prompt), Ids{"tok-a"});
  FloatKV own(t, 2, 3);
  own.randomize(11);
  ASSERT_EQ(bridge4.save(t, std::vector<int64_t>(prompt.begin(), prompt.begin() + 2), own.view()),
            2);
  EXPECT_EQ(bridge4.wanted_tokenizers(t, prompt), Ids{});
  // A caller without the source's tokenizer: a miss.
  KVStore store3(o);
  Bridge bridge3(store3, bo);
  bridge3.add_adapter(adapter);
  bridge3.save(s, source.ids, src.view());
  EXPECT_FALSE(bridge3.load(t, prompt, target, SourceTokenizations{}));
  EXPECT_FALSE(bridge3.probe(t, prompt, target, SourceTokenizations{}));
  EXPECT_FALSE(bridge3.load(t, prompt, target, SourceTokenizations{{"tok-other", source}}));
  // A target tokenization that is not a prefix of the prompt, or malformed, is refused.
  Tokenization wrong = target;
  wrong.ids[2] = 555;
  EXPECT_THROW(bridge3.load(t, prompt, wrong, sources), InvalidArgument);
  EXPECT_THROW(bridge3.probe(t, prompt, wrong, sources), InvalidArgument);
  wrong = target;
  wrong.spans.pop_back();
  EXPECT_THROW(bridge3.load(t, prompt, wrong, sources), InvalidArgument);
  // So is a malformed source tokenization.
  wrong = source;
  wrong.roles.pop_back();
  EXPECT_THROW(bridge3.load(t, prompt, target, SourceTokenizations{{"tok-a", wrong}}),
               InvalidArgument);
}

// Token `pos` of a dense [layers, 2, tokens, heads, dim] vector replaced by the one-token `one`.
std::vector<float> with_token(std::vector<float> kv, const ModelSpec& s, int64_t tokens,
                              int64_t pos, const std::vector<float>& one) {
  const int64_t row = s.num_kv_heads * s.head_dim;
  for (int64_t p = 0; p < 2 * s.num_layers; ++p)
    std::copy(one.begin() + p * row, one.begin() + (p + 1) * row,
              kv.begin() + (p * tokens + pos) * row);
  return kv;
}

// The start token: a load holding converted KV takes the target's own KV of its first token
// where one is registered (a save of the target's own, or add_start), now and as a native hit
// on the written-back entries; without one, the converted KV stays at position 0.
TEST_F(BridgeTest, ConvertedLoadsTakeTheTargetsOwnStartToken) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(53, 21);
  FloatKV src(*src_, 53, 1);
  src.randomize(31);
  bridge.save(*src_, tokens, src.view());
  const std::vector<float> conv = converted(**good_, src.view().slice_tokens(0, 48), 0, false);
  std::vector<float> one(static_cast<size_t>(2 * tgt_->num_layers * tgt_->num_kv_heads *
                                             tgt_->head_dim));
  const KVView one_view = KVView::contiguous(one.data(), DType::kFloat32, {}, tgt_->num_layers,
                                             1, tgt_->num_kv_heads, tgt_->head_dim);
  EXPECT_FALSE(bridge.copy_start(*tgt_, tokens[0], one_view));

  // Without a registered start token: the conversion everywhere (and it is written back).
  KVStore plain_store(store_options());
  Bridge plain(plain_store);
  plain.add_adapter(*good_);
  plain.save(*src_, tokens, src.view());
  EXPECT_EQ(load_kv(plain.load(*tgt_, tokens), *tgt_), conv);

  // The target's own prefill of another prompt opening with the same token registers it.
  auto other = testing::random_tokens(20, 22);
  other[0] = tokens[0];
  FloatKV own(*tgt_, 20, 2);
  own.randomize(32);
  EXPECT_EQ(bridge.save(*tgt_, other, own.view()), 16);
  const std::vector<float> own_first = dense(own.view().slice_tokens(0, 1));
  ASSERT_NE(own_first, token_range(conv, *tgt_, 48, 0, 1));
  ASSERT_TRUE(bridge.copy_start(*tgt_, tokens[0], one_view));
  EXPECT_EQ(one, own_first);
  const std::vector<float> want = with_token(conv, *tgt_, 48, 0, own_first);
  const Load first = bridge.load(*tgt_, tokens);
  ASSERT_TRUE(first.converted());
  EXPECT_EQ(load_kv(first, *tgt_), want);
  // The written-back entries keep the conversion's first token; the native hit on them (its
  // provenance names the adapter) takes the target's own again.
  const Load second = bridge.load(*tgt_, tokens);
  ASSERT_FALSE(second.converted());
  ASSERT_FALSE(second.adapter().empty());
  EXPECT_EQ(load_kv(second, *tgt_), want);
  Match stored = store.match(*tgt_, tokens);
  ASSERT_EQ(stored.tokens(), 48);
  std::vector<float> entries(conv.size());
  stored.copy_range_to(0, KVView::contiguous(entries.data(), DType::kFloat32, {},
                                             tgt_->num_layers, 48, tgt_->num_kv_heads,
                                             tgt_->head_dim));
  EXPECT_EQ(entries, conv);
  // A later save of the target's own does not replace it; add_start does.
  FloatKV again(*tgt_, 20);
  again.randomize(33);
  auto other2 = testing::random_tokens(20, 23);
  other2[0] = tokens[0];
  bridge.save(*tgt_, other2, again.view());
  EXPECT_EQ(load_kv(bridge.load(*tgt_, tokens), *tgt_), want);
  bridge.add_start(*tgt_, tokens[0], again.view());
  EXPECT_EQ(load_kv(bridge.load(*tgt_, tokens), *tgt_),
            with_token(conv, *tgt_, 48, 0, dense(again.view().slice_tokens(0, 1))));
  // The target's own entries are served as stored.
  EXPECT_EQ(load_kv(bridge.load(*tgt_, other), *tgt_), dense(own.view().slice_tokens(0, 16)));
  EXPECT_THROW(bridge.add_start(*src_, tokens[0], again.view()), InvalidArgument);
  EXPECT_THROW(bridge.add_start(*tgt_, -1, again.view()), InvalidArgument);
}

TEST_F(BridgeTest, LastTokenIsNeverReturned) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(48, 13);  // three whole chunks
  FloatKV src(*src_, 48), tgt(*tgt_, 48);
  src.randomize(20);
  tgt.randomize(21);
  bridge.save(*src_, tokens, src.view());
  const Load conv = bridge.load(*tgt_, tokens);
  EXPECT_TRUE(conv.converted());
  EXPECT_EQ(conv.tokens(), 47);
  // All 48 were converted and written back; the returned 47 are their first 47.
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 48);
  const auto all48 = converted(**good_, src.view().slice_tokens(0, 48), 0, false);
  EXPECT_EQ(load_kv(conv, *tgt_), token_range(all48, *tgt_, 48, 0, 47));
  const Load native = bridge.load(*tgt_, tokens);
  EXPECT_FALSE(native.converted());
  EXPECT_EQ(native.tokens(), 47);

  KVStore store2(store_options());
  Bridge plain(store2);
  plain.save(*tgt_, tokens, tgt.view());
  const Load own = plain.load(*tgt_, tokens);
  EXPECT_EQ(own.tokens(), 47);
  EXPECT_EQ(load_kv(own, *tgt_), dense(tgt.view().slice_tokens(0, 47)));
  // Prompts of 0 or 1 tokens are misses; a one-chunk prefix is trimmed only when it is all.
  EXPECT_FALSE(plain.load(*tgt_, TokenSpan(tokens.data(), 0)));
  EXPECT_FALSE(plain.load(*tgt_, TokenSpan(tokens.data(), 1)));
  EXPECT_EQ(plain.load(*tgt_, TokenSpan(tokens.data(), 17)).tokens(), 16);
  EXPECT_EQ(plain.load(*tgt_, TokenSpan(tokens.data(), 16)).tokens(), 15);
  EXPECT_EQ(plain.stats().misses, 2);
}

TEST_F(BridgeTest, NamespacesAreIsolated) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(40, 14);
  FloatKV src(*src_, 40);
  src.randomize(22);
  bridge.save(*src_, tokens, src.view(), "tenant-a");
  EXPECT_FALSE(bridge.load(*tgt_, tokens, "tenant-b"));
  EXPECT_TRUE(bridge.load(*tgt_, tokens, "tenant-a").converted());
  EXPECT_FALSE(bridge.load(*tgt_, tokens, "tenant-b"));  // the write-back stayed in tenant-a
  EXPECT_FALSE(bridge.load(*tgt_, tokens));
  EXPECT_EQ(bridge.load(*tgt_, tokens, "tenant-a").native_tokens(), 32);
}

TEST_F(BridgeTest, Validation) {
  KVStore store(store_options());
  BridgeOptions nan;
  nan.min_quality = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW((Bridge{store, nan}), InvalidArgument);

  Bridge bridge(store);
  EXPECT_THROW(bridge.add_adapter(nullptr), InvalidArgument);
  bridge.add_adapter(*bad_);
  EXPECT_THROW(bridge.add_adapter(*good_), InvalidArgument);  // same pair
  bridge.add_adapter(*good_, /*replace=*/true);
  ASSERT_EQ(bridge.adapters().size(), 1u);
  EXPECT_EQ(bridge.adapters()[0], *good_);
  EXPECT_TRUE(bridge.remove_adapter(*src_, *tgt_));
  EXPECT_FALSE(bridge.remove_adapter(*src_, *tgt_));
  EXPECT_THROW(bridge.add_adapter(fit_planted(*tgt_, *tgt_, 5)), InvalidArgument);

  // KV that does not match the spec, and bad token ids.
  const auto tokens = testing::random_tokens(20, 15);
  FloatKV wrong(*src_, 20);
  wrong.randomize(23);
  EXPECT_THROW(bridge.save(*tgt_, tokens, wrong.view()), InvalidArgument);
  FloatKV short_kv(*tgt_, 19);
  short_kv.randomize(24);
  EXPECT_THROW(bridge.save(*tgt_, tokens, short_kv.view()), InvalidArgument);
  std::vector<int64_t> bad_ids = tokens;
  bad_ids[3] = -1;
  EXPECT_THROW(bridge.load(*tgt_, bad_ids), InvalidArgument);
  ModelSpec bad_spec = *tgt_;
  bad_spec.head_dim = 0;
  EXPECT_THROW(bridge.load(bad_spec, tokens), InvalidArgument);

  // A Load copies only into a view of its own geometry.
  FloatKV tgt(*tgt_, 20);
  tgt.randomize(25);
  bridge.save(*tgt_, tokens, tgt.view());
  const Load load = bridge.load(*tgt_, tokens);
  ASSERT_EQ(load.tokens(), 16);
  FloatKV out(*tgt_, 15);
  EXPECT_THROW(load.copy_to(out.view()), InvalidArgument);
}

TEST_F(BridgeTest, PrometheusTextNamesEveryCounter) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(40, 16);
  FloatKV src(*src_, 40);
  src.randomize(26);
  bridge.save(*src_, tokens, src.view());
  bridge.load(*tgt_, tokens);
  bridge.load(*tgt_, tokens);
  bridge.load(*src2_, tokens);
  const std::string text = bridge.metrics_text();
  for (const char* line :
       {"kvbridge_bridge_saves_total 1\n", "kvbridge_bridge_loads_total 3\n",
        "kvbridge_bridge_native_hits_total 1\n", "kvbridge_bridge_converted_hits_total 1\n",
        "kvbridge_bridge_misses_total 1\n", "kvbridge_bridge_conversions_total 1\n",
        "kvbridge_bridge_native_tokens_total 32\n", "kvbridge_bridge_converted_tokens_total 32\n",
        "kvbridge_bridge_written_back_tokens_total 32\n",
        "kvbridge_bridge_adapters_skipped_quality_total 0\n",
        "kvbridge_bridge_adapters_skipped_stale_total 0\n", "kvbridge_bridge_adapters 1\n",
        "kvbridge_bridge_cross_tokenizer_loads_total 0\n",
        "kvbridge_bridge_unverified_tokens_total 0\n", "kvbridge_bridge_aligned_hits_total 0\n",
        "kvbridge_bridge_adapters_below_quality 0\n",
        "# TYPE kvbridge_bridge_convert_seconds_total counter\n",
        "# TYPE kvbridge_bridge_adapters gauge\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
  EXPECT_NE(text.find("kvbridge_bridge_lookup_seconds_total "), std::string::npos);
}

// Concurrent loads of one prompt: each gets either a converted or a native result, all equal.
TEST_F(BridgeTest, ConcurrentLoadsAgree) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(50, 17);
  FloatKV src(*src_, 50);
  src.randomize(27);
  bridge.save(*src_, tokens, src.view());
  const std::vector<float> expected = converted(**good_, src.view().slice_tokens(0, 48), 0, false);
  std::vector<std::vector<float>> results(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 5; ++rep) results[i] = load_kv(bridge.load(*tgt_, tokens), *tgt_);
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& r : results) EXPECT_EQ(r, expected);
  const BridgeStats s = bridge.stats();
  EXPECT_EQ(s.loads, 20);
  EXPECT_EQ(s.native_hits + s.converted_hits, 20);
  EXPECT_GE(s.converted_hits, 1);
}

// recompute_tail r: a converted load stops r tokens before the last prompt token; the converted
// tokens equal the adapter's conversion of the same tokens, and only their whole chunks are
// written back. The target's own prefix is never cut; a written-back one is cut as a conversion
// would be, and a native prefix wins when the cut leaves the conversion no more than it.
TEST_F(BridgeTest, RecomputeTailLeavesTokensToTheTarget) {
  KVStore store(store_options());
  BridgeOptions options;
  options.recompute_tail = 5;
  Bridge bridge(store, options);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(53, 31);  // limit 52, cut at 47
  FloatKV src(*src_, 53, 1);
  src.randomize(41);
  bridge.save(*src_, tokens, src.view());
  const Load load = bridge.load(*tgt_, tokens);
  ASSERT_TRUE(load.converted());
  EXPECT_EQ(load.tokens(), 47);
  // The same float32 convert of the same 47 stored tokens: identical; float64 within 1e-5.
  EXPECT_EQ(load_kv(load, *tgt_), converted(**good_, src.view().slice_tokens(0, 47), 0, false));
  const auto ref48 = converted(**good_, src.view().slice_tokens(0, 48), 0, true);
  EXPECT_LT(max_rel_diff(load_kv(load, *tgt_), token_range(ref48, *tgt_, 48, 0, 47)), 1e-5);
  EXPECT_EQ(bridge.stats().converted_tokens, 47);
  EXPECT_EQ(bridge.stats().written_back_tokens, 32);
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 32);
  // Native 32 now; the converted candidate (47) is still longer: tokens [32, 47) converted.
  const Load again = bridge.load(*tgt_, tokens);
  EXPECT_TRUE(again.converted());
  EXPECT_EQ(again.native_tokens(), 32);
  EXPECT_LT(max_rel_diff(load_kv(again, *tgt_), token_range(ref48, *tgt_, 48, 0, 47)), 1e-5);

  BridgeOptions deep;
  deep.recompute_tail = 30;  // cut at 22: the written-back 32 are cut to 22 too, and win
  Bridge cautious(store, deep);
  cautious.add_adapter(*good_);
  const Load native = cautious.load(*tgt_, tokens);
  EXPECT_FALSE(native.converted());
  EXPECT_EQ(native.tokens(), 22);
  EXPECT_EQ(native.recompute_tail(), 30);
  EXPECT_EQ(native.adapter(), (*good_)->fingerprint());
  KVStore empty(store_options());
  Bridge fresh(empty, deep);
  fresh.add_adapter(*good_);
  fresh.save(*src_, tokens, src.view());
  const Load short_load = fresh.load(*tgt_, tokens);
  EXPECT_TRUE(short_load.converted());
  EXPECT_EQ(short_load.tokens(), 22);
  EXPECT_LT(max_rel_diff(load_kv(short_load, *tgt_), token_range(ref48, *tgt_, 48, 0, 22)), 1e-5);
  EXPECT_EQ(fresh.stats().written_back_tokens, 16);
  deep.recompute_tail = 60;  // nothing left to convert: a miss
  Bridge none(empty, deep);
  none.add_adapter(*good_);
  EXPECT_FALSE(none.load(*tgt_, testing::random_tokens(40, 32)));

  BridgeOptions negative;
  negative.recompute_tail = -2;  // -1 is "each adapter's own"
  EXPECT_THROW((Bridge{store, negative}), InvalidArgument);
}

// Serving defaults ------------------------------------------------------------------------------

// A mutable copy of a fitted adapter (saved and loaded again), with or without a serving record.
std::shared_ptr<LinearAdapter> copy_of(const LinearAdapter& adapter, const std::string& path) {
  adapter.save(path);
  return std::make_shared<LinearAdapter>(LinearAdapter::load(path));
}

ServingDefaults serving_of(int64_t tail) {
  ServingDefaults s;
  s.recorded = true;
  s.recompute_tail = tail;
  s.recompute_share = 0.125;
  s.agreement_goal = 0.875;
  s.note = "planted";
  for (int64_t r : {0, 4, 9}) {
    ServingPoint p;
    p.recompute_tail = r;
    p.kept = 0.5 + 0.05 * static_cast<double>(r);
    p.agreement = 0.8 + 0.01 * static_cast<double>(r);
    p.computed_share = static_cast<double>(r + 1) / 53.0;
    p.prompt_tokens = 53;
    s.measured.push_back(p);
  }
  s.measured[1].kept = std::numeric_limits<double>::quiet_NaN();  // not measured: null
  return s;
}

// The record survives save and load exactly (NaN as null), leaves fingerprint() alone, is covered
// by the file's checksum, and a file without it loads with nothing recorded.
TEST_F(BridgeTest, ServingDefaultsRoundTripThroughTheAdapterFile) {
  testing::TempDir dir;
  auto plain = copy_of(**good_, dir.path + "/plain.safetensors");
  EXPECT_FALSE(plain->serving().recorded);
  EXPECT_TRUE(plain->serving().measured.empty());
  const std::string fp = plain->fingerprint();

  ServingDefaults recorded = serving_of(4);
  recorded.by_length = {{53, 4}, {212, 9}};
  plain->set_serving(recorded);
  EXPECT_EQ(plain->fingerprint(), fp);
  plain->save(dir.path + "/serving.safetensors");
  const LinearAdapter back = LinearAdapter::load(dir.path + "/serving.safetensors");
  const ServingDefaults s = back.serving();
  ASSERT_TRUE(s.recorded);
  EXPECT_EQ(s.recompute_tail, 4);
  EXPECT_EQ(s.recompute_share, 0.125);
  EXPECT_EQ(s.agreement_goal, 0.875);
  EXPECT_EQ(s.note, "planted");
  ASSERT_EQ(s.by_length.size(), 2u);
  EXPECT_EQ(s.by_length[0].prompt_tokens, 53);
  EXPECT_EQ(s.by_length[0].recompute_tail, 4);
  EXPECT_EQ(s.by_length[1].prompt_tokens, 212);
  EXPECT_EQ(s.by_length[1].recompute_tail, 9);
  ASSERT_EQ(s.measured.size(), 3u);
  const ServingDefaults want = serving_of(4);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(s.measured[i].recompute_tail, want.measured[i].recompute_tail);
    if (i == 1) {
      EXPECT_TRUE(std::isnan(s.measured[i].kept));
    } else {
      EXPECT_EQ(s.measured[i].kept, want.measured[i].kept);
    }
    EXPECT_EQ(s.measured[i].agreement, want.measured[i].agreement);
    EXPECT_EQ(s.measured[i].computed_share, want.measured[i].computed_share);
    EXPECT_EQ(s.measured[i].prompt_tokens, 53);
  }
  EXPECT_EQ(back.fingerprint(), fp);

  // The record is checksummed: an edited tail is a damaged file.
  io::StFile file = io::read_safetensors(dir.path + "/serving.safetensors");
  ASSERT_EQ(file.metadata.count("serving"), 1u);
  EXPECT_NE(file.metadata.at("checksum"), fp);
  std::string& text = file.metadata.at("serving");
  const size_t at = text.find("\"recompute_tail\":4}");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 19, "\"recompute_tail\":5}");
  std::vector<io::StTensor> tensors;
  for (auto& [name, t] : file.tensors) tensors.push_back(t);
  io::write_safetensors(dir.path + "/edited.safetensors", tensors, file.metadata);
  EXPECT_THROW(LinearAdapter::load(dir.path + "/edited.safetensors"), Corrupt);
  // ... and a record out of range under a valid checksum is refused too.
  file.metadata.erase("checksum");
  text = "{\"recompute_tail\":-3,\"agreement_goal\":null,\"measured\":[],\"note\":\"\"}";
  io::write_safetensors(dir.path + "/bad.safetensors", tensors, file.metadata);
  AdapterLoadOptions unchecked;
  unchecked.allow_unchecked = true;
  EXPECT_THROW(LinearAdapter::load(dir.path + "/bad.safetensors", unchecked), Corrupt);
  text = "{\"recompute_tail\":3,\"recompute_share\":2.0,\"agreement_goal\":null,"
         "\"measured\":[],\"note\":\"\"}";
  io::write_safetensors(dir.path + "/bad_share.safetensors", tensors, file.metadata);
  EXPECT_THROW(LinearAdapter::load(dir.path + "/bad_share.safetensors", unchecked), Corrupt);
  for (const char* by_length : {"{}", "[[53, 4]]", "[{\"prompt_tokens\":53}]",
                                "[{\"prompt_tokens\":0,\"recompute_tail\":4}]",
                                "[{\"prompt_tokens\":53,\"recompute_tail\":-4}]",
                                "[{\"prompt_tokens\":53,\"recompute_tail\":4},"
                                "{\"prompt_tokens\":53,\"recompute_tail\":9}]"}) {
    text = std::string("{\"recompute_tail\":3,\"by_length\":") + by_length +
           ",\"agreement_goal\":null,\"measured\":[],\"note\":\"\"}";
    io::write_safetensors(dir.path + "/bad_lengths.safetensors", tensors, file.metadata);
    EXPECT_THROW(LinearAdapter::load(dir.path + "/bad_lengths.safetensors", unchecked), Corrupt)
        << by_length;
  }
  // A record written before recompute_share and by_length existed serves its tail alone.
  text = "{\"recompute_tail\":3,\"agreement_goal\":null,\"measured\":[],\"note\":\"\"}";
  io::write_safetensors(dir.path + "/old.safetensors", tensors, file.metadata);
  const ServingDefaults old =
      LinearAdapter::load(dir.path + "/old.safetensors", unchecked).serving();
  EXPECT_EQ(old.recompute_share, 0.0);
  EXPECT_TRUE(old.by_length.empty());
  EXPECT_EQ(old.tail_for(100000), 3);

  // Clearing the record: the file is the plain one again, byte for byte in its checksum.
  plain->set_serving(ServingDefaults{});
  EXPECT_FALSE(plain->serving().recorded);
  plain->save(dir.path + "/cleared.safetensors");
  EXPECT_EQ(io::read_safetensors(dir.path + "/cleared.safetensors").metadata.count("serving"), 0u);
  EXPECT_EQ(io::read_safetensors(dir.path + "/cleared.safetensors").metadata.at("checksum"), fp);

  // Out of range: refused, nothing changed.
  ServingDefaults bad = serving_of(4);
  bad.recompute_tail = -1;
  EXPECT_THROW(plain->set_serving(bad), InvalidArgument);
  bad = serving_of(4);
  bad.agreement_goal = 1.5;
  EXPECT_THROW(plain->set_serving(bad), InvalidArgument);
  for (double share : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    bad = serving_of(4);
    bad.recompute_share = share;
    EXPECT_THROW(plain->set_serving(bad), InvalidArgument) << share;
  }
  for (const std::vector<LengthTail>& by_length :
       {std::vector<LengthTail>{{0, 4}}, {{53, -1}}, {{53, 4}, {53, 9}}, {{212, 9}, {53, 4}}}) {
    bad = serving_of(4);
    bad.by_length = by_length;
    EXPECT_THROW(plain->set_serving(bad), InvalidArgument) << by_length.size();
  }
  bad = serving_of(4);
  bad.measured[0].agreement = -0.1;
  EXPECT_THROW(plain->set_serving(bad), InvalidArgument);
  bad = serving_of(4);
  bad.measured[2].kept = std::numeric_limits<double>::infinity();
  EXPECT_THROW(plain->set_serving(bad), InvalidArgument);
  EXPECT_FALSE(plain->serving().recorded);
}

// By default (recompute_tail -1) a converted load leaves the converting adapter's recorded tail to
// the target; an adapter without a record converts all but the last token; an explicit option
// wins over the record.
TEST_F(BridgeTest, ConvertedLoadsUseTheAdaptersRecordedTail) {
  testing::TempDir dir;
  auto adapter = copy_of(**good_, dir.path + "/a.safetensors");
  adapter->set_serving(serving_of(9));
  const auto tokens = testing::random_tokens(53, 71);  // limit 52, cut at 43
  FloatKV src(*src_, 53, 1);
  src.randomize(72);
  const auto ref = converted(*adapter, src.view(), 0, true);

  KVStore store(store_options());
  Bridge bridge(store);
  EXPECT_EQ(bridge.options().recompute_tail, -1);
  EXPECT_EQ(bridge.recompute_tail(*adapter, 53), 9);
  bridge.add_adapter(adapter);
  bridge.save(*src_, tokens, src.view());
  const Load load = bridge.load(*tgt_, tokens);
  ASSERT_TRUE(load.converted());
  EXPECT_EQ(load.tokens(), 43);
  EXPECT_EQ(load.recompute_tail(), 9);
  EXPECT_LT(max_rel_diff(load_kv(load, *tgt_), token_range(ref, *tgt_, 53, 0, 43)), 1e-5);
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 32);  // whole chunks of the 43 written back

  // The record changes while registered: the next load uses the new one.
  adapter->set_serving(serving_of(20));
  KVStore store2(store_options());
  Bridge bridge2(store2);
  bridge2.add_adapter(adapter);
  bridge2.save(*src_, tokens, src.view());
  EXPECT_EQ(bridge2.load(*tgt_, tokens).tokens(), 32);  // 52 - 20

  // Explicit options win: 0 converts all 48 cached source tokens, 5 cuts at 47.
  for (int64_t r : {0, 5}) {
    KVStore s(store_options());
    BridgeOptions o;
    o.recompute_tail = r;
    Bridge b(s, o);
    EXPECT_EQ(b.recompute_tail(*adapter, 53), r);
    b.add_adapter(adapter);
    b.save(*src_, tokens, src.view());
    const Load l = b.load(*tgt_, tokens);
    EXPECT_EQ(l.tokens(), r == 0 ? 48 : 47);
    EXPECT_EQ(l.recompute_tail(), r);
  }

  // Nothing recorded: 0 (the old default's behaviour).
  KVStore store3(store_options());
  Bridge bridge3(store3);
  EXPECT_EQ(bridge3.recompute_tail(**good_, 53), 0);
  bridge3.add_adapter(*good_);
  bridge3.save(*src_, tokens, src.view());
  const Load whole = bridge3.load(*tgt_, tokens);
  EXPECT_EQ(whole.tokens(), 48);
  EXPECT_EQ(whole.recompute_tail(), 0);
}

// Tails measured at several lengths: up to the longest, each length's tail, scaled down in
// proportion below its length and held above it (never under recompute_tail); past it, the share.
TEST_F(BridgeTest, TailsMeasuredByLengthServeUpToTheLongest) {
  ServingDefaults s = serving_of(8);
  s.recompute_share = 0.2;  // 200 of 1,000 tokens: the most any measured length needed
  s.by_length = {{300, 8}, {1000, 200}, {4000, 256}, {7000, 500}};
  EXPECT_EQ(s.tail_for(0), 8);
  EXPECT_EQ(s.tail_for(300), 60);    // 200 * 300 / 1000, above the 8 measured at 300
  EXPECT_EQ(s.tail_for(501), 101);   // ceil(100.2)
  EXPECT_EQ(s.tail_for(1000), 200);
  EXPECT_EQ(s.tail_for(1001), 200);  // held: the share would give 201
  EXPECT_EQ(s.tail_for(3000), 215);  // ceil(500 * 3000 / 7000): 214.3, above 200 and 192
  EXPECT_EQ(s.tail_for(4000), 286);  // 285.7 from 7,000's tail, above 256
  EXPECT_EQ(s.tail_for(7000), 500);
  EXPECT_EQ(s.tail_for(7001), 1401);  // past every measured length: ceil(0.2 * 7001)
  // A product whole up to rounding does not round up: 14 / 200 * 100 is 7.000000000000001.
  s.recompute_tail = 0;
  s.by_length = {{200, 14}};
  EXPECT_EQ(s.tail_for(100), 7);
  EXPECT_EQ(s.tail_for(101), 8);
  s.recompute_tail = 9;  // the floor holds at every length
  EXPECT_EQ(s.tail_for(10), 9);
  EXPECT_EQ(s.tail_for(150), 11);

  // A Bridge serves the record's tail_for.
  testing::TempDir dir;
  auto adapter = copy_of(**good_, dir.path + "/a.safetensors");
  s = serving_of(2);
  s.recompute_share = 0.5;
  s.by_length = {{20, 10}, {60, 12}};
  adapter->set_serving(s);
  KVStore store(store_options());
  Bridge bridge(store);
  EXPECT_EQ(bridge.recompute_tail(*adapter, 10), 5);
  EXPECT_EQ(bridge.recompute_tail(*adapter, 53), 11);  // ceil(12 * 53 / 60): 10.6, held 10 below
  EXPECT_EQ(bridge.recompute_tail(*adapter, 61), 31);
  bridge.add_adapter(adapter);
  const auto tokens = testing::random_tokens(53, 78);  // limit 52, source cached [0, 48)
  FloatKV src(*src_, 53, 1);
  src.randomize(79);
  bridge.save(*src_, tokens, src.view());
  const Load load = bridge.load(*tgt_, tokens);
  ASSERT_TRUE(load.converted());
  EXPECT_EQ(load.recompute_tail(), 11);
  EXPECT_EQ(load.tokens(), 41);  // 52 - 11
}

// A recorded share: a prompt of n tokens gets max(recompute_tail, ceil(share * n)).
TEST_F(BridgeTest, RecordedShareLengthensTheTailOfLongerPrompts) {
  ServingDefaults none;
  EXPECT_EQ(none.tail_for(1000), 0);  // nothing recorded
  ServingDefaults s = serving_of(2);
  s.recompute_share = 0.1;
  EXPECT_EQ(s.tail_for(0), 2);
  EXPECT_EQ(s.tail_for(20), 2);
  EXPECT_EQ(s.tail_for(21), 3);
  EXPECT_EQ(s.tail_for(31), 4);
  s.recompute_share = 0.07;
  EXPECT_EQ(s.tail_for(100), 7);  // 0.07 * 100 is 7.000000000000001 in binary
  EXPECT_EQ(s.tail_for(101), 8);

  testing::TempDir dir;
  auto adapter = copy_of(**good_, dir.path + "/a.safetensors");
  s.recompute_share = 0.25;
  adapter->set_serving(s);
  KVStore store(store_options());
  Bridge bridge(store);
  EXPECT_EQ(bridge.recompute_tail(*adapter, 4), 2);
  EXPECT_EQ(bridge.recompute_tail(*adapter, 53), 14);  // ceil(13.25)
  EXPECT_THROW(bridge.recompute_tail(*adapter, -1), InvalidArgument);
  bridge.add_adapter(adapter);
  const auto tokens = testing::random_tokens(53, 76);  // limit 52, source cached [0, 48)
  FloatKV src(*src_, 53, 1);
  src.randomize(77);
  bridge.save(*src_, tokens, src.view());
  const Load load = bridge.load(*tgt_, tokens);
  ASSERT_TRUE(load.converted());
  EXPECT_EQ(load.recompute_tail(), 14);
  EXPECT_EQ(load.tokens(), 38);  // 52 - 14
  // An explicit option still fixes the tail for every length.
  BridgeOptions fixed;
  fixed.recompute_tail = 3;
  Bridge fixed_bridge(store, fixed);
  EXPECT_EQ(fixed_bridge.recompute_tail(*adapter, 53), 3);
}

// A native hit on entries a conversion wrote back keeps the tail of the adapter its provenance
// names: a shorter prompt over the written-back prefix is cut to n - 1 - r (its own-KV part never
// is), and a load with only the target's own KV is never cut.
TEST_F(BridgeTest, WrittenBackHitsKeepTheirAdaptersTail) {
  testing::TempDir dir;
  auto adapter = copy_of(**good_, dir.path + "/a.safetensors");
  adapter->set_serving(serving_of(9));
  const auto tokens = testing::random_tokens(60, 73);  // limit 59, source cached [0, 48)
  FloatKV src(*src_, 60, 1);
  src.randomize(74);
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(adapter);
  bridge.save(*src_, tokens, src.view());
  ASSERT_EQ(bridge.load(*tgt_, tokens).tokens(), 48);  // min(48, 59 - 9)
  ASSERT_EQ(store.match(*tgt_, tokens).tokens(), 48);  // written back, provenance: the adapter
  const auto ref = converted(*adapter, src.view(), 0, true);

  // A 40-token prompt over that prefix (limit 39): its native match, the written-back 32, is cut
  // to 39 - 9 = 30, as a conversion would be, and wins (the source's 32 cut to 30 is no longer).
  const std::vector<int64_t> p40(tokens.begin(), tokens.begin() + 40);
  const Load l40 = bridge.load(*tgt_, p40);
  EXPECT_FALSE(l40.converted());
  EXPECT_EQ(l40.tokens(), 30);
  EXPECT_EQ(l40.recompute_tail(), 9);
  EXPECT_EQ(l40.adapter(), adapter->fingerprint());
  EXPECT_LT(max_rel_diff(load_kv(l40, *tgt_), token_range(ref, *tgt_, 60, 0, 30)), 1e-5);
  // An explicit option wins here too.
  BridgeOptions fixed;
  fixed.recompute_tail = 2;
  Bridge fixed_bridge(store, fixed);
  fixed_bridge.add_adapter(adapter);
  const Load l40_fixed = fixed_bridge.load(*tgt_, p40);
  EXPECT_EQ(l40_fixed.tokens(), 32);  // min(32, 39 - 2)
  EXPECT_EQ(l40_fixed.recompute_tail(), 2);
  // A Bridge without that adapter registered does not know its tail: not cut.
  Bridge other(store);
  const Load l40_other = other.load(*tgt_, p40);
  EXPECT_EQ(l40_other.tokens(), 32);
  EXPECT_EQ(l40_other.recompute_tail(), 0);
  EXPECT_EQ(l40_other.adapter(), adapter->fingerprint());

  // The target's own entries are never cut: own chunk [0, 16), then [16, 48) written back.
  KVStore store2(store_options());
  Bridge bridge2(store2);
  bridge2.add_adapter(adapter);
  FloatKV own(*tgt_, 16);
  own.randomize(75);
  bridge2.save(*tgt_, std::vector<int64_t>(tokens.begin(), tokens.begin() + 16), own.view());
  bridge2.save(*src_, tokens, src.view());
  const Load first = bridge2.load(*tgt_, tokens);
  ASSERT_TRUE(first.converted());
  EXPECT_EQ(first.native_tokens(), 16);
  ASSERT_EQ(store2.match(*tgt_, tokens).tokens(), 48);
  // 20 tokens (limit 19, 19 - 9 = 10): the own 16 are served whole, with no provenance.
  const Load l20 = bridge2.load(*tgt_, std::vector<int64_t>(tokens.begin(), tokens.begin() + 20));
  EXPECT_EQ(l20.tokens(), 16);
  EXPECT_EQ(l20.adapter(), "");
  EXPECT_EQ(l20.recompute_tail(), 0);
  EXPECT_EQ(load_kv(l20, *tgt_), dense(own.view()));
  // 40 tokens: own 16 plus written-back [16, 32), cut to 30.
  const Load l40b = bridge2.load(*tgt_, p40);
  EXPECT_EQ(l40b.tokens(), 30);
  EXPECT_EQ(l40b.native_tokens(), 30);
  EXPECT_EQ(l40b.recompute_tail(), 9);
}

QualityCheck check_of(int64_t positions, int64_t agreed, double kl = 0.25, int64_t loss = 3,
                      double gap = 0.5) {
  QualityCheck c;
  c.positions = positions;
  c.agreed = agreed;
  c.kl_sum = kl;
  c.loss_positions = loss;
  c.loss_gap_sum = gap;
  return c;
}

// Rolling agreement under the floor disables an adapter at the min_checks-th check at the latest;
// loads then fall back (here: a miss), its written-back entries are gone, and re-enabling it
// starts a fresh window.
TEST_F(BridgeTest, ChecksUnderTheFloorDisableTheAdapter) {
  KVStore store(store_options());
  BridgeOptions options;
  options.min_agreement = 0.75;
  options.check_window = 6;
  options.min_checks = 4;
  Bridge bridge(store, options);
  bridge.add_adapter(*good_);
  const std::string fp = (*good_)->fingerprint();
  const auto tokens = testing::random_tokens(40, 33);
  FloatKV src(*src_, 40);
  src.randomize(42);
  bridge.save(*src_, tokens, src.view());
  ASSERT_TRUE(bridge.load(*tgt_, tokens).converted());
  ASSERT_EQ(store.match(*tgt_, tokens).tokens(), 32);  // written back

  // Healthy checks: 7 of 8 agree.
  for (int i = 0; i < 6; ++i) EXPECT_FALSE(bridge.record_check(fp, check_of(8, 7)));
  std::vector<AdapterHealth> h = bridge.adapter_health();
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].adapter, fp);
  EXPECT_EQ(h[0].source, "src");
  EXPECT_EQ(h[0].target, "tgt");
  EXPECT_TRUE(h[0].enabled);
  EXPECT_EQ(h[0].checks, 6);
  EXPECT_EQ(h[0].window_checks, 6);
  EXPECT_EQ(h[0].window_positions, 48);
  EXPECT_DOUBLE_EQ(h[0].agreement, 42.0 / 48.0);
  EXPECT_DOUBLE_EQ(h[0].kl, 6 * 0.25 / 48.0);
  EXPECT_DOUBLE_EQ(h[0].loss_gap, 6 * 0.5 / 18.0);
  // A broken spell: 1 of 8 agree. The window (6) pools them with the healthy ones:
  // 5 healthy + 1 bad = 36/48, 4 + 2 = 30/48 < 0.75: disabled by the second bad check.
  EXPECT_FALSE(bridge.record_check(fp, check_of(8, 1)));
  EXPECT_TRUE(bridge.record_check(fp, check_of(8, 1)));
  EXPECT_FALSE(bridge.record_check(fp, check_of(8, 0)));  // counted, changes nothing
  h = bridge.adapter_health();
  EXPECT_FALSE(h[0].enabled);
  EXPECT_EQ(h[0].checks, 9);
  EXPECT_EQ(h[0].window_checks, 6);
  EXPECT_DOUBLE_EQ(h[0].agreement, 30.0 / 48.0);
  EXPECT_EQ(h[0].disables, 1);
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 0);  // the written-back entries were purged

  EXPECT_FALSE(bridge.load(*tgt_, tokens));  // falls back: the target prefills itself
  BridgeStats s = bridge.stats();
  EXPECT_EQ(s.adapters_disabled, 1);
  EXPECT_EQ(s.adapters_skipped_disabled, 1);
  EXPECT_EQ(s.quality_checks, 9);
  EXPECT_EQ(s.quality_disables, 1);
  EXPECT_EQ(s.conversions, 1);
  const std::string text = bridge.metrics_text();
  const std::string labels = "{adapter=\"" + fp + "\",source=\"src\",target=\"tgt\"}";
  for (const std::string& line : std::vector<std::string>{
           "kvbridge_bridge_adapters_disabled 1\n", "kvbridge_bridge_quality_checks_total 9\n",
        "kvbridge_bridge_quality_disables_total 1\n",
        "kvbridge_bridge_adapters_skipped_disabled_total 1\n",
        "kvbridge_bridge_adapter_enabled" + labels + " 0\n",
        "kvbridge_bridge_adapter_agreement" + labels + " 0.625\n",
        "kvbridge_bridge_adapter_checks_total" + labels + " 9\n",
        "kvbridge_bridge_adapter_disables_total" + labels + " 1\n",
        "kvbridge_bridge_adapter_window_checks" + labels + " 6\n",
        "# TYPE kvbridge_bridge_adapter_kl gauge\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }

  // Re-enabled by the operator: an empty window, converting again; a bad spell from the start is
  // caught at exactly min_checks checks.
  EXPECT_TRUE(bridge.enable_adapter(fp));
  h = bridge.adapter_health();
  EXPECT_TRUE(h[0].enabled);
  EXPECT_EQ(h[0].window_checks, 0);
  EXPECT_TRUE(std::isnan(h[0].agreement));
  EXPECT_TRUE(bridge.load(*tgt_, tokens).converted());
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(bridge.record_check(fp, check_of(8, 0)));
  EXPECT_TRUE(bridge.record_check(fp, check_of(8, 0)));
  EXPECT_EQ(bridge.adapter_health()[0].disables, 2);
  EXPECT_EQ(bridge.stats().quality_disables, 2);

  // The operator can disable one too (not counted as a floor disable); unknown ones are refused.
  EXPECT_TRUE(bridge.enable_adapter(fp));
  EXPECT_TRUE(bridge.disable_adapter(fp));
  EXPECT_FALSE(bridge.adapter_health()[0].enabled);
  EXPECT_EQ(bridge.stats().quality_disables, 2);
  EXPECT_FALSE(bridge.enable_adapter("0123"));
  EXPECT_FALSE(bridge.disable_adapter("0123"));
  EXPECT_THROW(bridge.record_check("0123", check_of(8, 8)), NotFound);
  // Replacing the adapter registers it afresh (enabled, no checks).
  bridge.add_adapter(*good_, /*replace=*/true);
  EXPECT_TRUE(bridge.adapter_health()[0].enabled);
  EXPECT_EQ(bridge.adapter_health()[0].checks, 0);
}

TEST_F(BridgeTest, CheckValidation) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const std::string fp = (*good_)->fingerprint();
  EXPECT_THROW(bridge.record_check(fp, check_of(0, 0)), InvalidArgument);
  EXPECT_THROW(bridge.record_check(fp, check_of(8, 9)), InvalidArgument);
  EXPECT_THROW(bridge.record_check(fp, check_of(8, -1)), InvalidArgument);
  EXPECT_THROW(bridge.record_check(fp, check_of(8, 8, -0.5)), InvalidArgument);
  EXPECT_THROW(bridge.record_check(fp, check_of(8, 8, std::nan(""))), InvalidArgument);
  EXPECT_THROW(bridge.record_check(fp, check_of(8, 8, 0.1, 9)), InvalidArgument);
  EXPECT_THROW(bridge.record_check(fp, check_of(8, 8, 0.1, 2, INFINITY)), InvalidArgument);
  EXPECT_EQ(bridge.stats().quality_checks, 0);
  for (auto set : std::vector<void (*)(BridgeOptions&)>{
           [](BridgeOptions& o) { o.min_agreement = 1.5; },
           [](BridgeOptions& o) { o.min_agreement = -0.1; },
           [](BridgeOptions& o) { o.min_agreement = std::nan(""); },
           [](BridgeOptions& o) { o.check_window = 0; },
           [](BridgeOptions& o) { o.min_checks = 0; },
           [](BridgeOptions& o) { o.min_checks = o.check_window + 1; }}) {
    BridgeOptions o;
    set(o);
    EXPECT_THROW((Bridge{store, o}), InvalidArgument);
  }
  BridgeOptions never;
  never.min_agreement = -std::numeric_limits<double>::infinity();
  never.min_checks = 1;
  Bridge open(store, never);
  open.add_adapter(*good_);
  for (int i = 0; i < 40; ++i) EXPECT_FALSE(open.record_check(fp, check_of(8, 0)));
  EXPECT_TRUE(open.adapter_health()[0].enabled);
}

// A one-shot gate between threads: wait() blocks until open().
class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Every way to drop an adapter: after it returns, a conversion that ran before it is neither
// written back nor served, and nothing of the adapter is left in the store.
TEST_F(BridgeTest, DropBetweenConvertAndWriteBackStoresNothing) {
  const std::vector<std::pair<const char*, std::function<void(Bridge&)>>> drops = {
      {"disable", [](Bridge& b) { EXPECT_TRUE(b.disable_adapter((*good_)->fingerprint())); }},
      {"remove", [](Bridge& b) { EXPECT_TRUE(b.remove_adapter(*src_, *tgt_)); }},
      {"replace", [](Bridge& b) { b.add_adapter(fit_planted(*src_, *tgt_, 9), true); }},
      {"record_check", [](Bridge& b) {
         QualityCheck c;
         c.positions = 8;  // 0 of 8 agree: below the floor at the first check (min_checks 1)
         EXPECT_TRUE(b.record_check((*good_)->fingerprint(), c));
       }}};
  for (const auto& [name, drop] : drops) {
    SCOPED_TRACE(name);
    KVStore store(store_options());
    BridgeOptions options;
    options.min_checks = 1;
    Bridge bridge(store, options);
    bridge.add_adapter(*good_);
    const auto tokens = testing::random_tokens(53, 71);
    FloatKV src(*src_, 53);
    src.randomize(72);
    // The target's own first chunk: the load converts [16, 48) and still serves [0, 16).
    FloatKV own(*tgt_, 16);
    own.randomize(73);
    bridge.save(*src_, tokens, src.view());
    bridge.save(*tgt_, TokenSpan(tokens.data(), 16), own.view());
    int converted = 0;
    bridge.set_test_hook([&](std::string_view point) {
      if (point == "converted" && converted++ == 0) drop(bridge);
    });
    const Load load = bridge.load(*tgt_, tokens);
    bridge.set_test_hook({});
    EXPECT_EQ(converted, 1);
    EXPECT_FALSE(load.converted());
    EXPECT_EQ(load.tokens(), 16);
    EXPECT_EQ(load.native_tokens(), 16);
    EXPECT_EQ(load.adapter(), "");
    EXPECT_EQ(load_kv(load, *tgt_), dense(own.view()));
    EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 16);  // only the target's own chunk
    EXPECT_TRUE(bridge.adapter_dropped((*good_)->fingerprint()));
    const BridgeStats s = bridge.stats();
    EXPECT_EQ(s.dropped_writes, 1);
    EXPECT_EQ(s.written_back_tokens, 0);
    EXPECT_EQ(s.native_hits, 1);
    EXPECT_EQ(s.converted_hits, 0);
  }
}

// A drop that starts while a write-back of its adapter is under way waits for it, then purges.
TEST_F(BridgeTest, DropWaitsForAWriteBackUnderWay) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const std::string fp = (*good_)->fingerprint();
  const auto tokens = testing::random_tokens(40, 81);
  FloatKV src(*src_, 40);
  src.randomize(82);
  bridge.save(*src_, tokens, src.view());
  Gate writing, dropped, go;
  bridge.set_test_hook([&](std::string_view point) {
    if (point == "writing") {  // the loading thread, inside the write-back's check
      writing.open();
      go.wait();
    } else if (point == "dropped") {  // the dropping thread, before it waits and purges
      dropped.open();
    }
  });
  Load load;
  std::thread loader([&] { load = bridge.load(*tgt_, tokens); });
  writing.wait();
  std::thread dropper([&] { EXPECT_TRUE(bridge.disable_adapter(fp)); });
  dropped.wait();
  go.open();  // the write-back runs now, after the adapter was marked dropped
  loader.join();
  dropper.join();
  bridge.set_test_hook({});
  EXPECT_TRUE(load.converted());  // it passed the check before the drop
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 0);  // and the drop purged what it wrote
  EXPECT_FALSE(bridge.load(*tgt_, tokens));
}

// Entries naming a dropped adapter (another process wrote them back after the purge, or a Redis
// purge failed) are not served; a save naming it stores nothing; taking the adapter back
// serves them again.
TEST_F(BridgeTest, EntriesOfADroppedAdapterAreNotServed) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const std::string fp = (*good_)->fingerprint();
  const Provenance origin{src_->fingerprint(), fp};
  const auto tokens = testing::random_tokens(53, 91);
  FloatKV kv(*tgt_, 53);
  kv.randomize(92);
  ASSERT_TRUE(bridge.disable_adapter(fp));
  EXPECT_EQ(bridge.save(*tgt_, tokens, kv.view(), "default", origin), 0);
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 0);
  EXPECT_EQ(bridge.stats().dropped_writes, 1);
  // Written behind the bridge's back: the first chunk the target's own, the rest converted.
  store.put(*tgt_, TokenSpan(tokens.data(), 16), kv.view().slice_tokens(0, 16));
  store.put(*tgt_, tokens, kv.view(), "default", origin);
  ASSERT_EQ(store.match(*tgt_, tokens).tokens(), 48);
  const Load load = bridge.load(*tgt_, tokens);
  EXPECT_EQ(load.tokens(), 16);
  EXPECT_EQ(load.adapter(), "");
  EXPECT_EQ(bridge.stats().dropped_tokens, 32);
  // Re-enabled: served, with its provenance.
  ASSERT_TRUE(bridge.enable_adapter(fp));
  EXPECT_FALSE(bridge.adapter_dropped(fp));
  const Load again = bridge.load(*tgt_, tokens);
  EXPECT_EQ(again.tokens(), 48);
  EXPECT_EQ(again.adapter(), fp);
  EXPECT_EQ(bridge.save(*tgt_, tokens, kv.view(), "default", origin), 48);
  // Removed, and re-registered: the same.
  ASSERT_TRUE(bridge.remove_adapter(*src_, *tgt_));
  EXPECT_TRUE(bridge.adapter_dropped(fp));
  EXPECT_EQ(bridge.load(*tgt_, tokens).tokens(), 16);  // the converted chunks were purged
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 16);
  bridge.add_adapter(*good_);
  EXPECT_FALSE(bridge.adapter_dropped(fp));
}

// save refuses non-finite KV; a conversion from a non-finite source entry (put into the store
// directly) is dropped, and the load falls back to the target's own prefix.
TEST_F(BridgeTest, NonFiniteKVIsNeverStoredOrConverted) {
  KVStore store(store_options());
  Bridge bridge(store);
  bridge.add_adapter(*good_);
  const auto tokens = testing::random_tokens(53, 101);
  for (const float bad : {std::nanf(""), INFINITY}) {
    FloatKV src(*src_, 53, 2);
    src.randomize(102);
    src.at(1, 1, 37, 1, 5) = bad;
    EXPECT_THROW(bridge.save(*src_, tokens, src.view()), InvalidArgument);
    EXPECT_EQ(store.match(*src_, tokens).tokens(), 0);
  }
  EXPECT_EQ(bridge.stats().nonfinite_refused, 2);
  FloatKV src(*src_, 53);
  src.randomize(103);
  src.at(2, 0, 40, 0, 1) = std::nanf("");  // in the third chunk
  store.put(*src_, tokens, src.view());
  FloatKV own(*tgt_, 16);
  own.randomize(104);
  bridge.save(*tgt_, TokenSpan(tokens.data(), 16), own.view());
  const Load load = bridge.load(*tgt_, tokens);
  EXPECT_FALSE(load.converted());
  EXPECT_EQ(load.tokens(), 16);
  EXPECT_EQ(load_kv(load, *tgt_), dense(own.view()));
  EXPECT_EQ(store.match(*tgt_, tokens).tokens(), 16);  // nothing written back
  EXPECT_EQ(bridge.stats().nonfinite_refused, 3);
  // The finite part of the source still converts: a prompt that ends before the NaN's chunk.
  const std::vector<int64_t> head(tokens.begin(), tokens.begin() + 33);
  EXPECT_TRUE(bridge.load(*tgt_, head).converted());
}

}  // namespace
}  // namespace kvbridge
