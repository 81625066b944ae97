#include <gtest/gtest.h>

#include "test_util.h"

namespace kvbridge {
namespace {

using testing::DenseKV;
using testing::HFKV;
using testing::same_elements;

constexpr int64_t kChunk = 16;

StoreOptions options(int64_t capacity, int shards = 4) {
  StoreOptions o;
  o.capacity_bytes = capacity;
  o.chunk_tokens = kChunk;
  o.num_shards = shards;
  return o;
}

int64_t entry_bytes(const ModelSpec& spec) {
  return spec.kv_bytes_per_token() * kChunk + 4 * kChunk + StoreStats::kEntryOverheadBytes;
}

TEST(KVStore, PutThenMatchReturnsTheBytes) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const ModelSpec spec = testing::small_spec(dtype, 3, 5, 14);
    KVStore store(options(1 << 24));
    const auto tokens = testing::random_tokens(3 * kChunk + 7, 2);
    HFKV kv(spec, static_cast<int64_t>(tokens.size()), 3, 9);  // strided input
    EXPECT_EQ(store.put(spec, tokens, kv.view()), 3 * kChunk);

    Match m = store.match(spec, tokens);
    ASSERT_EQ(m.tokens(), 3 * kChunk);
    HFKV out(spec, m.tokens(), 1, 99);
    m.copy_to(out.view());
    EXPECT_TRUE(same_elements(out.view(), kv.view().slice_tokens(0, 3 * kChunk)));

    // A longer query with the same prefix matches the cached part; a partial range copies right.
    auto longer = tokens;
    longer.insert(longer.end(), 40, 5);
    EXPECT_EQ(store.match(spec, longer).tokens(), 3 * kChunk);
    DenseKV mid(spec, 21, 4);
    m.copy_range_to(13, mid.view);
    EXPECT_TRUE(same_elements(mid.view, kv.view().slice_tokens(13, 21)));
  }
}

TEST(KVStore, ConvertedProvenanceIsTheFirstConvertedChunks) {
  const ModelSpec spec = testing::small_spec(DType::kFloat32, 2, 3, 8);
  KVStore store(options(1 << 24));
  const auto tokens = testing::random_tokens(4 * kChunk, 5);
  const Provenance first{std::string(32, '1'), std::string(32, 'a')};
  const Provenance second{std::string(32, '2'), std::string(32, 'b')};
  HFKV kv(spec, 4 * kChunk, 2, 6);
  const TokenSpan all(tokens);
  store.put(spec, all.first(kChunk), kv.view().slice_tokens(0, kChunk));  // the model's own
  EXPECT_FALSE(store.match(spec, all.first(kChunk)).converted_provenance().converted());
  store.put(spec, all.first(3 * kChunk), kv.view().slice_tokens(0, 3 * kChunk), "default",
            first);
  store.put(spec, all, kv.view(), "default", second);
  const Match m = store.match(spec, all);
  ASSERT_EQ(m.chunks(), 4);
  EXPECT_FALSE(m.provenance(0).converted());
  EXPECT_EQ(m.provenance(3).adapter_fingerprint, second.adapter_fingerprint);
  const Provenance p = m.converted_provenance();
  EXPECT_EQ(p.source_fingerprint, first.source_fingerprint);
  EXPECT_EQ(p.adapter_fingerprint, first.adapter_fingerprint);
  EXPECT_FALSE(Match().converted_provenance().converted());
}

