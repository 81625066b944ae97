// Helper program of the multi-process store tests (test_store_faults.cpp, test_store_redis.cpp,
// test_store_shared.cpp):
//
//   kvbridge_store_helper disk-writer DIR FIRST_SEED
//       puts helper prompts FIRST_SEED, FIRST_SEED + 1, ... into a disk store at DIR forever
//       (fsync on), printing "wrote SEED" after each put returns.
//   kvbridge_store_helper put URL PREFIX NAMESPACE SEED
//       puts one helper prompt through a store whose only lower tier is Redis; prints
//       "stored TOKENS" and exits 0 when every chunk reached Redis.
//   kvbridge_store_helper match URL PREFIX NAMESPACE SEED
//       matches it in a fresh store (empty memory, Redis only); prints
//       "tokens N exact 0|1 redis_hits H" and exits 0 when all of it came back byte-exact.
//   kvbridge_store_helper disk-mixed DIR SEED MILLIS DISK_CAPACITY
//       for MILLIS ms, random puts, matches (memory emptied first, so hits come from disk),
//       erases and invalidates of shared_spec(0) / (1) prompts 0..29 on a disk store at DIR;
//       prints "ops N hits H wrong W corrupt C errors E" and exits 0 when no hit differed
//       from what was put and no file failed validation or reading.
//   kvbridge_store_helper disk-churn DIR SEED MILLIS
//       for MILLIS ms, puts shared_spec(0) prompts 0..15 and invalidates that model every few
//       puts; prints "puts P invalidated I errors E write_failures F".
//   kvbridge_store_helper disk-reader DIR MILLIS
//       for MILLIS ms, matches shared_spec(0) prompts 0..15 (a hit must be exact) and
//       shared_spec(1) prompts 100..103 (must be whole hits); prints
//       "reads N hits0 H wrong W misses1 M" and exits 0 when W = M = 0.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "test_util.h"

using namespace kvbridge;

