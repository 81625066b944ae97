// Helpers shared by the C++ tests: seeded random KV in a chosen layout.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "kvbridge/kvbridge.h"

namespace kvbridge::testing {

inline ModelSpec small_spec(DType dtype = DType::kFloat32, int64_t layers = 3, int64_t heads = 2,
                            int64_t dim = 6) {
  ModelSpec s;
  s.name = "test-model";
  s.num_layers = layers;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.dtype = dtype;
  return s;
}

inline std::vector<int64_t> random_tokens(size_t n, uint64_t seed, int64_t vocab = 50000) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, vocab - 1);
  std::vector<int64_t> t(n);
  for (auto& x : t) x = dist(rng);
  return t;
}

/// Random bytes (never all zero) in a dense canonical buffer for `tokens` tokens of `spec`.
struct DenseKV {
  std::vector<unsigned char> bytes;
  KVView view;
  DenseKV(const ModelSpec& spec, int64_t tokens, uint64_t seed)
      : bytes(static_cast<size_t>(spec.kv_bytes_per_token() * tokens)) {
    std::mt19937_64 rng(seed);
    for (size_t i = 0; i < bytes.size(); i += 8) {
      const uint64_t word = rng() | 0x0101010101010101ull;  // no zero byte
      std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, bytes.size() - i));
    }
    view = KVView::contiguous(bytes.data(), spec.dtype, Device{}, spec.num_layers, tokens,
                              spec.num_kv_heads, spec.head_dim);
  }
};

/// Hugging Face layout [1, heads, tokens, dim] per layer, with an optional gap of `pad` elements
/// after each token row to make the views non-contiguous.
struct HFKV {
  std::vector<std::vector<unsigned char>> storage;  // 2 per layer
  std::vector<TensorView> keys, values;
  HFKV(const ModelSpec& spec, int64_t tokens, int64_t pad, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int64_t es = static_cast<int64_t>(dtype_size(spec.dtype));
    const int64_t row = spec.head_dim + pad;
    for (int64_t l = 0; l < 2 * spec.num_layers; ++l) {
      storage.emplace_back(static_cast<size_t>(spec.num_kv_heads * tokens * row * es));
      for (auto& b : storage.back()) b = static_cast<unsigned char>(rng() | 1);
      TensorView t;
      t.data = storage.back().data();
      t.dtype = spec.dtype;
      t.shape = {1, spec.num_kv_heads, tokens, spec.head_dim};
      t.strides = {spec.num_kv_heads * tokens * row, tokens * row, row, 1};
      (l % 2 == 0 ? keys : values).push_back(t);
    }
  }
  KVView view() const { return KVView::from_hf_layers(keys, values); }
};

/// Element-by-element comparison of two views (bytes of each element), the reference for the
/// memcpy fast paths.
inline bool same_elements(const KVView& a, const KVView& b) {
  if (a.num_layers() != b.num_layers() || a.tokens() != b.tokens() ||
      a.kv_heads() != b.kv_heads() || a.head_dim() != b.head_dim() || a.dtype() != b.dtype())
    return false;
  const int64_t es = static_cast<int64_t>(dtype_size(a.dtype()));
  for (int64_t l = 0; l < a.num_layers(); ++l)
    for (int k = 0; k < 2; ++k) {
      const KVPlane& pa = a.plane(l, static_cast<KVView::Kind>(k));
      const KVPlane& pb = b.plane(l, static_cast<KVView::Kind>(k));
      for (int64_t t = 0; t < a.tokens(); ++t)
        for (int64_t h = 0; h < a.kv_heads(); ++h)
          for (int64_t d = 0; d < a.head_dim(); ++d) {
            const char* ea = static_cast<const char*>(pa.data) +
                             (t * pa.token_stride + h * pa.head_stride + d * pa.dim_stride) * es;
            const char* eb = static_cast<const char*>(pb.data) +
                             (t * pb.token_stride + h * pb.head_stride + d * pb.dim_stride) * es;
            if (std::memcmp(ea, eb, static_cast<size_t>(es)) != 0) return false;
          }
    }
  return true;
}

/// What the multi-process tests and their helper program (store_helper.cpp) agree on: 1 MiB
/// chunk entries (bfloat16, 8 layers x 4 heads x 128, 64-token chunks), 4-chunk prompts whose
/// tokens and KV bytes are functions of a seed.
constexpr int64_t kHelperChunk = 64;
constexpr int64_t kHelperTokens = 4 * kHelperChunk;
inline ModelSpec helper_spec() {
  ModelSpec s = small_spec(DType::kBFloat16, 8, 4, 128);
  s.name = "helper-model";
  return s;
}
inline std::vector<int64_t> helper_tokens(uint64_t seed) {
  return random_tokens(kHelperTokens, seed);
}
/// A store of helper prompts on a disk directory (16 MiB of memory, no fsync).
inline StoreOptions helper_disk_options(const std::string& dir) {
  StoreOptions o;
  o.chunk_tokens = kHelperChunk;
  o.capacity_bytes = int64_t{16} << 20;
  o.disk.dir = dir;
  o.disk.fsync = false;
  return o;
}

// The shared-directory tests (test_store_shared.cpp and their helper processes): small entries
// (8 KiB payload, 12 KiB file blocks) so four processes churn a budget of a few dozen files.
constexpr int64_t kSharedChunk = 16;
constexpr int64_t kSharedTokens = 4 * kSharedChunk;
constexpr int64_t kSharedFileBlocks = 12288;  // 160 + 4*16 + 8192 + 16 bytes, in 4 KiB blocks
inline ModelSpec shared_spec(int model) {
  ModelSpec s = small_spec(DType::kFloat32, 2, 2, 16);
  s.name = "shared-model-" + std::to_string(model);
  return s;
}
/// Prompt `seed`'s tokens; its KV is DenseKV(shared_spec(m), kSharedTokens, seed).
inline std::vector<int64_t> shared_tokens(uint64_t seed) {
  return random_tokens(kSharedTokens, 7919 * seed + 1);
}
inline StoreOptions shared_options(const std::string& dir, int64_t disk_capacity) {
  StoreOptions o;
  o.chunk_tokens = kSharedChunk;
  o.capacity_bytes = int64_t{1} << 20;
  o.num_shards = 2;
  o.disk.dir = dir;
  o.disk.capacity_bytes = disk_capacity;
  o.disk.fsync = false;
  return o;
}
/// Matches prompt `seed` of `model` with nothing in memory: -1 when a hit differs from what was
/// put (any byte), else the tokens matched.
inline int64_t match_exact(KVStore& store, int model, uint64_t seed) {
  store.clear(kMemoryTier);
  const ModelSpec spec = shared_spec(model);
  Match m = store.match(spec, shared_tokens(seed));
  if (m.tokens() == 0) return 0;
  DenseKV expect(spec, kSharedTokens, seed);
  DenseKV out(spec, m.tokens(), seed + 1);
  m.copy_to(out.view);
  return same_elements(out.view, expect.view.slice_tokens(0, m.tokens())) ? m.tokens() : -1;
}

/// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/kvbridge-test-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (!::mkdtemp(buf.data())) std::abort();
    path = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

/// Files under `dir` (recursively) whose name ends with `suffix`.
inline std::vector<std::string> files_with_suffix(const std::string& dir, const std::string& suffix) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    const std::string p = it->path().string();
    if (it->is_regular_file() && p.size() >= suffix.size() &&
        p.compare(p.size() - suffix.size(), suffix.size(), suffix) == 0)
      out.push_back(p);
  }
  return out;
}

}  // namespace kvbridge::testing