// match_length: match()'s length, provenance and counters, with nothing left pinned.
TEST(KVStore, MatchLengthIsMatchWithoutPins) {
  const ModelSpec spec = testing::small_spec(DType::kFloat32, 2, 3, 8);
  // Room for exactly 4 entries: a pinned one could not be evicted by a fifth.
  KVStore store(options(4 * entry_bytes(spec), 1));
  const auto tokens = testing::random_tokens(4 * kChunk + 3, 7);
  const Provenance converted{std::string(32, '3'), std::string(32, 'c')};
  HFKV kv(spec, static_cast<int64_t>(tokens.size()), 2, 4);
  const TokenSpan all(tokens);
  store.put(spec, all.first(2 * kChunk), kv.view().slice_tokens(0, 2 * kChunk));
  store.put(spec, all, kv.view(), "default", converted);
  for (size_t n : {size_t{5}, size_t{kChunk}, size_t{3 * kChunk + 1}, tokens.size()}) {
    const StoreStats before = store.stats();
    const MatchLength len = store.match_length(spec, all.first(n));
    const StoreStats mid = store.stats();
    const Match m = store.match(spec, all.first(n));
    const StoreStats after = store.stats();
    EXPECT_EQ(len.tokens, m.tokens()) << n;
    EXPECT_EQ(len.converted_provenance.source_fingerprint,
              m.converted_provenance().source_fingerprint) << n;
    EXPECT_EQ(len.converted_provenance.adapter_fingerprint,
              m.converted_provenance().adapter_fingerprint) << n;
    EXPECT_EQ(mid.matches - before.matches, after.matches - mid.matches) << n;
    EXPECT_EQ(mid.hits - before.hits, after.hits - mid.hits) << n;
    EXPECT_EQ(mid.hit_chunks - before.hit_chunks, after.hit_chunks - mid.hit_chunks) << n;
    EXPECT_EQ(mid.memory.hit_chunks - before.memory.hit_chunks,
              after.memory.hit_chunks - mid.memory.hit_chunks) << n;
  }
  EXPECT_EQ(store.match_length(spec, all).converted_provenance.adapter_fingerprint,
            converted.adapter_fingerprint);
  EXPECT_EQ(store.match_length(spec, all, "other").tokens, 0);
  // Nothing stays pinned: after a length-only match a fifth chunk evicts the coldest.
  const auto other = testing::random_tokens(kChunk, 8);
  HFKV kv2(spec, kChunk, 1, 5);
  store.match_length(spec, all);
  EXPECT_EQ(store.put(spec, other, kv2.view()), kChunk);
  EXPECT_EQ(store.stats().evictions, 1);
  EXPECT_EQ(store.match_length(spec, all).tokens, 0);  // chunk 0 was the coldest
}

TEST(KVStore, OptionsHaveUpperBoundsAndPathsNoNul) {
  StoreOptions o = options(1 << 20);
  o.chunk_tokens = int64_t{1} << 62;
  EXPECT_THROW(KVStore{o}, InvalidArgument);
  o.chunk_tokens = (int64_t{1} << 24) + 1;
  EXPECT_THROW(KVStore{o}, InvalidArgument);
  o = options(1 << 20);
  o.ttl_seconds = kMaxTtlSeconds + 1;  // ttl_seconds * 1000 would overflow near 2^63
  EXPECT_THROW(KVStore{o}, InvalidArgument);
  o = options(1 << 20);
  o.disk.dir = std::string("/tmp/a") + std::string(1, '\0') + "b";
  EXPECT_THROW(KVStore{o}, InvalidArgument);
}

TEST(KVStore, PrefixDivergenceStopsTheMatch) {
  const ModelSpec spec = testing::small_spec();
  KVStore store(options(1 << 22));
  auto tokens = testing::random_tokens(4 * kChunk, 3);
  DenseKV kv(spec, 4 * kChunk, 1);
  store.put(spec, tokens, kv.view);
  tokens[2 * kChunk + 5] += 1;
  EXPECT_EQ(store.match(spec, tokens).tokens(), 2 * kChunk);
  tokens[0] += 1;
  Match miss = store.match(spec, tokens);
  EXPECT_EQ(miss.tokens(), 0);
  EXPECT_FALSE(miss);
  const StoreStats st = store.stats();
  EXPECT_EQ(st.matches, 2);
  EXPECT_EQ(st.hits, 1);
  EXPECT_EQ(st.misses, 1);
}

TEST(KVStore, NamespacesAndModelsNeverShare) {
  const ModelSpec spec = testing::small_spec();
  KVStore store(options(1 << 22));
  const auto tokens = testing::random_tokens(2 * kChunk, 4);
  DenseKV kv(spec, 2 * kChunk, 2);
  store.put(spec, tokens, kv.view, "tenant-a");
  EXPECT_EQ(store.match(spec, tokens, "tenant-a").tokens(), 2 * kChunk);
  EXPECT_EQ(store.match(spec, tokens, "tenant-b").tokens(), 0);
  EXPECT_EQ(store.match(spec, tokens).tokens(), 0);
  ModelSpec lora = spec;
  lora.version = "lora-7";
  EXPECT_EQ(store.match(lora, tokens, "tenant-a").tokens(), 0);
}

