// The disk tier: persistence across stores, the documented file format, budget, eviction
// policies, TTL, erase / invalidate / clear, and failures that must degrade to counted misses.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <fstream>
#include <set>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "test_util.h"

namespace kvbridge {
namespace {

using testing::DenseKV;
using testing::HFKV;
using testing::same_elements;
using testing::TempDir;

constexpr int64_t kChunk = 16;

StoreOptions disk_options(const std::string& dir, int64_t capacity = 1 << 24) {
  StoreOptions o;
  o.capacity_bytes = capacity;
  o.chunk_tokens = kChunk;
  o.num_shards = 4;
  o.disk.dir = dir;
  o.disk.fsync = false;  // the tests kill no machines; one test below keeps fsync on
  return o;
}

int64_t file_bytes(const ModelSpec& spec) {
  return 224 + 4 * kChunk + spec.kv_bytes_per_token() * kChunk + 16;
}
int64_t block_bytes(const ModelSpec& spec) { return (file_bytes(spec) + 4095) / 4096 * 4096; }

std::vector<std::string> entry_files(const std::string& dir) {
  return testing::files_with_suffix(dir, ".kvb");
}

std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

uint64_t u64le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

TEST(StoreDisk, ReopenedStoreFindsEntriesAndPromotesThem) {
  TempDir dir;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const ModelSpec spec = testing::small_spec(dtype, 3, 5, 14);
    const auto tokens = testing::random_tokens(3 * kChunk + 5, 2 + static_cast<int>(dtype));
    HFKV kv(spec, static_cast<int64_t>(tokens.size()), 3, 9);  // strided input
    {
      KVStore store(disk_options(dir.path));
      EXPECT_EQ(store.put(spec, tokens, kv.view()), 3 * kChunk);
      const StoreStats st = store.stats();
      EXPECT_EQ(st.disk.writes, 3);
      EXPECT_EQ(st.disk.entries, 3);
      EXPECT_EQ(st.disk.bytes_used, 3 * block_bytes(spec));
    }
    KVStore reopened(disk_options(dir.path));
    EXPECT_EQ(reopened.stats().entries, 0);  // memory starts empty
    Match m = reopened.match(spec, tokens);
    ASSERT_EQ(m.tokens(), 3 * kChunk);
    HFKV out(spec, m.tokens(), 1, 99);
    m.copy_to(out.view());
    EXPECT_TRUE(same_elements(out.view(), kv.view().slice_tokens(0, 3 * kChunk)));
    StoreStats st = reopened.stats();
    EXPECT_EQ(st.disk.hit_chunks, 3);
    EXPECT_EQ(st.promotions, 3);
    EXPECT_EQ(st.entries, 3);
    EXPECT_EQ(st.disk.bytes_read, 3 * file_bytes(spec));
    // Now served from memory.
    EXPECT_EQ(reopened.match(spec, tokens).tokens(), 3 * kChunk);
    st = reopened.stats();
    EXPECT_EQ(st.disk.hit_chunks, 3);
    EXPECT_EQ(st.memory.hit_chunks, 3);
    reopened.clear();
  }
}

TEST(StoreDisk, MixedTiersAlongOnePrefix) {
  // Memory holds chunk 1 only, disk holds all three: the walk takes chunk 0 from disk, chunk 1
  // from memory and chunk 2 from disk.
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  const auto tokens = testing::random_tokens(3 * kChunk, 5);
  DenseKV kv(spec, 3 * kChunk, 6);
  KVStore store(disk_options(dir.path));
  store.put(spec, tokens, kv.view);
  store.clear(kMemoryTier);
  const std::vector<int64_t> two(tokens.begin(), tokens.begin() + 2 * kChunk);
  ASSERT_EQ(store.match(spec, two).tokens(), 2 * kChunk);  // promotes chunks 0 and 1
  const std::vector<int64_t> first(tokens.begin(), tokens.begin() + kChunk);
  EXPECT_EQ(store.erase(spec, first, "default", kMemoryTier), 1);
  EXPECT_EQ(store.stats().disk.entries, 3);
  const StoreStats before = store.stats();
  Match m = store.match(spec, tokens);
  ASSERT_EQ(m.tokens(), 3 * kChunk);
  DenseKV out(spec, 3 * kChunk, 1);
  m.copy_to(out.view);
  EXPECT_TRUE(same_elements(out.view, kv.view));
  const StoreStats after = store.stats();
  EXPECT_EQ(after.memory.hit_chunks - before.memory.hit_chunks, 1);
  EXPECT_EQ(after.disk.hit_chunks - before.disk.hit_chunks, 2);
}

TEST(StoreDisk, MatchLengthPromotesLikeMatch) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  const auto tokens = testing::random_tokens(3 * kChunk, 9);
  DenseKV kv(spec, 3 * kChunk, 6);
  KVStore store(disk_options(dir.path));
  const Provenance converted{std::string(32, '4'), std::string(32, 'd')};
  store.put(spec, tokens, kv.view, "default", converted);
  store.clear(kMemoryTier);
  const MatchLength len = store.match_length(spec, tokens);
  EXPECT_EQ(len.tokens, 3 * kChunk);
  EXPECT_EQ(len.converted_provenance.adapter_fingerprint, converted.adapter_fingerprint);
  StoreStats st = store.stats();
  EXPECT_EQ(st.disk.hit_chunks, 3);
  EXPECT_EQ(st.promotions, 3);
  EXPECT_EQ(st.entries, 3);
  Match m = store.match(spec, tokens);  // now from memory, the same bytes
  ASSERT_EQ(m.tokens(), 3 * kChunk);
  DenseKV out(spec, 3 * kChunk, 1);
  m.copy_to(out.view);
  EXPECT_TRUE(same_elements(out.view, kv.view));
  st = store.stats();
  EXPECT_EQ(st.disk.hit_chunks, 3);
  EXPECT_EQ(st.memory.hit_chunks, 3);
}

