// kvbridge store benchmarks (Google Benchmark).
//
// 1. Prefix match: KVStore::match of a prompt the store already holds in full, for prompts of
//    1k..128k tokens, with chunks of 16 tokens (vLLM's block size) and the default 256. The model
//    is tiny (1 layer, 1 kv head, head_dim 2, float32) so the time is hashing + index lookup, not
//    KV copying. The peer is a plain C++ chained SHA-256 (OpenSSL) over 16-token blocks with a
//    std::unordered_map<std::string, int> index, stopping at the first miss, in two flavours:
//    EVP_Digest per block, and one reused EVP_MD_CTX with a pre-fetched SHA256. A breakdown
//    benchmark times kvbridge's hashing alone (prefix_hashes). Every benchmark reports
//    `ns_per_16_tokens` (the console prints it with an "s" suffix; the value is nanoseconds).
//
// 2. Bandwidth: KVStore::put of one fresh chunk entry and KVStore::match + Match::copy_to of one
//    entry, for entries of 1, 4, 16, 64 MiB, against std::memcpy of the same bytes between two
//    preallocated, already-touched buffers. A diagnostic benchmark times aligned_alloc + memcpy
//    into the fresh block, the allocation pattern of put. Every benchmark reports
//    bytes_per_second.
//
// Times are CPU time of the benchmark thread (Google Benchmark's default), which is less
// sensitive than wall time to the other processes of a small, shared machine.
// benchmarks/run_benchmarks.py runs this program and prints the ratio tables.

#include <benchmark/benchmark.h>
#include <openssl/evp.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvbridge/kvbridge.h"

namespace {

using kvbridge::Device;
using kvbridge::DType;
using kvbridge::KVStore;
using kvbridge::KVView;
using kvbridge::Match;
using kvbridge::ModelSpec;
using kvbridge::StoreOptions;

constexpr int64_t kBlockTokens = 16;  // the unit every prefix-match result is normalised to
constexpr int64_t kMiB = int64_t{1} << 20;

std::vector<int64_t> random_tokens(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, 127999);  // a Llama-3-sized vocabulary
  std::vector<int64_t> t(n);
  for (auto& x : t) x = dist(rng);
  return t;
}

// Random bytes, none of them zero. Cached per size: Google Benchmark calls a benchmark function
// several times while it picks the iteration count, and filling 64 MiB each time adds up.
const std::vector<unsigned char>& random_bytes(size_t n) {
  static std::map<size_t, std::vector<unsigned char>> cache;
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  std::vector<unsigned char> bytes(n);
  std::mt19937_64 rng(0x6b766272 + n);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t word = rng() | 0x0101010101010101ull;  // every byte has its low bit set
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, n - i));
  }
  return cache.emplace(n, std::move(bytes)).first->second;
}

