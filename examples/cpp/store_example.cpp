// Saves one prompt's KV cache and matches a longer prompt against it, checking the bytes.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <kvbridge/kvbridge.h>

int main() {
  kvbridge::ModelSpec spec;
  spec.name = "example-model";
  spec.num_layers = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.dtype = kvbridge::DType::kBFloat16;

  kvbridge::StoreOptions options;
  options.capacity_bytes = 64 << 20;
  options.chunk_tokens = 128;
  kvbridge::KVStore store(options);

  const int64_t prompt_tokens = 1000;
  std::vector<int64_t> tokens(prompt_tokens);
  for (int64_t i = 0; i < prompt_tokens; ++i) tokens[i] = (i * 7919) % 32000;
  std::vector<unsigned char> kv(static_cast<size_t>(spec.kv_bytes_per_token() * prompt_tokens));
  std::mt19937 rng(1);
  for (auto& b : kv) b = static_cast<unsigned char>(rng() | 1);
  const auto view = kvbridge::KVView::contiguous(kv.data(), spec.dtype, {}, spec.num_layers,
                                                 prompt_tokens, spec.num_kv_heads, spec.head_dim);
  const int64_t stored = store.put(spec, tokens, view);

  std::vector<int64_t> query = tokens;
  query.insert(query.end(), {1, 2, 3});
  kvbridge::Match match = store.match(spec, query);
  std::vector<unsigned char> out(static_cast<size_t>(spec.kv_bytes_per_token() * match.tokens()));
  match.copy_to(kvbridge::KVView::contiguous(out.data(), spec.dtype, {}, spec.num_layers,
                                             match.tokens(), spec.num_kv_heads, spec.head_dim));
  // Layer 0's K plane is the first chunk of both buffers' canonical layout.
  const size_t plane = static_cast<size_t>(match.tokens() * spec.num_kv_heads * spec.head_dim * 2);
  const bool same = std::memcmp(out.data(), kv.data(), plane) == 0;
  std::printf("kvbridge %s: stored %lld of %lld tokens, matched %lld, bytes %s\n",
              kvbridge::version(), static_cast<long long>(stored),
              static_cast<long long>(prompt_tokens), static_cast<long long>(match.tokens()),
              same ? "identical" : "DIFFER");
  return same && match.tokens() == stored && stored == 896 ? 0 : 1;
}
