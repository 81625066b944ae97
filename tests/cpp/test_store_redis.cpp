// The Redis tier against a real redis-server on a free loopback port (started per test):
// sharing across stores and processes, the key schema, pipelined prefix reads, the filter,
// invalidation, tenants, and the server going away and coming back.
#include <gtest/gtest.h>

#include <set>

#include "process_util.h"
#include "test_util.h"

namespace kvbridge {
namespace {

using testing::DenseKV;
using testing::RedisServer;

constexpr int64_t kChunk = 16;
constexpr int64_t kNever = 3600 * 1000;  // a filter refresh interval no test reaches

struct ReplyPtr {
  redisReply* r;
  explicit ReplyPtr(redisReply* reply) : r(reply) {}
  ~ReplyPtr() {
    if (r) freeReplyObject(r);
  }
  redisReply* operator->() const { return r; }
  explicit operator bool() const { return r != nullptr; }
};

class StoreRedis : public ::testing::Test {
 protected:
  void SetUp() override {
    if (RedisServer::binary().empty())
      GTEST_SKIP() << "redis-server is not installed (scripts/bootstrap.sh installs it)";
    ASSERT_TRUE(server.start()) << "redis-server did not start on port " << server.port();
  }

  StoreOptions options(bool filter = true) const {
    StoreOptions o;
    o.capacity_bytes = 1 << 24;
    o.chunk_tokens = kChunk;
    o.num_shards = 4;
    o.redis.url = server.url();
    o.redis.filter = filter;
    o.redis.filter_refresh_ms = static_cast<int>(kNever);
    o.redis.command_timeout_ms = 300;
    o.redis.retry_min_ms = 20;
    o.redis.retry_max_ms = 200;
    return o;
  }

  void expect_exact(const Match& m, const DenseKV& kv) {
    ASSERT_EQ(m.tokens(), kv.view.tokens());
    DenseKV out(spec, m.tokens(), 77);
    m.copy_to(out.view);
    EXPECT_TRUE(testing::same_elements(out.view, kv.view));
  }