// Reports ns per 16 tokens. A kIsIterationInvariantRate counter with value v reports
// v * iterations / cpu_seconds; kInvert turns that into cpu_seconds / (v * iterations). With
// v = blocks_per_iteration * 1e-9 the result is nanoseconds per 16-token block.
void report_per_16_tokens(benchmark::State& state, int64_t prompt_tokens) {
  state.counters["ns_per_16_tokens"] = benchmark::Counter(
      static_cast<double>(prompt_tokens / kBlockTokens) * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetItemsProcessed(state.iterations() * prompt_tokens);  // tokens per second
}

// ---------------------------------------------------------------------------------------------
// 1. Prefix match
// ---------------------------------------------------------------------------------------------

ModelSpec tiny_spec() {
  ModelSpec s;
  s.name = "bench-tiny";
  s.num_layers = 1;
  s.num_kv_heads = 1;
  s.head_dim = 2;
  s.dtype = DType::kFloat32;
  return s;
}

// args: prompt tokens, chunk tokens. A store holding a random prompt of that many tokens (a
// tiny model: the time is hashing and lookup, not copying), timed through lookup(store, spec,
// tokens), which returns the tokens it matched.
template <class Lookup>
void time_prefix_lookup(benchmark::State& state, Lookup lookup) {
  const int64_t n = state.range(0);
  const int64_t chunk = state.range(1);
  const ModelSpec spec = tiny_spec();
  StoreOptions opt;
  opt.chunk_tokens = chunk;
  opt.capacity_bytes = int64_t{1} << 30;  // 128k tokens at chunk 16 account ~3.7 MB
  KVStore store(opt);
  const std::vector<int64_t> tokens = random_tokens(static_cast<size_t>(n), 42);
  const std::vector<unsigned char>& kv_bytes =
      random_bytes(static_cast<size_t>(spec.kv_bytes_per_token() * n));
  const KVView kv = KVView::contiguous(const_cast<unsigned char*>(kv_bytes.data()), spec.dtype,
                                       Device{}, spec.num_layers, n, spec.num_kv_heads,
                                       spec.head_dim);
  if (store.put(spec, tokens, kv) != n) {
    state.SkipWithError("put did not store the whole prompt");
    return;
  }
  for (auto _ : state) {
    const int64_t matched = lookup(store, spec, tokens);
    if (matched != n) {
      state.SkipWithError("the lookup did not match the whole prompt");
      break;
    }
    benchmark::DoNotOptimize(matched);
  }
  report_per_16_tokens(state, n);
}

// KVStore::match: pins the prefix's entries (released when the Match goes, also timed).
void BM_KVStoreMatch(benchmark::State& state) {
  time_prefix_lookup(state, [](KVStore& store, const ModelSpec& spec,
                               const std::vector<int64_t>& tokens) {
    return store.match(spec, tokens).tokens();
  });
}

// KVStore::match_length: the same walk without pinning, what KVStore.match(return_kv=False)
// runs from Python.
void BM_KVStoreMatchLength(benchmark::State& state) {
  time_prefix_lookup(state, [](KVStore& store, const ModelSpec& spec,
                               const std::vector<int64_t>& tokens) {
    return store.match_length(spec, tokens).tokens;
  });
}

// Breakdown, not a peer: the hashing part of KVStore::match alone (prefix_salt + prefix_hashes,
// which also run check_tokens), no index lookup. match minus this is lookup + pinning.
void BM_PrefixHashesOnly(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int64_t chunk = state.range(1);
  const ModelSpec spec = tiny_spec();
  const std::vector<int64_t> tokens = random_tokens(static_cast<size_t>(n), 42);
  for (auto _ : state) {
    const kvbridge::Hash128 salt = kvbridge::prefix_salt("default", spec);
    std::vector<kvbridge::Hash128> h = kvbridge::prefix_hashes(salt, tokens, chunk);
    benchmark::DoNotOptimize(h.data());
  }
  report_per_16_tokens(state, n);
}

// The peer: SHA-256 over (previous 32-byte digest || the block's 16 token ids as u32
// little-endian), one digest per 16-token block, each looked up in an unordered_map keyed by the
// digest's 32 bytes, stopping at the first miss. The first block's parent is SHA-256("").
struct Sha256Chain {
  enum class Mode { kOneShot, kReusedContext };

  explicit Sha256Chain(Mode m) : mode(m) {
    md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    ctx = EVP_MD_CTX_new();
    unsigned int len = 0;
    EVP_Digest("", 0, seed, &len, EVP_sha256(), nullptr);
  }
  ~Sha256Chain() {
    EVP_MD_CTX_free(ctx);
    EVP_MD_free(md);
  }
  Sha256Chain(const Sha256Chain&) = delete;
  Sha256Chain& operator=(const Sha256Chain&) = delete;

  // digest <- SHA-256(digest || u32le(block[0..16))). `digest` is read before it is written.
  void step(unsigned char digest[32], const int64_t* block) {
    unsigned char buf[32 + 4 * kBlockTokens];
    std::memcpy(buf, digest, 32);
    for (int64_t i = 0; i < kBlockTokens; ++i) {
      const uint32_t t = static_cast<uint32_t>(block[i]);
      buf[32 + 4 * i + 0] = static_cast<unsigned char>(t);
      buf[32 + 4 * i + 1] = static_cast<unsigned char>(t >> 8);
      buf[32 + 4 * i + 2] = static_cast<unsigned char>(t >> 16);
      buf[32 + 4 * i + 3] = static_cast<unsigned char>(t >> 24);
    }
    unsigned int len = 0;
    if (mode == Mode::kOneShot) {
      // EVP_Digest: a context per call and the default-provider lookup of EVP_sha256().
      EVP_Digest(buf, sizeof buf, digest, &len, EVP_sha256(), nullptr);
    } else {
      // One context, re-initialised per block, with an explicitly fetched SHA256: the cheapest
      // way through EVP.
      EVP_DigestInit_ex2(ctx, md, nullptr);
      EVP_DigestUpdate(ctx, buf, sizeof buf);
      EVP_DigestFinal_ex(ctx, digest, &len);
    }
  }

  void insert_all(const std::vector<int64_t>& tokens) {
    unsigned char d[32];
    std::memcpy(d, seed, 32);
    const int64_t blocks = static_cast<int64_t>(tokens.size()) / kBlockTokens;
    for (int64_t b = 0; b < blocks; ++b) {
      step(d, tokens.data() + b * kBlockTokens);
      index.emplace(std::string(reinterpret_cast<const char*>(d), 32), static_cast<int>(b));
    }
  }

  // Matched prefix length in tokens.
  int64_t match(const std::vector<int64_t>& tokens) {
    unsigned char d[32];
    std::memcpy(d, seed, 32);
    const int64_t blocks = static_cast<int64_t>(tokens.size()) / kBlockTokens;
    int64_t hit = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      step(d, tokens.data() + b * kBlockTokens);
      auto it = index.find(std::string(reinterpret_cast<const char*>(d), 32));
      if (it == index.end()) break;
      benchmark::DoNotOptimize(it->second);
      ++hit;
    }
    return hit * kBlockTokens;
  }

  Mode mode;
  EVP_MD* md = nullptr;
  EVP_MD_CTX* ctx = nullptr;
  unsigned char seed[32];
  std::unordered_map<std::string, int> index;
};

