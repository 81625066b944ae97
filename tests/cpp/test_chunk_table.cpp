// The memory tier's open-addressing index against std::map as the reference, on seeded random
// operations, with keys crafted so that many share a home slot (long runs, wrap-around, and the
// backward shift of erase are all exercised).
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "src/index/chunk_table.h"

namespace kvbridge::detail {
namespace {

struct Value {
  std::unique_ptr<int> v;
  explicit operator bool() const noexcept { return v != nullptr; }
};

using Key = std::pair<uint64_t, uint64_t>;

void expect_same(ChunkTable<Value>& table, const std::map<Key, int>& ref,
                 const std::vector<Hash128>& universe) {
  ASSERT_EQ(table.size(), ref.size());
  for (const Hash128& k : universe) {
    auto it = ref.find({k.low, k.high});
    Value* got = table.find(k);
    if (it == ref.end()) {
      EXPECT_EQ(got, nullptr);
    } else {
      ASSERT_NE(got, nullptr);
      EXPECT_EQ(*got->v, it->second);
    }
  }
  size_t seen = 0;
  table.for_each([&](const Hash128& k, const Value& v) {
    ++seen;
    auto it = ref.find({k.low, k.high});
    ASSERT_NE(it, ref.end());
    EXPECT_EQ(*v.v, it->second);
  });
  EXPECT_EQ(seen, ref.size());
}

TEST(ChunkTable, MatchesReferenceUnderRandomInsertAndErase) {
  std::mt19937_64 rng(20261203);
  // 300 keys whose low bits take only 7 values (mod 2^k for any table size): runs of ~40.
  std::vector<Hash128> universe;
  for (int i = 0; i < 300; ++i) {
    const uint64_t low = (rng() << 8) | static_cast<uint64_t>(rng() % 7) * 37 % 256;
    universe.push_back(Hash128{low | 1, rng()});
  }
  ChunkTable<Value> table;
  std::map<Key, int> ref;
  for (int step = 0; step < 20000; ++step) {
    const Hash128& k = universe[rng() % universe.size()];
    const Key rk{k.low, k.high};
    const bool present = ref.count(rk) != 0;
    if (!present && rng() % 3 != 0) {
      const int v = static_cast<int>(rng() % 1000003) + 1;
      table.insert(k).v = std::make_unique<int>(v);
      ref[rk] = v;
    } else if (present) {
      Value gone = table.erase(k);
      ASSERT_TRUE(gone);
      EXPECT_EQ(*gone.v, ref[rk]);
      ref.erase(rk);
    } else {
      EXPECT_FALSE(table.erase(k));  // absent: nothing removed
    }
    if (step % 997 == 0) expect_same(table, ref, universe);
  }
  expect_same(table, ref, universe);
  std::vector<Value> all = table.take_all();
  EXPECT_EQ(all.size(), ref.size());
  EXPECT_EQ(table.size(), 0u);
  for (const Hash128& k : universe) EXPECT_EQ(table.find(k), nullptr);
}

}  // namespace
}  // namespace kvbridge::detail