// The file format of docs/storage.md, checked field by field with an independent XXH3.
TEST(StoreDisk, FileLayoutMatchesTheSpecification) {
  TempDir dir;
  ModelSpec spec = testing::small_spec(DType::kBFloat16, 2, 3, 4);
  const auto tokens = testing::random_tokens(kChunk, 8);
  DenseKV kv(spec, kChunk, 8);
  StoreOptions o = disk_options(dir.path);
  o.clock_ms = [] { return int64_t{1700000000123}; };
  KVStore store(o);
  store.put(spec, tokens, kv.view, "tenant-x");
  const Hash128 salt = prefix_salt("tenant-x", spec);
  const Hash128 key = prefix_hashes(salt, tokens, kChunk)[0];
  const std::string path = dir.path + "/kvbridge-v1/" + spec.fingerprint() + "/" +
                           key.hex().substr(0, 2) + "/" + key.hex() + ".kvb";
  const std::vector<unsigned char> f = read_file(path);
  ASSERT_EQ(static_cast<int64_t>(f.size()), file_bytes(spec)) << path;
  EXPECT_EQ(std::string(f.begin(), f.begin() + 8), "KVBENTRY");
  EXPECT_EQ(u64le(&f[8]) & 0xffffffffu, 2u);          // format version
  EXPECT_EQ(u64le(&f[8]) >> 32, 224u);                // header bytes
  EXPECT_EQ(u64le(&f[16]) & 0xffffffffu, 1u);         // dtype code: bfloat16
  EXPECT_EQ(u64le(&f[24]), 2u);                       // layers
  EXPECT_EQ(u64le(&f[32]), static_cast<uint64_t>(kChunk));
  EXPECT_EQ(u64le(&f[40]), 3u);                       // kv heads
  EXPECT_EQ(u64le(&f[48]), 4u);                       // head dim
  EXPECT_EQ(u64le(&f[56]), static_cast<uint64_t>(kv.bytes.size()));
  EXPECT_EQ(u64le(&f[64]), 1700000000123u);           // created, ms since the epoch
  EXPECT_EQ(u64le(&f[72]), key.low);
  EXPECT_EQ(u64le(&f[80]), key.high);
  EXPECT_EQ(u64le(&f[88]), salt.low);                 // parent of chunk 1 is h_0
  EXPECT_EQ(u64le(&f[104]), salt.low);
  EXPECT_EQ(u64le(&f[112]), salt.high);
  EXPECT_EQ(std::string(f.begin() + 120, f.begin() + 152), spec.fingerprint());
  for (size_t i = 152; i < 224; ++i) EXPECT_EQ(f[i], 0) << i;  // own KV: no provenance
  for (int64_t i = 0; i < kChunk; ++i) {
    const unsigned char* t = &f[static_cast<size_t>(224 + 4 * i)];
    EXPECT_EQ(t[0] | t[1] << 8 | t[2] << 16 | static_cast<uint32_t>(t[3]) << 24,
              static_cast<uint32_t>(tokens[static_cast<size_t>(i)]));
  }
  EXPECT_EQ(0, std::memcmp(&f[224 + 4 * kChunk], kv.bytes.data(), kv.bytes.size()));
  const XXH128_hash_t h = XXH3_128bits(f.data(), f.size() - 16);
  EXPECT_EQ(u64le(&f[f.size() - 16]), h.low64);
  EXPECT_EQ(u64le(&f[f.size() - 8]), h.high64);
  // The file's mtime is its creation time.
  struct stat st{};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(static_cast<int64_t>(st.st_mtim.tv_sec), 1700000000);
}