template <Sha256Chain::Mode kMode>
void BM_Sha256ChainMatch(benchmark::State& state) {
  const int64_t n = state.range(0);
  const std::vector<int64_t> tokens = random_tokens(static_cast<size_t>(n), 42);
  Sha256Chain chain(kMode);
  if (!chain.md || !chain.ctx) {
    state.SkipWithError("OpenSSL: SHA256 unavailable");
    return;
  }
  chain.insert_all(tokens);
  for (auto _ : state) {
    const int64_t hit = chain.match(tokens);
    if (hit != n) {
      state.SkipWithError("sha256 chain did not match the whole prompt");
      break;
    }
    benchmark::DoNotOptimize(hit);
  }
  report_per_16_tokens(state, n);
}

void PromptArgs(benchmark::internal::Benchmark* b, bool with_chunk) {
  for (int64_t n : {1024, 8192, 32768, 131072}) {
    if (with_chunk) {
      b->Args({n, 16});
      b->Args({n, 256});
    } else {
      b->Args({n});
    }
  }
}

BENCHMARK(BM_KVStoreMatch)
    ->ArgNames({"tokens", "chunk"})
    ->Apply([](benchmark::internal::Benchmark* b) { PromptArgs(b, true); });
BENCHMARK(BM_KVStoreMatchLength)
    ->ArgNames({"tokens", "chunk"})
    ->Apply([](benchmark::internal::Benchmark* b) { PromptArgs(b, true); });
BENCHMARK(BM_PrefixHashesOnly)
    ->ArgNames({"tokens", "chunk"})
    ->Apply([](benchmark::internal::Benchmark* b) { PromptArgs(b, true); });
BENCHMARK_TEMPLATE(BM_Sha256ChainMatch, Sha256Chain::Mode::kOneShot)
    ->Name("BM_Sha256ChainMatch_EVPDigest")
    ->ArgNames({"tokens"})
    ->Apply([](benchmark::internal::Benchmark* b) { PromptArgs(b, false); });
BENCHMARK_TEMPLATE(BM_Sha256ChainMatch, Sha256Chain::Mode::kReusedContext)
    ->Name("BM_Sha256ChainMatch_ReusedCtx")
    ->ArgNames({"tokens"})
    ->Apply([](benchmark::internal::Benchmark* b) { PromptArgs(b, false); });

// ---------------------------------------------------------------------------------------------
// 2. Put / match bandwidth vs memcpy
// ---------------------------------------------------------------------------------------------

// Minor page faults of this thread so far. Reported per iteration as `page_faults`: a fresh
// allocation the kernel maps on first touch costs one fault per 4 KiB page.
int64_t minor_faults() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return ru.ru_minflt;
}

void report_faults(benchmark::State& state, int64_t faults_before) {
  state.counters["page_faults"] = benchmark::Counter(
      static_cast<double>(minor_faults() - faults_before), benchmark::Counter::kAvgIterations);
}

// 1 layer x 8 kv heads x head_dim 128, bfloat16: K + V = 4 KiB per token, so an entry of
// `bytes` bytes is a chunk of bytes / 4 KiB tokens.
ModelSpec bandwidth_spec() {
  ModelSpec s;
  s.name = "bench-bandwidth";
  s.num_layers = 1;
  s.num_kv_heads = 8;
  s.head_dim = 128;
  s.dtype = DType::kBFloat16;
  return s;
}

struct BandwidthSetup {
  explicit BandwidthSetup(int64_t bytes)
      : spec(bandwidth_spec()),
        chunk(bytes / bandwidth_spec().kv_bytes_per_token()),
        tokens(random_tokens(static_cast<size_t>(chunk), 7)),
        src(random_bytes(static_cast<size_t>(bytes))),
        src_view(KVView::contiguous(const_cast<unsigned char*>(src.data()), spec.dtype, Device{},
                                    spec.num_layers, chunk, spec.num_kv_heads, spec.head_dim)) {}