  const ModelSpec spec = testing::small_spec(DType::kBFloat16, 3, 2, 8);
  RedisServer server;
};

TEST_F(StoreRedis, SecondStoreLoadsThePrefixInOneRoundTrip) {
  const auto tokens = testing::random_tokens(4 * kChunk, 1);
  DenseKV kv(spec, 4 * kChunk, 1);
  KVStore writer(options());
  EXPECT_EQ(writer.put(spec, tokens, kv.view), 4 * kChunk);
  EXPECT_EQ(writer.stats().redis.writes, 4);
  KVStore reader(options());
  const int64_t trips = reader.stats().remote.round_trips;
  Match m = reader.match(spec, tokens);
  expect_exact(m, kv);
  StoreStats st = reader.stats();
  EXPECT_EQ(st.remote.round_trips - trips, 1);  // one MGET for the four chunks
  EXPECT_EQ(st.redis.hit_chunks, 4);
  EXPECT_EQ(st.promotions, 4);
  EXPECT_GT(st.remote.latency_buckets.back(), 0);
  // Promoted: the next lookup needs no round trip.
  reader.match(spec, tokens);
  EXPECT_EQ(reader.stats().remote.round_trips - trips, 1);
  EXPECT_EQ(reader.stats().memory.hit_chunks, 4);
}

TEST_F(StoreRedis, BatchBytesBoundsEachRoundTrip) {
  const auto tokens = testing::random_tokens(6 * kChunk, 2);
  DenseKV kv(spec, 6 * kChunk, 2);
  KVStore(options()).put(spec, tokens, kv.view);
  StoreOptions o = options();
  o.redis.batch_bytes = 2 * (224 + 4 * kChunk + spec.kv_bytes_per_token() * kChunk + 16);
  KVStore reader(o);
  const int64_t trips = reader.stats().remote.round_trips;
  expect_exact(reader.match(spec, tokens), kv);
  EXPECT_EQ(reader.stats().remote.round_trips - trips, 3);  // two chunks per MGET
}

TEST_F(StoreRedis, AnotherProcessLoadsWhatThisOneSaved) {
  const std::string helper = KVBRIDGE_STORE_HELPER;
  // Process 1 saves, process 2 loads, both separate programs; then this process loads too.
  testing::Child put = testing::spawn({helper, "put", server.url(), "kvb", "tenant-p", "42"}, true);
  std::string out;
  ASSERT_EQ(testing::wait_exit(put, &out), 0) << out;
  EXPECT_EQ(out, "stored 256\n");
  testing::Child get =
      testing::spawn({helper, "match", server.url(), "kvb", "tenant-p", "42"}, true);
  out.clear();
  EXPECT_EQ(testing::wait_exit(get, &out), 0) << out;
  EXPECT_EQ(out, "tokens 256 exact 1 redis_hits 4\n");
  // Another tenant's process finds nothing.
  testing::Child other =
      testing::spawn({helper, "match", server.url(), "kvb", "tenant-q", "42"}, true);
  out.clear();
  EXPECT_EQ(testing::wait_exit(other, &out), 1);
  EXPECT_EQ(out, "tokens 0 exact 0 redis_hits 0\n");

  StoreOptions o = options();
  o.chunk_tokens = testing::kHelperChunk;
  o.capacity_bytes = int64_t{64} << 20;
  KVStore here(o);
  const ModelSpec hs = testing::helper_spec();
  Match m = here.match(hs, testing::helper_tokens(42), "tenant-p");
  ASSERT_EQ(m.tokens(), testing::kHelperTokens);
  DenseKV expect(hs, testing::kHelperTokens, 42), got(hs, testing::kHelperTokens, 1);
  m.copy_to(got.view);
  EXPECT_TRUE(testing::same_elements(got.view, expect.view));
}

TEST_F(StoreRedis, KeySchemaValueHeaderAndExpiry) {
  StoreOptions o = options();
  o.redis.key_prefix = "app*1";
  o.ttl_seconds = 120;
  KVStore store(o);
  const auto tokens = testing::random_tokens(kChunk, 3);
  DenseKV kv(spec, kChunk, 3);
  const std::string ns = "tenant a/b:c";
  store.put(spec, tokens, kv.view, ns);
  const Hash128 key = prefix_hashes(prefix_salt(ns, spec), tokens, kChunk)[0];
  const std::string name =
      "app%2A1:v1:tenant%20a%2Fb%3Ac:" + spec.fingerprint() + ":" + key.hex();
  ReplyPtr v(server.command({"GET", name}));
  ASSERT_TRUE(v) << name;
  ASSERT_EQ(v->type, REDIS_REPLY_STRING) << name;
  EXPECT_EQ(v->len, static_cast<size_t>(224 + 4 * kChunk + kv.bytes.size() + 16));
  EXPECT_EQ(std::string(v->str, 8), "KVBENTRY");
  EXPECT_EQ(0, std::memcmp(v->str + 224 + 4 * kChunk, kv.bytes.data(), kv.bytes.size()));
  ReplyPtr ttl(server.command({"PTTL", name}));
  EXPECT_GT(ttl->integer, 110000);
  EXPECT_LE(ttl->integer, 120000);
  ReplyPtr filter(server.command({"EXISTS", "app%2A1:v1:filter"}));
  EXPECT_EQ(filter->integer, 1);
}

TEST_F(StoreRedis, CorruptValuesAreCountedMissesAndDeleted) {
  const auto tokens = testing::random_tokens(2 * kChunk, 4);
  DenseKV kv(spec, 2 * kChunk, 4);
  KVStore(options()).put(spec, tokens, kv.view);
  const Hash128 key = prefix_hashes(prefix_salt("default", spec), tokens, kChunk)[1];
  const std::string name = "kvb:v1:default:" + spec.fingerprint() + ":" + key.hex();
  std::mt19937_64 rng(5);
  for (int t = 0; t < 8; ++t) {
    std::string value;
    {
      ReplyPtr v(server.command({"GET", name}));
      if (!v || v->type != REDIS_REPLY_STRING) {
        KVStore(options()).put(spec, tokens, kv.view);  // restore, then damage again
        ReplyPtr again(server.command({"GET", name}));
        ASSERT_EQ(again->type, REDIS_REPLY_STRING);
        value.assign(again->str, again->len);
      } else {
        value.assign(v->str, v->len);
      }
    }
    if (t % 2 == 0) {
      value[rng() % value.size()] ^= static_cast<char>(1 + rng() % 255);
    } else {
      value.resize(rng() % value.size());
    }
    ReplyPtr set(server.command({"SET", name, value}));
    KVStore reader(options());
    EXPECT_EQ(reader.match(spec, tokens).tokens(), kChunk) << "trial " << t;  // chunk 0 intact
    EXPECT_EQ(reader.stats().redis.corrupt, 1);
    ReplyPtr exists(server.command({"EXISTS", name}));
    EXPECT_EQ(exists->integer, 0);  // the damaged value was deleted
  }
}

TEST_F(StoreRedis, FilterAnswersSureMissesWithoutARoundTrip) {
  const auto tokens = testing::random_tokens(3 * kChunk, 6);
  DenseKV kv(spec, 3 * kChunk, 6);
  KVStore(options()).put(spec, tokens, kv.view);
  for (bool filter : {true, false}) {
    KVStore reader(options(filter));
    EXPECT_EQ(reader.stats().remote.filter_active, filter);
    const StoreStats before = reader.stats();
    for (uint64_t i = 0; i < 50; ++i)
      EXPECT_EQ(reader.match(spec, testing::random_tokens(3 * kChunk, 1000 + i)).tokens(), 0);
    expect_exact(reader.match(spec, tokens), kv);
    const StoreStats after = reader.stats();
    const int64_t trips = after.remote.round_trips - before.remote.round_trips;
    if (filter) {
      EXPECT_EQ(after.remote.filter_negatives - before.remote.filter_negatives, 50);
      EXPECT_EQ(trips, 1);  // only the real hit
    } else {
      EXPECT_EQ(after.remote.filter_negatives, 0);
      EXPECT_EQ(trips, 51);
    }
  }
}

TEST_F(StoreRedis, AnotherStoresPutBecomesVisibleWithinTheRefreshInterval) {
  StoreOptions o = options();
  o.redis.filter_refresh_ms = 50;
  KVStore writer(o), reader(o);
  const auto tokens = testing::random_tokens(2 * kChunk, 7);
  DenseKV kv(spec, 2 * kChunk, 7);
  EXPECT_EQ(reader.match(spec, tokens).tokens(), 0);
  writer.put(spec, tokens, kv.view);
  // The reader's copy is refreshed every 50 ms: the hit must come (no bound on how fast is
  // asserted, only that it is not impossible).
  Match m;
  for (int i = 0; i < 400 && !m; ++i) {
    m = reader.match(spec, tokens);
    if (!m) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  expect_exact(m, kv);
  EXPECT_GE(reader.stats().remote.filter_refreshes, 2);
}

TEST_F(StoreRedis, ALostFilterIsRebuiltFromTheKeys) {
  const auto tokens = testing::random_tokens(2 * kChunk, 8);
  DenseKV kv(spec, 2 * kChunk, 8);
  KVStore(options()).put(spec, tokens, kv.view);
  // The filter disappears (eviction, FLUSH of that key...) and new puts arrive: none of them
  // may make the old entries unreachable.
  ReplyPtr del(server.command({"DEL", "kvb:v1:filter"}));
  ASSERT_EQ(del->integer, 1);
  const auto later = testing::random_tokens(2 * kChunk, 9);
  { KVStore(options()).put(spec, later, kv.view); }  // opens (rebuilds), then puts
  KVStore reader(options());
  EXPECT_TRUE(reader.stats().remote.filter_active);
  expect_exact(reader.match(spec, tokens), kv);
  expect_exact(reader.match(spec, later), kv);
}

TEST_F(StoreRedis, ARebuildRacingPutsKeepsEveryEntryReachable) {
  // Half-built filters (ready flag 0) switch filtering off; stores keep putting while one
  // rebuilds; afterwards every entry must pass the filter.
  StoreOptions o = options();
  o.redis.filter_refresh_ms = 20;
  std::vector<std::vector<int64_t>> prompts;
  for (uint64_t i = 0; i < 40; ++i) prompts.push_back(testing::random_tokens(kChunk, 500 + i));
  DenseKV kv(spec, kChunk, 1);
  {
    KVStore a(o);
    for (int i = 0; i < 20; ++i) a.put(spec, prompts[i], kv.view);
    ReplyPtr del(server.command({"DEL", "kvb:v1:filter"}));
    for (int i = 20; i < 40; ++i) {
      a.put(spec, prompts[i], kv.view);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  KVStore reader(options());
  ASSERT_TRUE(reader.stats().remote.filter_active);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(reader.match(spec, prompts[i]).tokens(), kChunk) << i;
  EXPECT_EQ(reader.stats().remote.filter_negatives, 0);
}

TEST_F(StoreRedis, TenantProbesTakeTheSameMissPathAsAnyMiss) {
  // Tenant A stores a prompt; tenant B probes A's exact tokens and then tokens nobody stored.
  // Both are misses, and every counter moves identically: the probe learns nothing.
  testing::TempDir dir;
  for (bool filter : {true, false}) {
    StoreOptions o = options(filter);
    o.disk.dir = dir.path + (filter ? "/f" : "/n");
    o.disk.fsync = false;
    o.redis.key_prefix = filter ? "pf" : "pn";
    KVStore store(o);
    const auto tokens = testing::random_tokens(3 * kChunk, 10);
    DenseKV kv(spec, 3 * kChunk, 10);
    store.put(spec, tokens, kv.view, "tenant-a");
    auto delta = [&](const std::vector<int64_t>& probe) {
      const StoreStats b = store.stats();
      EXPECT_EQ(store.match(spec, probe, "tenant-b").tokens(), 0);
      const StoreStats a = store.stats();
      return std::vector<int64_t>{
          a.misses - b.misses, a.memory.misses - b.memory.misses,
          a.disk.misses - b.disk.misses, a.redis.misses - b.redis.misses,
          a.remote.round_trips - b.remote.round_trips,
          a.remote.filter_negatives - b.remote.filter_negatives,
          a.remote.filter_passes - b.remote.filter_passes,
          a.collisions - b.collisions, a.disk.bytes_read - b.disk.bytes_read,
          a.redis.bytes_read - b.redis.bytes_read};
    };
    const auto probe = delta(tokens);
    const auto random = delta(testing::random_tokens(3 * kChunk, 11));
    EXPECT_EQ(probe, random) << "filter " << filter;
    EXPECT_EQ(probe[0], 1);
    EXPECT_EQ(probe[4], filter ? 0 : 1);
    EXPECT_EQ(store.match(spec, tokens, "tenant-a").tokens(), 3 * kChunk);
  }
}

// Key prefixes outside [A-Za-z0-9._-] are percent-encoded in every key; invalidate, clear and
// the filter rebuild must SCAN for the encoded form (with glob characters escaped).
TEST_F(StoreRedis, EveryKeyPrefixReachesInvalidateClearAndTheFilterRebuild) {
  const std::vector<std::string> prefixes = {"app:kvb", "a*b", "q?", "br[ck]t", "back\\slash",
                                             "with space", "caf\u00e9-\u65e5\u672c", "%41"};
  const auto tokens = testing::random_tokens(2 * kChunk, 40);
  DenseKV kv(spec, 2 * kChunk, 40);
  for (const std::string& prefix : prefixes) {
    SCOPED_TRACE(prefix);
    StoreOptions o = options();
    o.redis.key_prefix = prefix;
    {
      KVStore store(o);
      ASSERT_EQ(store.put(spec, tokens, kv.view), 2 * kChunk);
      const InvalidateResult r = store.invalidate(spec);
      EXPECT_EQ(r.redis, 2);
      EXPECT_TRUE(r.redis_complete);
    }
    EXPECT_EQ(KVStore(o).match(spec, tokens).tokens(), 0);  // invalidated means gone

    // A lost filter is rebuilt from the keys under this prefix, so they stay reachable.
    { KVStore(o).put(spec, tokens, kv.view); }
    ReplyPtr keys(server.command({"DBSIZE"}));
    ASSERT_GE(keys->integer, 3);  // two entries and the filter
    std::string encoded;
    {
      ReplyPtr all(server.command({"KEYS", "*filter"}));
      ASSERT_EQ(all->elements, 1u);
      encoded.assign(all->element[0]->str, all->element[0]->len);
    }
    ReplyPtr del(server.command({"DEL", encoded}));
    ASSERT_EQ(del->integer, 1);
    {
      KVStore rebuilt(o);
      EXPECT_TRUE(rebuilt.stats().remote.filter_active);
      EXPECT_EQ(rebuilt.stats().remote.filter_rebuilds, 1);
    }
    KVStore reader(o);
    EXPECT_TRUE(reader.stats().remote.filter_active);
    expect_exact(reader.match(spec, tokens), kv);

    reader.clear(kAllTiers);
    ReplyPtr none(server.command({"DBSIZE"}));
    EXPECT_EQ(none->integer, 0);
  }
}

TEST_F(StoreRedis, InvalidateAndEraseReachRedis) {
  const ModelSpec other = [&] {
    ModelSpec s = spec;
    s.version = "rev-2";
    return s;
  }();
  const auto tokens = testing::random_tokens(4 * kChunk, 12);
  DenseKV kv(spec, 4 * kChunk, 12);
  {
    KVStore store(options());
    store.put(spec, tokens, kv.view, "t1");
    store.put(spec, tokens, kv.view, "t:2");
    store.put(other, tokens, kv.view, "t1");
    const InvalidateResult r = store.invalidate(spec);
    EXPECT_EQ(r.memory, 8);
    EXPECT_EQ(r.redis, 8);
    EXPECT_TRUE(r.redis_complete);
    store.put(other, tokens, kv.view, "t3");
    EXPECT_EQ(store.erase(other, tokens, "t3"), 4);  // memory entries; Redis DEL not counted
  }
  KVStore fresh(options());
  EXPECT_EQ(fresh.match(spec, tokens, "t1").tokens(), 0);
  EXPECT_EQ(fresh.match(spec, tokens, "t:2").tokens(), 0);
  EXPECT_EQ(fresh.match(other, tokens, "t3").tokens(), 0);
  Match m = fresh.match(other, tokens, "t1");
  EXPECT_EQ(m.tokens(), 4 * kChunk);
  ReplyPtr keys(server.command({"KEYS", "kvb:v1:*:" + other.fingerprint() + ":*"}));
  EXPECT_EQ(keys->elements, 4u);
  fresh.clear(kAllTiers);
  ReplyPtr none(server.command({"DBSIZE"}));
  EXPECT_EQ(none->integer, 0);
}

TEST_F(StoreRedis, ServerKilledThenBackWhileMemoryAndDiskKeepServing) {
  testing::TempDir dir;
  StoreOptions o = options(/*filter=*/false);
  o.disk.dir = dir.path;
  o.disk.fsync = false;
  KVStore store(o);
  const auto a = testing::random_tokens(2 * kChunk, 20), b = testing::random_tokens(2 * kChunk, 21);
  DenseKV kv(spec, 2 * kChunk, 20);
  ASSERT_EQ(store.put(spec, a, kv.view), 2 * kChunk);
  server.stop();

  // Memory and disk keep serving; a lookup Redis would have answered is a miss, counted.
  expect_exact(store.match(spec, a), kv);
  store.clear(kMemoryTier);
  expect_exact(store.match(spec, a), kv);
  EXPECT_EQ(store.match(spec, b).tokens(), 0);
  StoreStats st = store.stats();
  EXPECT_GE(st.redis.errors, 1);
  // While marked down, operations are skipped without touching the network.
  const int64_t skipped = st.remote.skipped;
  EXPECT_EQ(store.match(spec, b).tokens(), 0);
  EXPECT_EQ(store.put(spec, b, kv.view), 2 * kChunk);  // memory and disk take it
  st = store.stats();
  EXPECT_GE(st.remote.skipped, skipped + 1);
  EXPECT_GE(st.redis.write_failures, 1);
  EXPECT_EQ(st.disk.entries, 4);

  // Back (empty: no persistence). The store reconnects after its backoff and writes again.
  ASSERT_TRUE(server.start());
  const auto c = testing::random_tokens(2 * kChunk, 22);
  bool written = false;
  for (int i = 0; i < 500 && !written; ++i) {
    store.erase(spec, c, "default", kMemoryTier | kDiskTier);
    store.put(spec, c, kv.view);
    written = store.stats().redis.writes > st.redis.writes;
    if (!written) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(written);
  EXPECT_GE(store.stats().remote.reconnects, 1);
  KVStore other(options(false));
  expect_exact(other.match(spec, c), kv);
}

// Chunks put while Redis was down (or before a restart that lost them) are sent again by the
// next put of their prefix once the tier is back, so other stores see the whole prefix.
TEST_F(StoreRedis, APutAfterAnOutageRepairsTheChunksRedisMissed) {
  KVStore store(options());
  const auto tokens = testing::random_tokens(4 * kChunk, 23);
  DenseKV kv(spec, 4 * kChunk, 23);
  const auto before = testing::random_tokens(2 * kChunk, 24);
  DenseKV kv_before(spec, 2 * kChunk, 24);
  ASSERT_EQ(store.put(spec, before, kv_before.view), 2 * kChunk);  // reached Redis...
  server.stop();                                                  // ...which restarts empty
  const TokenSpan head{tokens.data(), static_cast<size_t>(2 * kChunk)};
  EXPECT_EQ(store.put(spec, head, kv.view.slice_tokens(0, 2 * kChunk)), 2 * kChunk);  // memory
  ASSERT_TRUE(server.start());
  const int64_t writes = store.stats().redis.writes;
  for (int i = 0; i < 500 && store.stats().redis.writes == writes; ++i) {
    store.put(spec, tokens, kv.view);  // the whole prompt: two chunks in memory, two new
    if (store.stats().redis.writes == writes)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GT(store.stats().redis.writes, writes);
  store.put(spec, before, kv_before.view);
  KVStore other(options());
  expect_exact(other.match(spec, tokens), kv);
  expect_exact(other.match(spec, before), kv_before);
  // Once repaired, a put sends nothing again.
  const int64_t repaired = store.stats().redis.writes;
  store.put(spec, tokens, kv.view);
  store.put(spec, before, kv_before.view);
  EXPECT_EQ(store.stats().redis.writes, repaired);
}

TEST_F(StoreRedis, HungServerCostsOneTimeoutThenIsSkipped) {
  StoreOptions o = options(/*filter=*/false);
  o.redis.command_timeout_ms = 100;
  o.redis.connect_timeout_ms = 100;
  o.redis.retry_min_ms = 10000;  // no retry during the test's lookups
  o.redis.retry_max_ms = 10000;
  KVStore store(o);
  const auto a = testing::random_tokens(kChunk, 30);
  DenseKV kv(spec, kChunk, 30);
  store.put(spec, a, kv.view);
  server.pause();  // accepts TCP (the kernel does), never answers
  const auto b = testing::random_tokens(kChunk, 31);
  EXPECT_EQ(store.match(spec, b).tokens(), 0);  // one command timeout
  StoreStats st = store.stats();
  EXPECT_EQ(st.redis.errors, 1);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(store.match(spec, b).tokens(), 0);
  EXPECT_EQ(store.stats().remote.skipped - st.remote.skipped, 5);
  EXPECT_EQ(store.stats().redis.errors, 1);
  expect_exact(store.match(spec, a), kv);  // memory unaffected
  server.resume();
}

TEST_F(StoreRedis, UnreachableAtOpenAndBadUrls) {
  StoreOptions o = options();
  o.redis.url = "redis://127.0.0.1:" + std::to_string(testing::free_port());
  KVStore store(o);  // no throw: marked down, retried later
  const auto a = testing::random_tokens(kChunk, 40);
  DenseKV kv(spec, kChunk, 40);
  EXPECT_EQ(store.put(spec, a, kv.view), kChunk);
  EXPECT_EQ(store.match(spec, testing::random_tokens(kChunk, 41)).tokens(), 0);
  EXPECT_FALSE(store.stats().remote.filter_active);
  for (const char* bad : {"http://x", "redis://h:0", "redis://h:99999", "redis://h:12/x",
                          "redis://nocolon@h"}) {
    StoreOptions b = options();
    b.redis.url = bad;
    EXPECT_THROW(KVStore s(b), InvalidArgument) << bad;
  }
  StoreOptions b = options();
  b.redis.filter_bits = 1000;
  EXPECT_THROW(KVStore s(b), InvalidArgument);
}

TEST_F(StoreRedis, MetricsTextNamesEveryTier) {
  KVStore store(options());
  const auto a = testing::random_tokens(kChunk, 50);
  DenseKV kv(spec, kChunk, 50);
  store.put(spec, a, kv.view);
  store.match(spec, testing::random_tokens(kChunk, 51));
  const std::string text = store.metrics_text();
  for (const char* line :
       {"# TYPE kvbridge_store_hits_total counter", "kvbridge_store_hits_total{tier=\"redis\"} 0",
        "kvbridge_store_writes_total{tier=\"redis\"} 1", "kvbridge_store_tier_enabled{tier=\"disk\"} 0",
        "kvbridge_store_filter_negatives_total 1", "# TYPE kvbridge_store_remote_latency_seconds histogram",
        "kvbridge_store_remote_latency_seconds_bucket{le=\"+Inf\"} ", "kvbridge_store_remote_errors_total 0"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  // Every sample line is "name[{labels}] value".
  std::istringstream in(text);
  std::string l;
  while (std::getline(in, l)) {
    if (l.empty() || l[0] == '#') continue;
    EXPECT_EQ(l.rfind("kvbridge_store_", 0), 0u) << l;
    EXPECT_NE(l.find(' '), std::string::npos) << l;
  }
}

}  // namespace
}  // namespace kvbridge