TEST(KVStore, PartialChunkIsNeverStored) {
  const ModelSpec spec = testing::small_spec();
  KVStore store(options(1 << 22));
  const auto tokens = testing::random_tokens(kChunk - 1, 4);
  DenseKV kv(spec, kChunk - 1, 2);
  EXPECT_EQ(store.put(spec, tokens, kv.view), 0);
  EXPECT_EQ(store.stats().memory.entries, 0);
  EXPECT_EQ(store.match(spec, tokens).tokens(), 0);
}

TEST(KVStore, BudgetNeverExceededUnderTenTimesCapacity) {
  const ModelSpec spec = testing::small_spec(DType::kBFloat16, 4, 2, 8);
  const int64_t capacity = 10 * entry_bytes(spec) + 17;
  KVStore store(options(capacity));
  int64_t offered = 0;
  for (uint64_t i = 0; offered < 10 * capacity; ++i) {
    const auto tokens = testing::random_tokens(3 * kChunk, 100 + i);
    DenseKV kv(spec, 3 * kChunk, i);
    store.put(spec, tokens, kv.view);
    offered += kv.view.bytes();
    ASSERT_LE(store.stats().bytes_used, capacity);
  }
  const StoreStats st = store.stats();
  EXPECT_LE(st.peak_bytes, capacity);
  EXPECT_GT(st.peak_bytes, capacity - entry_bytes(spec));  // the budget was actually used
  EXPECT_GT(st.evictions, 0);
  EXPECT_EQ(st.bytes_used, st.entries * entry_bytes(spec));
}

TEST(KVStore, EvictsLeastRecentlyUsed) {
  const ModelSpec spec = testing::small_spec();
  KVStore store(options(3 * entry_bytes(spec), /*shards=*/1));
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(testing::random_tokens(kChunk, 10 + i));
  DenseKV kv(spec, kChunk, 1);
  for (int i = 0; i < 3; ++i) store.put(spec, prompts[i], kv.view);
  EXPECT_EQ(store.match(spec, prompts[0]).tokens(), kChunk);  // 0 becomes most recent
  store.put(spec, prompts[3], kv.view);                          // evicts 1
  EXPECT_EQ(store.match(spec, prompts[1]).tokens(), 0);
  EXPECT_EQ(store.match(spec, prompts[0]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, prompts[2]).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, prompts[3]).tokens(), kChunk);
  EXPECT_EQ(store.stats().evictions, 1);
}

TEST(KVStore, PinnedEntriesAreNotEvicted) {
  const ModelSpec spec = testing::small_spec();
  KVStore store(options(2 * entry_bytes(spec), 1));
  const auto a = testing::random_tokens(kChunk, 1), b = testing::random_tokens(kChunk, 2),
             c = testing::random_tokens(kChunk, 3);
  DenseKV kv_a(spec, kChunk, 1), kv(spec, kChunk, 2);
  store.put(spec, a, kv_a.view);
  Match held = store.match(spec, a);  // pins a
  store.put(spec, b, kv.view);
  store.put(spec, c, kv.view);  // must evict b, not the older but pinned a
  EXPECT_EQ(store.match(spec, b).tokens(), 0);
  DenseKV out(spec, kChunk, 5);
  held.copy_to(out.view);
  EXPECT_TRUE(same_elements(out.view, kv_a.view));

  // Everything pinned: a put finds no room and reports it.
  Match held_c = store.match(spec, c);
  EXPECT_EQ(store.put(spec, b, kv.view), 0);
  EXPECT_EQ(store.stats().chunks_rejected, 1);
  EXPECT_LE(store.stats().peak_bytes, 2 * entry_bytes(spec));
}

TEST(KVStore, ErasedWhilePinnedStaysAccountedUntilReleased) {
  const ModelSpec spec = testing::small_spec();
  KVStore store(options(1 << 20));
  const auto a = testing::random_tokens(2 * kChunk, 1);
  DenseKV kv(spec, 2 * kChunk, 1);
  store.put(spec, a, kv.view);
  {
    Match held = store.match(spec, a);
    EXPECT_EQ(store.erase(spec, a), 2);
    EXPECT_EQ(store.match(spec, a).tokens(), 0);
    EXPECT_EQ(store.stats().bytes_used, 2 * entry_bytes(spec));
    DenseKV out(spec, 2 * kChunk, 5);
    held.copy_to(out.view);
    EXPECT_TRUE(same_elements(out.view, kv.view));
  }
  EXPECT_EQ(store.stats().bytes_used, 0);
  store.put(spec, a, kv.view);
  store.clear();
  EXPECT_EQ(store.stats().memory.entries, 0);
  EXPECT_EQ(store.stats().bytes_used, 0);
}