TEST(StoreDisk, NamespacesAndModelsNeverShareOnDisk) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  const auto tokens = testing::random_tokens(2 * kChunk, 4);
  DenseKV kv(spec, 2 * kChunk, 2);
  { KVStore(disk_options(dir.path)).put(spec, tokens, kv.view, "tenant-a"); }
  KVStore store(disk_options(dir.path));
  EXPECT_EQ(store.match(spec, tokens, "tenant-b").tokens(), 0);
  ModelSpec lora = spec;
  lora.version = "lora-7";
  EXPECT_EQ(store.match(lora, tokens, "tenant-a").tokens(), 0);
  EXPECT_EQ(store.match(spec, tokens).tokens(), 0);
  EXPECT_EQ(store.match(spec, tokens, "tenant-a").tokens(), 2 * kChunk);
}

TEST(StoreDisk, BudgetNeverExceededAndEvictsLeastRecentlyUsed) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec(DType::kFloat32, 4, 4, 16);  // 8 KiB per chunk
  StoreOptions o = disk_options(dir.path);
  o.disk.capacity_bytes = 5 * block_bytes(spec) + 100;
  std::vector<std::vector<int64_t>> prompts;
  {
    KVStore store(o);
    for (uint64_t i = 0; i < 20; ++i) {
      prompts.push_back(testing::random_tokens(kChunk, 100 + i));
      DenseKV kv(spec, kChunk, i);
      store.put(spec, prompts.back(), kv.view);
      ASSERT_LE(store.stats().disk.bytes_used, o.disk.capacity_bytes);
    }
    const StoreStats st = store.stats();
    EXPECT_EQ(st.disk.entries, 5);
    EXPECT_EQ(st.disk.evictions, 15);
    EXPECT_EQ(static_cast<int64_t>(entry_files(dir.path).size()), 5);
  }
  KVStore reopened(o);
  std::set<int> on_disk;
  for (int i = 0; i < 20; ++i)
    if (reopened.match(spec, prompts[i]).tokens() == kChunk) on_disk.insert(i);
  EXPECT_EQ(on_disk, (std::set<int>{15, 16, 17, 18, 19}));
}

TEST(StoreDisk, LookupRefreshesDiskRecency) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec(DType::kFloat32, 4, 4, 16);
  StoreOptions o = disk_options(dir.path);
  o.disk.capacity_bytes = 3 * block_bytes(spec);
  KVStore store(o);
  std::vector<std::vector<int64_t>> p;
  for (uint64_t i = 0; i < 4; ++i) p.push_back(testing::random_tokens(kChunk, 300 + i));
  DenseKV kv(spec, kChunk, 1);
  for (int i = 0; i < 3; ++i) store.put(spec, p[i], kv.view);
  store.clear(kMemoryTier);
  ASSERT_EQ(store.match(spec, p[0]).tokens(), kChunk);  // disk hit: 0 becomes most recent
  store.put(spec, p[3], kv.view);                        // evicts 1 from disk
  store.clear(kMemoryTier);
  EXPECT_EQ(store.match(spec, p[1]).tokens(), 0);
  EXPECT_EQ(store.match(spec, p[0]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, p[2]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, p[3]).tokens(), kChunk);
}