  StoreOptions options() const {
    StoreOptions o;
    o.chunk_tokens = chunk;
    o.capacity_bytes = 2 * static_cast<int64_t>(src.size()) + 16 * kMiB;  // one entry fits
    return o;
  }

  ModelSpec spec;
  int64_t chunk;
  std::vector<int64_t> tokens;
  const std::vector<unsigned char>& src;
  KVView src_view;
};

// Put of a fresh entry per iteration. The erase that makes the next put fresh runs with the
// timer paused, so it is not counted. The put includes the entry's allocation (and, for entries
// the allocator maps fresh from the kernel, the page faults of first touching it).
void BM_StorePut(benchmark::State& state) {
  const int64_t bytes = state.range(0) * kMiB;
  BandwidthSetup b(bytes);
  KVStore store(b.options());
  const int64_t faults = minor_faults();
  for (auto _ : state) {
    const int64_t stored = store.put(b.spec, b.tokens, b.src_view);
    if (stored != b.chunk) {
      state.SkipWithError("put did not store the entry");
      break;
    }
    state.PauseTiming();
    if (store.erase(b.spec, b.tokens) != 1) state.SkipWithError("erase did not remove the entry");
    state.ResumeTiming();
  }
  report_faults(state, faults);
  state.SetBytesProcessed(state.iterations() * bytes);
}

// Match of the stored entry + Match::copy_to into a preallocated, already-touched dense buffer.
void BM_StoreMatchCopy(benchmark::State& state) {
  const int64_t bytes = state.range(0) * kMiB;
  BandwidthSetup b(bytes);
  KVStore store(b.options());
  if (store.put(b.spec, b.tokens, b.src_view) != b.chunk) {
    state.SkipWithError("put did not store the entry");
    return;
  }
  std::vector<unsigned char> dst(static_cast<size_t>(bytes), 0x5a);
  const KVView dst_view = KVView::contiguous(dst.data(), b.spec.dtype, Device{},
                                             b.spec.num_layers, b.chunk, b.spec.num_kv_heads,
                                             b.spec.head_dim);
  const int64_t faults = minor_faults();
  for (auto _ : state) {
    Match m = store.match(b.spec, b.tokens);
    if (m.tokens() != b.chunk) {
      state.SkipWithError("match did not return the entry");
      break;
    }
    m.copy_to(dst_view);
    benchmark::ClobberMemory();
  }
  if (std::memcmp(dst.data(), b.src.data(), dst.size()) != 0) {
    state.SkipWithError("copied bytes differ from the stored ones");
  }
  report_faults(state, faults);
  state.SetBytesProcessed(state.iterations() * bytes);
}

// The baseline: memcpy between two preallocated, already-touched buffers.
void BM_Memcpy(benchmark::State& state) {
  const int64_t bytes = state.range(0) * kMiB;
  const std::vector<unsigned char>& src = random_bytes(static_cast<size_t>(bytes));
  std::vector<unsigned char> dst(static_cast<size_t>(bytes), 0x5a);
  const int64_t faults = minor_faults();
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), dst.size());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  report_faults(state, faults);
  state.SetBytesProcessed(state.iterations() * bytes);
}

// Diagnostic, not a baseline: aligned_alloc + memcpy into the fresh block, the free paused as
// put's erase is. Shows what a fresh allocation costs on its own.
void BM_AllocMemcpy(benchmark::State& state) {
  const int64_t bytes = state.range(0) * kMiB;
  const std::vector<unsigned char>& src = random_bytes(static_cast<size_t>(bytes));
  const int64_t faults = minor_faults();
  for (auto _ : state) {
    void* p = std::aligned_alloc(64, static_cast<size_t>(bytes));
    if (!p) {
      state.SkipWithError("aligned_alloc failed");
      break;
    }
    std::memcpy(p, src.data(), src.size());
    benchmark::DoNotOptimize(p);
    benchmark::ClobberMemory();
    state.PauseTiming();
    std::free(p);
    state.ResumeTiming();
  }
  report_faults(state, faults);
  state.SetBytesProcessed(state.iterations() * bytes);
}

void SizeArgs(benchmark::internal::Benchmark* b) {
  b->ArgName("MiB");
  for (int64_t mib : {1, 4, 16, 64}) b->Arg(mib);
}

BENCHMARK(BM_Memcpy)->Apply(SizeArgs);
BENCHMARK(BM_StorePut)->Apply(SizeArgs);
BENCHMARK(BM_StoreMatchCopy)->Apply(SizeArgs);
BENCHMARK(BM_AllocMemcpy)->Apply(SizeArgs);

}  // namespace

BENCHMARK_MAIN();