TEST(KVStore, MatchOutlivesStore) {
  const ModelSpec spec = testing::small_spec();
  const auto a = testing::random_tokens(kChunk, 1);
  DenseKV kv(spec, kChunk, 1);
  Match held;
  {
    KVStore store(options(1 << 20));
    store.put(spec, a, kv.view);
    held = store.match(spec, a);
  }
  DenseKV out(spec, kChunk, 5);
  held.copy_to(out.view);
  EXPECT_TRUE(same_elements(out.view, kv.view));
}

TEST(KVStore, BadInputIsInvalidArgument) {
  const ModelSpec spec = testing::small_spec();
  KVStore store(options(1 << 20));
  const auto tokens = testing::random_tokens(kChunk, 1);
  DenseKV kv(spec, kChunk, 1);
  auto expect_arg = [](auto&& fn, const char* needle) {
    try {
      fn();
      ADD_FAILURE() << "no exception, expected one mentioning " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_arg([&] { store.put(spec, std::vector<int64_t>{}, kv.view); }, "tokens");
  auto neg = tokens;
  neg[4] = -1;
  expect_arg([&] { store.put(spec, neg, kv.view); }, "tokens[4]");
  expect_arg([&] { store.match(spec, neg); }, "tokens[4]");
  const auto shorter = testing::random_tokens(kChunk - 2, 1);
  expect_arg([&] { store.put(spec, shorter, kv.view); }, "tokens");
  ModelSpec wrong = spec;
  wrong.num_layers = 4;
  expect_arg([&] { store.put(wrong, tokens, kv.view); }, "layers");
  wrong = spec;
  wrong.dtype = DType::kFloat16;
  expect_arg([&] { store.put(wrong, tokens, kv.view); }, "dtype");
  wrong = spec;
  wrong.head_dim = 0;
  expect_arg([&] { store.match(wrong, tokens); }, "head_dim");
  KVView cuda = kv.view;
  cuda = KVView::contiguous(kv.bytes.data(), spec.dtype, Device{DeviceType::kCUDA, 0},
                            spec.num_layers, kChunk, spec.num_kv_heads, spec.head_dim);
  expect_arg([&] { store.put(spec, tokens, cuda); }, "CPU");
  expect_arg([] { KVStore s(options(0)); }, "capacity_bytes");
  StoreOptions o = options(100);
  o.chunk_tokens = 0;
  expect_arg([&] { KVStore s(o); }, "chunk_tokens");
  Match m = store.match(spec, tokens);
  EXPECT_EQ(m.tokens(), 0);
  store.put(spec, tokens, kv.view);
  m = store.match(spec, tokens);
  DenseKV wrong_out(testing::small_spec(DType::kFloat32, 3, 2, 8), kChunk, 1);
  expect_arg([&] { m.copy_to(wrong_out.view); }, "geometry");
  DenseKV short_out(spec, kChunk - 1, 1);
  expect_arg([&] { m.copy_to(short_out.view); }, "tokens");
}

}  // namespace
}  // namespace kvbridge