TEST(StoreDisk, EntryLargerThanTheDiskBudgetIsSkippedNotFatal) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec(DType::kFloat32, 4, 4, 16);
  StoreOptions o = disk_options(dir.path);
  o.disk.capacity_bytes = 4096;
  KVStore store(o);
  const auto tokens = testing::random_tokens(2 * kChunk, 1);
  DenseKV kv(spec, 2 * kChunk, 1);
  EXPECT_EQ(store.put(spec, tokens, kv.view), 2 * kChunk);  // memory took it
  const StoreStats st = store.stats();
  EXPECT_EQ(st.disk.write_failures, 2);
  EXPECT_EQ(st.disk.entries, 0);
  EXPECT_EQ(st.disk.bytes_used, 0);
  EXPECT_TRUE(entry_files(dir.path).empty());
}

TEST(StoreDisk, MemoryFullStillWritesThroughToDisk) {
  // Memory holds one entry; a put of four chunks keeps the first in memory (pinned during the
  // call) and sends all four to disk, so the whole prefix is cached.
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  const int64_t entry = spec.kv_bytes_per_token() * kChunk + 4 * kChunk +
                        StoreStats::kEntryOverheadBytes;
  KVStore store(disk_options(dir.path, entry));
  const auto tokens = testing::random_tokens(4 * kChunk, 3);
  DenseKV kv(spec, 4 * kChunk, 3);
  EXPECT_EQ(store.put(spec, tokens, kv.view), 4 * kChunk);
  EXPECT_EQ(store.stats().disk.entries, 4);
  EXPECT_EQ(store.stats().memory.write_failures, 3);
  // match promotes what fits: only one chunk can be pinned in memory at a time.
  Match m = store.match(spec, tokens);
  EXPECT_EQ(m.tokens(), kChunk);
  EXPECT_GE(store.stats().promotions_rejected, 1);
}

// Two live stores on one directory (the same as two processes, each with its own memory): each
// reads what the other wrote, after it opened too; one's erase and invalidate reach the
// other's reads; the byte count is the directory's.
TEST(StoreDisk, TwoLiveStoresShareOneDirectory) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  ModelSpec other = spec;
  other.name = "other-model";
  const auto t1 = testing::random_tokens(2 * kChunk, 31);
  const auto t2 = testing::random_tokens(2 * kChunk, 32);
  DenseKV kv1(spec, 2 * kChunk, 31), kv2(spec, 2 * kChunk, 32);
  KVStore first(disk_options(dir.path));
  ASSERT_EQ(first.put(spec, t1, kv1.view), 2 * kChunk);
  KVStore second(disk_options(dir.path));
  ASSERT_EQ(second.put(spec, t2, kv2.view), 2 * kChunk);
  ASSERT_EQ(second.put(other, t2, kv2.view), 2 * kChunk);
  auto exact = [&](KVStore& s, const ModelSpec& m, const std::vector<int64_t>& t,
                   const DenseKV& kv) {
    s.clear(kMemoryTier);
    Match got = s.match(m, t);
    if (got.tokens() != 2 * kChunk) return false;
    DenseKV out(m, got.tokens(), 5);
    got.copy_to(out.view);
    return same_elements(out.view, kv.view);
  };
  EXPECT_TRUE(exact(second, spec, t1, kv1));
  EXPECT_TRUE(exact(first, spec, t2, kv2));  // written after `first` opened
  EXPECT_EQ(first.stats().disk.bytes_used, 6 * block_bytes(spec));
  EXPECT_EQ(second.stats().disk.bytes_used, 6 * block_bytes(spec));
  // A chunk another store already wrote is not written again.
  const int64_t writes = first.stats().disk.writes;
  EXPECT_EQ(first.put(spec, t2, kv2.view), 2 * kChunk);
  EXPECT_EQ(first.stats().disk.writes, writes);
  EXPECT_EQ(first.erase(spec, t1, "default", kDiskTier), 2);
  second.clear(kMemoryTier);
  EXPECT_EQ(second.match(spec, t1).tokens(), 0);
  const InvalidateResult r = second.invalidate(spec);
  EXPECT_EQ(r.disk, 2);  // t2's files, which `first` wrote... and `second` itself
  first.clear(kMemoryTier);
  EXPECT_EQ(first.match(spec, t2).tokens(), 0);
  EXPECT_TRUE(exact(first, other, t2, kv2));
  EXPECT_EQ(first.stats().disk.bytes_used, 2 * block_bytes(spec));
  EXPECT_EQ(first.stats().disk.corrupt + second.stats().disk.corrupt, 0);
  EXPECT_EQ(first.stats().disk.errors + second.stats().disk.errors, 0);

  StoreOptions bad = disk_options("/proc/kvbridge-cannot-create");
  EXPECT_THROW(KVStore s(bad), Unavailable);
  bad = disk_options(dir.path);
  bad.disk.capacity_bytes = 0;
  EXPECT_THROW(KVStore s(bad), InvalidArgument);
}

