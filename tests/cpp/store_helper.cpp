// Helper program of the multi-process store tests (test_store_faults.cpp, test_store_redis.cpp):
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
#include <cstdio>
#include <cstdlib>
#include <string>

#include "test_util.h"

using namespace kvbridge;

namespace {

StoreOptions redis_options(const std::string& url, const std::string& prefix) {
  StoreOptions o;
  o.chunk_tokens = testing::kHelperChunk;
  o.capacity_bytes = int64_t{64} << 20;
  o.redis_url = url;
  o.redis_key_prefix = prefix;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const ModelSpec spec = testing::helper_spec();
  try {
    if (mode == "disk-writer" && argc == 4) {
      StoreOptions o;
      o.chunk_tokens = testing::kHelperChunk;
      o.capacity_bytes = int64_t{16} << 20;
      o.disk_dir = argv[2];
      o.disk_fsync = true;
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