namespace kvbridge {
namespace {

TEST(KVStore, RecyclesLargePayloadsWithinTheBudget) {
  // 1 layer x 8 heads x 128 dim x bf16 = 4 KiB per token; 256-token chunks are 1 MiB payloads.
  ModelSpec spec = testing::small_spec(DType::kBFloat16, 1, 8, 128);
  StoreOptions o;
  o.chunk_tokens = 256;
  o.num_shards = 2;
  const int64_t entry = (int64_t{1} << 20) + 4 * 256 + StoreStats::kEntryOverheadBytes;
  o.capacity_bytes = 3 * entry;
  KVStore store(o);
  const auto a = testing::random_tokens(256, 1), b = testing::random_tokens(256, 2);
  testing::DenseKV kv_a(spec, 256, 1), kv_b(spec, 256, 2);
  store.put(spec, a, kv_a.view);
  store.erase(spec, a);
  StoreStats st = store.stats();
  EXPECT_EQ(st.recycled_bytes, int64_t{1} << 20);
  EXPECT_EQ(st.bytes_used, int64_t{1} << 20);  // the kept buffer stays accounted
  store.put(spec, b, kv_b.view);
  st = store.stats();
  EXPECT_EQ(st.recycled_bytes, 0);
  EXPECT_EQ(st.bytes_used, entry);
  Match m = store.match(spec, b);
  testing::DenseKV out(spec, 256, 3);
  m.copy_to(out.view);
  EXPECT_TRUE(testing::same_elements(out.view, kv_b.view));  // a's old bytes are gone
  m = Match();

  // Kept buffers give way to new entries before anything is evicted, and never break the budget.
  for (uint64_t i = 0; i < 20; ++i) {
    const auto t = testing::random_tokens(256, 10 + i);
    store.put(spec, t, kv_a.view);
    if (i % 3 == 0) store.erase(spec, t);
    ASSERT_LE(store.stats().bytes_used, o.capacity_bytes);
  }
  EXPECT_LE(store.stats().peak_bytes, o.capacity_bytes);
}

TEST(KVStore, InvalidateAdapterCountsTheMemoryEntriesItErases) {
  const ModelSpec spec = testing::small_spec(DType::kBFloat16, 2, 3, 10);
  KVStore store(options(1 << 24));
  const std::string source(32, 'a'), adapter_x = std::string(31, 'b') + "1",
                    adapter_y = std::string(31, 'b') + "2";
  struct Prompt {
    std::vector<int64_t> tokens;
    Provenance origin;
  };
  const std::vector<Prompt> prompts = {
      {testing::random_tokens(2 * kChunk + 5, 31), {source, adapter_x}},
      {testing::random_tokens(1 * kChunk, 32), {source, adapter_y}},
      {testing::random_tokens(3 * kChunk + 1, 33), {}},
      {testing::random_tokens(1 * kChunk + 9, 34), {source, adapter_x}},
  };
  int64_t chunks = 0;
  for (const Prompt& p : prompts) {
    DenseKV kv(spec, static_cast<int64_t>(p.tokens.size()), 35 + p.tokens.size());
    chunks += store.put(spec, p.tokens, kv.view, "default", p.origin) / kChunk;
  }
  ASSERT_EQ(chunks, 7);
  ASSERT_EQ(store.stats().erased, 0);

  const InvalidateResult r = store.invalidate_adapter(spec, adapter_x);
  EXPECT_EQ(r.memory, 3);  // the two prompts converted by adapter x
  EXPECT_EQ(store.stats().erased, 3);
  EXPECT_EQ(store.stats().memory.entries, 4);
  EXPECT_EQ(store.match(spec, prompts[0].tokens).tokens(), 0);
  EXPECT_EQ(store.match(spec, prompts[3].tokens).tokens(), 0);
  EXPECT_EQ(store.match(spec, prompts[1].tokens).tokens(), kChunk);
  EXPECT_EQ(store.match(spec, prompts[2].tokens).tokens(), 3 * kChunk);

  // Another adapter's entries, then the model's: each removal is counted once.
  EXPECT_EQ(store.invalidate_adapter(spec, adapter_x).memory, 0);
  EXPECT_EQ(store.invalidate_adapter(spec, adapter_y).memory, 1);
  EXPECT_EQ(store.stats().erased, 4);
  EXPECT_EQ(store.invalidate(spec).memory, 3);
  EXPECT_EQ(store.stats().erased, 7);
  EXPECT_EQ(store.stats().memory.entries, 0);
}

// The one table of tiers: every tier once, memory first, the bits covering kAllTiers, and each
// its own stats section and metrics_text() samples.
TEST(KVStore, TableOfTiersNamesEachTierOnce) {
  const std::vector<StoreTierInfo>& tiers = store_tiers();
  ASSERT_EQ(tiers.size(), 3u);
  EXPECT_STREQ(tiers[0].name, "memory");
  EXPECT_EQ(tiers[0].bit, kMemoryTier);
  unsigned bits = 0;
  StoreStats st;
  for (const StoreTierInfo& t : tiers) {
    EXPECT_EQ(bits & t.bit, 0u) << t.name;
    bits |= t.bit;
    (st.*t.stats).entries = 7;  // marks its own section only
  }
  EXPECT_EQ(bits, kAllTiers);
  EXPECT_EQ(st.memory.entries + st.disk.entries + st.redis.entries, 21);
  KVStore store(options(1 << 20));
  const std::string text = store.metrics_text();
  for (const StoreTierInfo& t : tiers)
    EXPECT_NE(text.find(std::string("kvbridge_store_tier_enabled{tier=\"") + t.name + "\"} " +
                        (t.bit == kMemoryTier ? "1" : "0")),
              std::string::npos)
        << t.name;
}

}  // namespace
}  // namespace kvbridge