TEST(StoreDisk, OpenRemovesTemporaryFilesAndIgnoresStrangers) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  const auto tokens = testing::random_tokens(kChunk, 3);
  DenseKV kv(spec, kChunk, 3);
  { KVStore(disk_options(dir.path)).put(spec, tokens, kv.view); }
  const std::string file = entry_files(dir.path).at(0);
  const std::string sub = file.substr(0, file.rfind('/'));
  write_file(file + ".tmp.999.1", {1, 2, 3});
  write_file(sub + "/notes.txt", {4, 5});
  KVStore store(disk_options(dir.path));
  EXPECT_TRUE(testing::files_with_suffix(dir.path, ".1").empty());
  EXPECT_EQ(read_file(sub + "/notes.txt").size(), 2u);
  EXPECT_EQ(store.stats().disk.entries, 1);
  EXPECT_EQ(store.match(spec, tokens).tokens(), kChunk);
}

TEST(StoreDisk, ReopenWithASmallerBudgetEvictsOldestFirst) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec(DType::kFloat32, 4, 4, 16);
  std::vector<std::vector<int64_t>> p;
  int64_t now = 1000000;
  StoreOptions o = disk_options(dir.path);
  o.clock_ms = [&now] { return now; };
  {
    KVStore store(o);
    for (uint64_t i = 0; i < 6; ++i) {
      p.push_back(testing::random_tokens(kChunk, 50 + i));
      DenseKV kv(spec, kChunk, i);
      now += 5000;  // distinct creation times (and mtimes)
      store.put(spec, p.back(), kv.view);
    }
  }
  o.disk.capacity_bytes = 2 * block_bytes(spec);
  KVStore store(o);
  EXPECT_EQ(store.stats().disk.entries, 2);
  EXPECT_EQ(store.match(spec, p[5]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, p[4]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, p[3]).tokens(), 0);
}

TEST(StoreDisk, TtlExpiresInEveryLocalTier) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  int64_t now = 5000000;
  StoreOptions o = disk_options(dir.path);
  o.ttl_seconds = 10;
  o.clock_ms = [&now] { return now; };
  const auto tokens = testing::random_tokens(2 * kChunk, 9);
  DenseKV kv(spec, 2 * kChunk, 9);
  {
    KVStore store(o);
    store.put(spec, tokens, kv.view);
    now += 9999;
    EXPECT_EQ(store.match(spec, tokens).tokens(), 2 * kChunk);
    store.clear(kMemoryTier);
    EXPECT_EQ(store.match(spec, tokens).tokens(), 2 * kChunk);  // from disk, still young
    now += 1;
    EXPECT_EQ(store.match(spec, tokens).tokens(), 0);  // memory copies expired, then disk's
    const StoreStats st = store.stats();
    EXPECT_EQ(st.memory.expired, 1);  // the walk stops at chunk 0
    EXPECT_EQ(st.disk.expired, 1);
    EXPECT_EQ(st.disk.entries, 1);
  }
  // Reopening applies the TTL to the file times: chunk 1's file is as old as chunk 0's was.
  KVStore store(o);
  EXPECT_EQ(store.stats().disk.entries, 0);
  EXPECT_EQ(store.stats().disk.expired, 1);
  EXPECT_TRUE(entry_files(dir.path).empty());
}

