// Model A saves a prompt's KV cache; model B loads it through a fitted A -> B adapter, then loads
// it again as its own (written back). The models are synthetic: B's KV is a planted linear map
// of A's in position-free space, with each model's RoPE applied to its keys.
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include <kvbridge/kvbridge.h>

namespace {

kvbridge::ModelSpec make_spec(const char* name, int64_t layers, int64_t heads, int64_t dim,
                              double rope_base) {
  kvbridge::ModelSpec s;
  s.name = name;
  s.tokenizer = "example-tokenizer";  // cross-model reuse needs the same tokenizer
  s.num_layers = layers;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.dtype = kvbridge::DType::kFloat32;
  s.rope_base = rope_base;  // half-split RoPE, no scaling
  return s;
}

// Dense canonical KV [layers, 2, tokens, heads, dim] in float32.
struct KV {
  kvbridge::ModelSpec spec;
  int64_t tokens;
  std::vector<float> data;
  KV(const kvbridge::ModelSpec& s, int64_t t)
      : spec(s), tokens(t), data(static_cast<size_t>(2 * s.num_layers * t * s.num_kv_heads *
                                                     s.head_dim)) {}
  float* row(int64_t layer, int kind, int64_t t) {
    return data.data() + ((2 * layer + kind) * tokens + t) * spec.num_kv_heads * spec.head_dim;
  }
  kvbridge::KVView view() {
    return kvbridge::KVView::contiguous(data.data(), spec.dtype, {}, spec.num_layers, tokens,
                                        spec.num_kv_heads, spec.head_dim);
  }
  // Rotates every key with the spec's RoPE at absolute positions start_pos + t.
  void rotate_keys(int64_t start_pos) {
    const int64_t d = spec.head_dim, half = d / 2;
    for (int64_t l = 0; l < spec.num_layers; ++l)
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < spec.num_kv_heads; ++h) {
          float* x = row(l, 0, t) + h * d;
          for (int64_t i = 0; i < half; ++i) {
            const double angle = static_cast<double>(start_pos + t) *
                                 std::pow(spec.rope_base, -2.0 * static_cast<double>(i) / d);
            const double a = x[i], b = x[i + half];
            x[i] = static_cast<float>(a * std::cos(angle) - b * std::sin(angle));
            x[i + half] = static_cast<float>(b * std::cos(angle) + a * std::sin(angle));
          }
        }
  }
};

// A's and B's caches for `tokens` tokens at start_pos; B's values and un-rotated keys are
// weights * (A's un-rotated keys and values of every layer) + 0.1.
void planted_pair(const std::vector<float>& weights, int64_t start_pos, std::mt19937& rng, KV& a,
                  KV& b) {
  std::normal_distribution<float> normal;
  for (float& v : a.data) v = normal(rng);
  const int64_t a_width = a.spec.num_kv_heads * a.spec.head_dim;
  const int64_t b_width = b.spec.num_kv_heads * b.spec.head_dim;
  const int64_t features = 2 * a.spec.num_layers * a_width;
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int64_t j = 0; j < b.spec.num_layers; ++j)
      for (int kind = 0; kind < 2; ++kind)
        for (int64_t o = 0; o < b_width; ++o) {
          const float* w = &weights[static_cast<size_t>((2 * j + kind) * features * b_width)];
          double acc = 0.1;
          for (int64_t f = 0; f < features; ++f)
            acc += a.row(f / (2 * a_width), static_cast<int>(f / a_width % 2), t)[f % a_width] *
                   w[f * b_width + o];
          b.row(j, kind, t)[o] = static_cast<float>(acc);
        }
  a.rotate_keys(start_pos);
  b.rotate_keys(start_pos);
}

}  // namespace

int main() {
  const kvbridge::ModelSpec model_a = make_spec("model-a", 3, 2, 16, 10000.0);
  const kvbridge::ModelSpec model_b = make_spec("model-b", 2, 1, 32, 500000.0);

  // Calibration: the same tokens through both models (here: the planted pair).
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 0.1f);
  std::vector<float> weights(static_cast<size_t>(2 * 2 * (2 * 3 * 32) * 32));
  for (float& w : weights) w = normal(rng);
  kvbridge::AdapterFitter fitter(model_a, model_b);
  for (int64_t start = 0; start < 1200; start += 300) {
    KV a(model_a, 150), b(model_b, 150);
    planted_pair(weights, start, rng, a, b);
    fitter.add(a.view(), b.view(), start);
  }
  auto adapter = std::make_shared<const kvbridge::LinearAdapter>(fitter.fit());

  kvbridge::StoreOptions store_options;
  store_options.capacity_bytes = 64 << 20;
  store_options.chunk_tokens = 64;
  kvbridge::KVStore store(store_options);
  kvbridge::BridgeOptions bridge_options;
  bridge_options.min_quality = 0.9;
  kvbridge::Bridge bridge(store, bridge_options);
  bridge.add_adapter(adapter);

  // Model A prefills a 300-token prompt and saves its cache (the 256 tokens of whole chunks).
  std::vector<int64_t> prompt(300);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int64_t>((i * 7919) % 32000);
  KV a_kv(model_a, 300), b_own(model_b, 300);
  planted_pair(weights, 0, rng, a_kv, b_own);
  bridge.save(model_a, prompt, a_kv.view());

  // Model B gets the same prompt: A's cache, converted.
  const kvbridge::Load first = bridge.load(model_b, prompt);
  KV got(model_b, first.tokens());
  first.copy_to(got.view());
  double err = 0, ref = 0;
  for (int64_t l = 0; l < model_b.num_layers; ++l)
    for (int kind = 0; kind < 2; ++kind)
      for (int64_t t = 0; t < got.tokens; ++t)
        for (int64_t i = 0; i < model_b.num_kv_heads * model_b.head_dim; ++i) {
          const double diff = got.row(l, kind, t)[i] - b_own.row(l, kind, t)[i];
          err += diff * diff;
          ref += static_cast<double>(b_own.row(l, kind, t)[i]) * b_own.row(l, kind, t)[i];
        }
  const double rel_err = std::sqrt(err / ref);
  std::printf("load 1: %lld tokens from %s, converted=%d, adapter quality %.6f, "
              "relative error vs B's own KV %.2e\n",
              static_cast<long long>(first.tokens()), first.source().c_str(), first.converted(),
              first.quality(), rel_err);

  // Written back: the second load is B's own cache.
  const kvbridge::Load second = bridge.load(model_b, prompt);
  std::printf("load 2: %lld tokens from %s, converted=%d\n",
              static_cast<long long>(second.tokens()), second.source().c_str(),
              second.converted());
  const kvbridge::BridgeStats stats = bridge.stats();
  std::printf("stats: native_hits=%lld converted_hits=%lld conversions=%lld\n",
              static_cast<long long>(stats.native_hits),
              static_cast<long long>(stats.converted_hits),
              static_cast<long long>(stats.conversions));
  const bool ok = first.converted() && first.tokens() == 256 && rel_err < 1e-3 &&
                  !second.converted() && second.tokens() == 256 && stats.native_hits == 1 &&
                  stats.converted_hits == 1;
  return ok ? 0 : 1;
}
