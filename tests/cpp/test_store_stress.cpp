// 8 threads, 100k mixed put / match / erase operations against a store small enough to evict all
// the time. KV content is a function of the prompt, so every hit can be checked byte for byte.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "test_util.h"

namespace kvbridge {
namespace {

constexpr int64_t kChunk = 8;
constexpr int kPrompts = 64;

TEST(KVStoreStress, EightThreadsEveryHitExact) {
  const ModelSpec spec = testing::small_spec(DType::kBFloat16, 2, 2, 8);
  StoreOptions o;
  o.chunk_tokens = kChunk;
  o.num_shards = 8;
  const int64_t entry = spec.kv_bytes_per_token() * kChunk + 4 * kChunk + StoreStats::kEntryOverheadBytes;
  o.capacity_bytes = 40 * entry;  // about a quarter of the working set
  KVStore store(o);

  // Prompts share prefixes in a tree so that matches stop at many depths.
  std::vector<std::vector<int64_t>> prompts(kPrompts);
  std::vector<std::unique_ptr<testing::DenseKV>> kvs;
  for (int p = 0; p < kPrompts; ++p) {
    prompts[p] = testing::random_tokens(kChunk * (1 + p % 5), 1000 + p);
    if (p >= 8) std::copy_n(prompts[p % 8].begin(), std::min(prompts[p].size(), prompts[p % 8].size()) / 2, prompts[p].begin());
    kvs.push_back(std::make_unique<testing::DenseKV>(spec, static_cast<int64_t>(prompts[p].size()), 0));
    // Bytes depend only on the token ids at each position, so shared prefixes agree.
    auto& bytes = kvs.back()->bytes;
    const int64_t per_token = spec.kv_bytes_per_token() / (2 * spec.num_layers);
    for (size_t i = 0; i < bytes.size(); ++i) {
      const int64_t pos = (static_cast<int64_t>(i) / per_token) % static_cast<int64_t>(prompts[p].size());
      bytes[i] = static_cast<unsigned char>(prompts[p][pos] * 31 + i % per_token + (i / (per_token * prompts[p].size())) * 7 + 1);
    }
  }

  std::atomic<int64_t> bad{0}, hits{0};
  std::vector<std::thread> threads;
  constexpr int kOpsPerThread = 100000 / 8;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int op = 0; op < kOpsPerThread; ++op) {
        const int p = static_cast<int>(rng() % kPrompts);
        const int kind = static_cast<int>(rng() % 10);
        if (kind < 4) {
          store.put(spec, prompts[p], kvs[p]->view);
        } else if (kind < 9) {
          Match m = store.match(spec, prompts[p]);
          if (m.tokens() == 0) continue;
          hits.fetch_add(1);
          testing::DenseKV out(spec, m.tokens(), 7);
          m.copy_to(out.view);
          if (!testing::same_elements(out.view, kvs[p]->view.slice_tokens(0, m.tokens())))
            bad.fetch_add(1);
        } else {
          store.erase(spec, prompts[p]);
        }
        if (store.stats().bytes_used > o.capacity_bytes) bad.fetch_add(1000000);
      }
    });
  }
  for (auto& th : threads) th.join();
  const StoreStats st = store.stats();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(hits.load(), 1000);
  EXPECT_GT(st.evictions, 100);
  EXPECT_LE(st.peak_bytes, o.capacity_bytes);
  EXPECT_EQ(st.bytes_used, st.entries * entry);
}

}  // namespace
}  // namespace kvbridge

#include "process_util.h"
#include "src/store/int8_codec.h"