// An entry put under a TTL keeps its expiry in its file: a store opened later without a TTL
// neither serves it nor keeps it once it has expired (at open, and on a read by a store that
// was already open).
TEST(StoreDisk, TtlExpiryStaysWithTheFileWhenReopenedWithoutTtl) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  int64_t now = 5000000;
  StoreOptions o = disk_options(dir.path);
  o.ttl_seconds = 10;
  o.clock_ms = [&now] { return now; };
  const auto a = testing::random_tokens(2 * kChunk, 21);
  const auto b = testing::random_tokens(kChunk, 22);
  DenseKV kva(spec, 2 * kChunk, 21), kvb(spec, kChunk, 22);
  { KVStore(o).put(spec, a, kva.view); }
  now += 10000;  // a's chunks expire now
  StoreOptions plain = o;
  plain.ttl_seconds = 0;
  {
    KVStore store(plain);
    EXPECT_EQ(store.stats().disk.expired, 2);
    EXPECT_EQ(store.stats().disk.entries, 0);
    EXPECT_EQ(store.match(spec, a).tokens(), 0);
    EXPECT_TRUE(entry_files(dir.path).empty());
  }
  { KVStore(o).put(spec, b, kvb.view); }
  KVStore store(plain);  // b is young: served
  store.clear(kMemoryTier);
  EXPECT_EQ(store.match(spec, b).tokens(), kChunk);
  store.clear(kMemoryTier);
  now += 10000;
  EXPECT_EQ(store.match(spec, b).tokens(), 0);  // expired while this store was open
  EXPECT_EQ(store.stats().disk.expired, 1);
  EXPECT_TRUE(entry_files(dir.path).empty());
  // A store without a TTL writes entries that never expire.
  store.put(spec, b, kvb.view);
  now += int64_t{1000} * 1000000;
  store.clear(kMemoryTier);
  EXPECT_EQ(store.match(spec, b).tokens(), kChunk);
}

TEST(StoreDisk, EraseInvalidateAndClearReachTheDisk) {
  TempDir dir;
  const ModelSpec a = testing::small_spec();
  ModelSpec b = a;
  b.name = "other-model";
  const auto tokens = testing::random_tokens(3 * kChunk, 9);
  DenseKV kv(a, 3 * kChunk, 9);
  KVStore store(disk_options(dir.path));
  store.put(a, tokens, kv.view, "t1");
  store.put(a, tokens, kv.view, "t2");
  store.put(b, tokens, kv.view, "t1");
  EXPECT_EQ(store.stats().disk.entries, 9);
  // erase: both tiers, by default.
  EXPECT_EQ(store.erase(a, tokens, "t2"), 6);
  EXPECT_EQ(store.stats().disk.entries, 6);
  // invalidate: every namespace of one fingerprint.
  store.put(a, tokens, kv.view, "t2");
  const InvalidateResult r = store.invalidate(a);
  EXPECT_EQ(r.memory, 6);
  EXPECT_EQ(r.disk, 6);
  EXPECT_EQ(store.match(a, tokens, "t1").tokens(), 0);
  EXPECT_EQ(store.match(a, tokens, "t2").tokens(), 0);
  EXPECT_EQ(store.match(b, tokens, "t1").tokens(), 3 * kChunk);
  store.clear();
  EXPECT_EQ(store.stats().disk.entries, 0);
  EXPECT_EQ(store.stats().disk.bytes_used, 0);
  EXPECT_TRUE(entry_files(dir.path).empty());
  // The emptied directories go when a store opens the directory with no other store alive.
  EXPECT_TRUE(std::filesystem::exists(dir.path + "/kvbridge-v1/" + a.fingerprint()));
  { KVStore another(disk_options(dir.path)); }  // `store` still lives
  EXPECT_TRUE(std::filesystem::exists(dir.path + "/kvbridge-v1/" + a.fingerprint()));
}

TEST(StoreDisk, StoreOpenedAloneRemovesEmptyDirectories) {
  TempDir dir;
  const ModelSpec a = testing::small_spec();
  const auto tokens = testing::random_tokens(3 * kChunk, 9);
  DenseKV kv(a, 3 * kChunk, 9);
  {
    KVStore store(disk_options(dir.path));
    store.put(a, tokens, kv.view);
    store.invalidate(a);
  }
  KVStore store(disk_options(dir.path));
  EXPECT_FALSE(std::filesystem::exists(dir.path + "/kvbridge-v1/" + a.fingerprint()));
  EXPECT_EQ(store.put(a, tokens, kv.view), 3 * kChunk);
  EXPECT_EQ(store.stats().disk.writes, 3);
  EXPECT_EQ(store.stats().disk.write_failures, 0);
}

TEST(StoreDisk, FsyncedWritesRoundTrip) {
  TempDir dir;
  const ModelSpec spec = testing::small_spec();
  StoreOptions o = disk_options(dir.path);
  o.disk.fsync = true;
  const auto tokens = testing::random_tokens(2 * kChunk, 19);
  DenseKV kv(spec, 2 * kChunk, 19);
  { KVStore(o).put(spec, tokens, kv.view); }
  KVStore store(o);
  Match m = store.match(spec, tokens);
  ASSERT_EQ(m.tokens(), 2 * kChunk);
  DenseKV out(spec, 2 * kChunk, 1);
  m.copy_to(out.view);
  EXPECT_TRUE(same_elements(out.view, kv.view));
}