namespace {

StoreOptions redis_options(const std::string& url, const std::string& prefix) {
  StoreOptions o;
  o.chunk_tokens = testing::kHelperChunk;
  o.capacity_bytes = int64_t{64} << 20;
  o.redis.url = url;
  o.redis.key_prefix = prefix;
  return o;
}

bool before(std::chrono::steady_clock::time_point deadline) {
  return std::chrono::steady_clock::now() < deadline;
}

std::chrono::steady_clock::time_point after_ms(const char* ms) {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(std::atoll(ms));
}

int disk_mixed(const std::string& dir, uint64_t seed, const char* ms, int64_t capacity) {
  KVStore store(testing::shared_options(dir, capacity));
  std::mt19937_64 rng(seed);
  const auto deadline = after_ms(ms);
  int64_t ops = 0, hits = 0, wrong = 0;
  while (before(deadline)) {
    ++ops;
    const uint64_t prompt = rng() % 30;
    const int model = static_cast<int>(prompt % 2);
    const ModelSpec spec = testing::shared_spec(model);
    const unsigned op = static_cast<unsigned>(rng() % 100);
    if (op < 45) {
      testing::DenseKV kv(spec, testing::kSharedTokens, prompt);
      store.put(spec, testing::shared_tokens(prompt), kv.view);
    } else if (op < 90) {
      const int64_t got = testing::match_exact(store, model, prompt);
      wrong += got < 0;
      hits += got > 0;
    } else if (op < 97) {
      store.erase(spec, testing::shared_tokens(prompt), "default", kDiskTier);
    } else {
      store.invalidate(testing::shared_spec(1));
    }
  }
  const StoreStats st = store.stats();
  std::printf("ops %lld hits %lld wrong %lld corrupt %lld errors %lld\n",
              static_cast<long long>(ops), static_cast<long long>(hits),
              static_cast<long long>(wrong), static_cast<long long>(st.disk.corrupt),
              static_cast<long long>(st.disk.errors));
  return wrong == 0 && st.disk.corrupt == 0 && st.disk.errors == 0 ? 0 : 1;
}

int disk_churn(const std::string& dir, uint64_t seed, const char* ms) {
  KVStore store(testing::shared_options(dir, int64_t{64} << 20));
  std::mt19937_64 rng(seed);
  const ModelSpec spec = testing::shared_spec(0);
  const auto deadline = after_ms(ms);
  int64_t puts = 0, invalidated = 0;
  while (before(deadline)) {
    const uint64_t prompt = rng() % 16;
    testing::DenseKV kv(spec, testing::kSharedTokens, prompt);
    store.put(spec, testing::shared_tokens(prompt), kv.view);
    ++puts;
    if (rng() % 4 == 0) invalidated += store.invalidate(spec).disk;
  }
  const StoreStats st = store.stats();
  std::printf("puts %lld invalidated %lld errors %lld write_failures %lld\n",
              static_cast<long long>(puts), static_cast<long long>(invalidated),
              static_cast<long long>(st.disk.errors),
              static_cast<long long>(st.disk.write_failures));
  return st.disk.errors == 0 && st.disk.write_failures == 0 ? 0 : 1;
}

int disk_reader(const std::string& dir, const char* ms) {
  KVStore store(testing::shared_options(dir, int64_t{64} << 20));
  std::mt19937_64 rng(99);
  const auto deadline = after_ms(ms);
  int64_t reads = 0, hits0 = 0, wrong = 0, misses1 = 0;
  while (before(deadline)) {
    ++reads;
    const int64_t got0 = testing::match_exact(store, 0, rng() % 16);
    wrong += got0 < 0;
    hits0 += got0 > 0;
    const int64_t got1 = testing::match_exact(store, 1, 100 + rng() % 4);
    wrong += got1 < 0;
    misses1 += got1 != testing::kSharedTokens;
  }
  std::printf("reads %lld hits0 %lld wrong %lld misses1 %lld\n", static_cast<long long>(reads),
              static_cast<long long>(hits0), static_cast<long long>(wrong),
              static_cast<long long>(misses1));
  return wrong == 0 && misses1 == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const ModelSpec spec = testing::helper_spec();
  try {
    if (mode == "disk-writer" && argc == 4) {
      StoreOptions o = testing::helper_disk_options(argv[2]);
      o.disk.fsync = true;
      KVStore store(o);
      for (uint64_t seed = std::strtoull(argv[3], nullptr, 10);; ++seed) {
        const auto tokens = testing::helper_tokens(seed);
        testing::DenseKV kv(spec, testing::kHelperTokens, seed);
        store.put(spec, tokens, kv.view);
        store.clear(kMemoryTier);
        std::printf("wrote %llu\n", static_cast<unsigned long long>(seed));
        std::fflush(stdout);
      }
    }
    if (mode == "disk-mixed" && argc == 6)
      return disk_mixed(argv[2], std::strtoull(argv[3], nullptr, 10), argv[4],
                        std::atoll(argv[5]));
    if (mode == "disk-churn" && argc == 5)
      return disk_churn(argv[2], std::strtoull(argv[3], nullptr, 10), argv[4]);
    if (mode == "disk-reader" && argc == 4) return disk_reader(argv[2], argv[3]);
    if ((mode == "put" || mode == "match") && argc == 6) {
      KVStore store(redis_options(argv[2], argv[3]));
      const uint64_t seed = std::strtoull(argv[5], nullptr, 10);
      const auto tokens = testing::helper_tokens(seed);
      testing::DenseKV kv(spec, testing::kHelperTokens, seed);
      if (mode == "put") {
        const int64_t stored = store.put(spec, tokens, kv.view, argv[4]);
        std::printf("stored %lld\n", static_cast<long long>(stored));
        return store.stats().redis.writes == 4 ? 0 : 1;
      }
      Match m = store.match(spec, tokens, argv[4]);
      bool exact = false;
      if (m.tokens() > 0) {
        testing::DenseKV out(spec, m.tokens(), 1);
        m.copy_to(out.view);
        exact = testing::same_elements(out.view, kv.view.slice_tokens(0, m.tokens()));
      }
      std::printf("tokens %lld exact %d redis_hits %lld\n", static_cast<long long>(m.tokens()),
                  exact ? 1 : 0, static_cast<long long>(store.stats().redis.hit_chunks));
      return exact && m.tokens() == testing::kHelperTokens ? 0 : 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvbridge_store_helper: %s\n", e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: see the comment at the top of store_helper.cpp\n");
  return 64;
}