namespace kvbridge {
namespace {

// 4 threads of put / match / erase / lookups of never-stored prefixes against a store whose
// memory holds a fraction of the working set, with the disk and (when redis-server exists)
// Redis tiers: hits come from every tier, promotions and evictions race, and every hit must
// be byte-exact. Also the ThreadSanitizer target for the tiers (see docs/storage.md).
// With int8 storage every hit must equal the chunk-by-chunk decode of what was put.
void all_tiers_stress(StorageFormat storage) {
  const ModelSpec spec = testing::small_spec(DType::kBFloat16, 2, 2, 8);
  testing::TempDir dir;
  testing::RedisServer redis;
  const bool with_redis = !testing::RedisServer::binary().empty() && redis.start();
  StoreOptions o;
  o.chunk_tokens = kChunk;
  o.num_shards = 4;
  const int64_t entry =
      spec.kv_bytes_per_token() * kChunk + 4 * kChunk + StoreStats::kEntryOverheadBytes;
  o.capacity_bytes = 24 * entry;
  o.storage = storage;
  o.disk_dir = dir.path;
  o.disk_fsync = false;
  o.disk_capacity_bytes = 60 * 4096;  // about half the working set on disk
  if (with_redis) {
    o.redis_url = redis.url();
    o.redis_filter_refresh_ms = 20;  // refreshes race with lookups too
  }
  KVStore store(o);

  std::vector<std::vector<int64_t>> prompts(kPrompts);
  std::vector<std::unique_ptr<testing::DenseKV>> kvs, expect;
  for (int p = 0; p < kPrompts; ++p) {
    prompts[p] = testing::random_tokens(kChunk * (1 + p % 4), 7000 + p);
    kvs.push_back(std::make_unique<testing::DenseKV>(
        spec, static_cast<int64_t>(prompts[p].size()), 7000 + p));
    expect.push_back(std::make_unique<testing::DenseKV>(
        spec, static_cast<int64_t>(prompts[p].size()), 7000 + p));
    if (storage == StorageFormat::kInt8) {
      // Finite bfloat16 (int8 storage rejects NaN / inf); expected: each chunk's decode.
      auto& bytes = kvs.back()->bytes;
      for (size_t i = 1; i < bytes.size(); i += 2) bytes[i] = 0x3c | (bytes[i] & 0x83);
      const KVView& v = kvs.back()->view;
      std::vector<float> payload(
          static_cast<size_t>(detail::int8_payload_bytes(2, kChunk, 2, 8)) / 4 + 1);
      char* buf = reinterpret_cast<char*>(payload.data());
      for (int64_t c = 0; c * kChunk < v.tokens(); ++c) {
        detail::quantize_int8(v.slice_tokens(c * kChunk, kChunk), buf);
        detail::dequantize_int8(buf, kChunk, 0,
                                expect.back()->view.slice_tokens(c * kChunk, kChunk));
      }
    } else {
      expect.back()->bytes = kvs.back()->bytes;
    }
  }
  std::atomic<int64_t> bad{0}, hits{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int op = 0; op < 1500; ++op) {
        const int p = static_cast<int>(rng() % kPrompts);
        const int kind = static_cast<int>(rng() % 20);
        if (kind < 6) {
          store.put(spec, prompts[p], kvs[p]->view);
        } else if (kind < 17) {
          Match m = store.match(spec, prompts[p]);
          if (m.tokens() == 0) continue;
          hits.fetch_add(1);
          testing::DenseKV out(spec, m.tokens(), 7);
          m.copy_to(out.view);
          if (!testing::same_elements(out.view, expect[p]->view.slice_tokens(0, m.tokens())))
            bad.fetch_add(1);
        } else if (kind < 18) {
          store.erase(spec, prompts[p], "default", kMemoryTier);
        } else if (kind < 19) {
          if (store.match(spec, testing::random_tokens(kChunk, 1u << 20 | rng())).tokens())
            bad.fetch_add(1);
        } else {
          store.stats();
          (void)store.metrics_text();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  const StoreStats st = store.stats();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(hits.load(), 500);
  EXPECT_GT(st.disk.hit_chunks, 0);
  EXPECT_GT(st.evictions, 0);
  EXPECT_GT(st.disk.evictions, 0);
  EXPECT_LE(st.peak_bytes, o.capacity_bytes);
  EXPECT_LE(st.disk.bytes_used, o.disk_capacity_bytes);
  EXPECT_EQ(st.disk.corrupt + st.redis.corrupt, 0);
  if (with_redis) {
    EXPECT_GT(st.redis.hit_chunks, 0);
    EXPECT_EQ(st.redis.errors, 0);
  } else {
    std::printf("redis-server not installed: ran with memory and disk only\n");
  }
}

TEST(KVStoreStress, AllTiersEveryHitExact) { all_tiers_stress(StorageFormat::kNative); }

TEST(KVStoreStress, AllTiersInt8EveryHitIsTheDecodedChunk) {
  all_tiers_stress(StorageFormat::kInt8);
}

}  // namespace
}  // namespace kvbridge