// --- eviction policies (memory tier; the disk tier shares the ordering code) ---------------

StoreOptions policy_options(EvictionPolicy p, const ModelSpec& spec, int64_t entries) {
  StoreOptions o;
  o.chunk_tokens = kChunk;
  o.num_shards = 1;  // exact order
  o.eviction = p;
  o.capacity_bytes =
      entries * (spec.kv_bytes_per_token() * kChunk + 4 * kChunk + StoreStats::kEntryOverheadBytes);
  return o;
}

TEST(StoreEviction, LfuKeepsTheMostUsed) {
  const ModelSpec spec = testing::small_spec();
  KVStore store(policy_options(EvictionPolicy::kLFU, spec, 3));
  std::vector<std::vector<int64_t>> p;
  for (uint64_t i = 0; i < 4; ++i) p.push_back(testing::random_tokens(kChunk, 20 + i));
  DenseKV kv(spec, kChunk, 1);
  for (int i = 0; i < 3; ++i) store.put(spec, p[i], kv.view);
  for (int r = 0; r < 3; ++r) store.match(spec, p[0]);  // 0: 4 uses
  store.match(spec, p[2]);                               // 2: 2 uses; 1: 1 use (the oldest too)
  store.match(spec, p[1]);                               // 1: 2 uses, more recent than 2
  store.put(spec, p[3], kv.view);                        // evicts 2: fewest uses, then LRU
  EXPECT_EQ(store.match(spec, p[2]).tokens(), 0);
  EXPECT_EQ(store.match(spec, p[0]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, p[1]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, p[3]).tokens(), kChunk);
}

TEST(StoreEviction, TtlPolicyEvictsTheOldestPutWhateverItsUse) {
  const ModelSpec spec = testing::small_spec();
  int64_t now = 1000;
  StoreOptions o = policy_options(EvictionPolicy::kTTL, spec, 3);
  o.ttl_seconds = 3600;
  o.clock_ms = [&now] { return now; };
  KVStore store(o);
  std::vector<std::vector<int64_t>> p;
  for (uint64_t i = 0; i < 4; ++i) p.push_back(testing::random_tokens(kChunk, 40 + i));
  DenseKV kv(spec, kChunk, 1);
  for (int i = 0; i < 3; ++i) {
    now += 10;
    store.put(spec, p[i], kv.view);
  }
  for (int r = 0; r < 5; ++r) store.match(spec, p[0]);  // use does not extend a TTL
  store.put(spec, p[3], kv.view);
  EXPECT_EQ(store.match(spec, p[0]).tokens(), 0);
  EXPECT_EQ(store.match(spec, p[1]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, p[3]).tokens(), kChunk);
  o.ttl_seconds = 0;
  EXPECT_THROW(KVStore bad(o), InvalidArgument);
  EXPECT_EQ(parse_eviction_policy("lfu"), EvictionPolicy::kLFU);
  EXPECT_THROW(parse_eviction_policy("mru"), InvalidArgument);
}

TEST(StoreEviction, LruIsTheDefaultAndPinnedEntriesSurviveEveryPolicy) {
  EXPECT_EQ(StoreOptions{}.eviction, EvictionPolicy::kLRU);
  const ModelSpec spec = testing::small_spec();
  for (EvictionPolicy pol : {EvictionPolicy::kLRU, EvictionPolicy::kLFU, EvictionPolicy::kTTL}) {
    StoreOptions o = policy_options(pol, spec, 2);
    o.ttl_seconds = 100;
    KVStore store(o);
    const auto a = testing::random_tokens(kChunk, 1), b = testing::random_tokens(kChunk, 2),
               c = testing::random_tokens(kChunk, 3);
    DenseKV kv(spec, kChunk, 2);
    store.put(spec, a, kv.view);
    Match held = store.match(spec, a);
    store.put(spec, b, kv.view);
    store.put(spec, c, kv.view);
    EXPECT_EQ(store.match(spec, a).tokens(), kChunk) << eviction_policy_name(pol);
    EXPECT_EQ(store.match(spec, b).tokens(), 0) << eviction_policy_name(pol);
  }
}

}  // namespace
}  // namespace kvbridge
