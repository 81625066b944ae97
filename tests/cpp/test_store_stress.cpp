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
  o.disk.dir = dir.path;
  o.disk.fsync = false;
  o.disk.capacity_bytes = 60 * 4096;  // about half the working set on disk
  if (with_redis) {
    o.redis.url = redis.url();
    o.redis.filter_refresh_ms = 20;  // refreshes race with lookups too
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
  EXPECT_LE(st.disk.bytes_used, o.disk.capacity_bytes);
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


// invalidate() racing put() on the disk tier while a second store of the same directory reads:
// no write may fail (an empty directory the invalidate removes while a put writes into it is
// made again) and no hit may differ from what was put.
TEST(KVStoreStress, DiskInvalidateRacingPutNeverFailsAWrite) {
  testing::TempDir dir;
  const StoreOptions o = testing::shared_options(dir.path, int64_t{64} << 20);
  KVStore writer(o), reader(o);
  const ModelSpec spec = testing::shared_spec(0);
  std::vector<std::unique_ptr<testing::DenseKV>> kvs;
  for (uint64_t p = 0; p < 8; ++p)
    kvs.push_back(std::make_unique<testing::DenseKV>(spec, testing::kSharedTokens, p));
  // The writers go on until at least 20 invalidates removed files, so the race is run
  // whatever the scheduling.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> wrong{0}, invalidations{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t i = 0; i < 1500 || invalidations.load() < 20; ++i) {
        const uint64_t p = (i + 3 * static_cast<uint64_t>(t)) % 8;
        writer.put(spec, testing::shared_tokens(p), kvs[p]->view);
      }
    });
  }
  std::thread invalidator([&] {
    while (!stop.load())
      if (writer.invalidate(spec).disk > 0) invalidations.fetch_add(1);
  });
  std::thread other([&] {
    for (uint64_t i = 0; !stop.load(); ++i) wrong += testing::match_exact(reader, 0, i % 8) < 0;
  });
  for (auto& th : threads) th.join();
  stop = true;
  invalidator.join();
  other.join();
  const StoreStats st = writer.stats();
  EXPECT_GE(invalidations.load(), 20);
  EXPECT_GT(st.disk.writes, 32);  // rewrites after invalidates
  EXPECT_EQ(st.disk.write_failures, 0);
  EXPECT_EQ(st.disk.errors, 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(reader.stats().disk.corrupt + reader.stats().disk.errors, 0);
}

// Two stores of one directory in one process, two threads each, on a disk budget of 12 files
// for 24 entries: every hit exact, and the directory-wide count both see equals what the files
// take once the threads are done.
TEST(KVStoreStress, TwoStoresOfOneDirectoryShareTheBudget) {
  testing::TempDir dir;
  const StoreOptions o = testing::shared_options(dir.path, 12 * testing::kSharedFileBlocks);
  KVStore a(o), b(o);
  KVStore* stores[2] = {&a, &b};
  const ModelSpec spec = testing::shared_spec(0);
  std::vector<std::unique_ptr<testing::DenseKV>> kvs;
  for (uint64_t p = 0; p < 6; ++p)
    kvs.push_back(std::make_unique<testing::DenseKV>(spec, testing::kSharedTokens, p));
  std::atomic<int64_t> wrong{0}, hits{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      KVStore& s = *stores[t % 2];
      std::mt19937 rng(40 + t);
      for (int op = 0; op < 400; ++op) {
        const uint64_t p = rng() % 6;
        const unsigned kind = rng() % 10;
        if (kind < 4) {
          s.put(spec, testing::shared_tokens(p), kvs[p]->view);
        } else if (kind < 9) {
          const int64_t got = testing::match_exact(s, 0, p);
          wrong += got < 0;
          hits += got > 0;
        } else {
          s.erase(spec, testing::shared_tokens(p), "default", kDiskTier);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  int64_t files = 0;
  for (const std::string& f : testing::files_with_suffix(dir.path, ".kvb"))
    files += (static_cast<int64_t>(std::filesystem::file_size(f)) + 4095) / 4096 * 4096;
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(hits.load(), 50);
  EXPECT_GT(a.stats().disk.evictions + b.stats().disk.evictions, 0);
  EXPECT_EQ(a.stats().disk.bytes_used, files);
  EXPECT_EQ(b.stats().disk.bytes_used, files);
  EXPECT_LE(files, o.disk.capacity_bytes);
  EXPECT_EQ(a.stats().disk.corrupt + b.stats().disk.corrupt, 0);
}

}  // namespace
}  // namespace kvbridge
