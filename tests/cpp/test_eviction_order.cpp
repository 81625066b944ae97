// EvictionOrder's LRU, whose uses move to the front lazily (a run of neighbours in one splice),
// against a list that moves each used entry at once, on seeded random operations: single uses,
// the walks towards the front that repeated prefix lookups make, inserts and erases, the order
// read back in full after each step.
#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "src/store/eviction_order.h"

namespace kvbridge::detail {
namespace {

using Key = std::pair<uint64_t, uint64_t>;

std::vector<Key> coldest_first(EvictionOrder& order) {
  std::vector<Key> out;
  order.find_coldest([&](const Hash128& k) {
    out.emplace_back(k.low, k.high);
    return false;
  });
  return out;
}

TEST(EvictionOrder, LazyLruMovesMatchMovingEachUse) {
  std::mt19937_64 rng(20261206);
  std::vector<Hash128> universe;
  for (int i = 0; i < 64; ++i) universe.push_back(Hash128{rng(), rng()});
  EvictionOrder order(EvictionPolicy::kLRU);
  std::map<Key, EvictionOrder::Handle> handles;
  std::list<Key> ref;  // front: most recent
  const auto use = [&](const Hash128& k) {
    const Key rk{k.low, k.high};
    order.touch(handles.at(rk), k);
    ref.remove(rk);
    ref.push_front(rk);
  };
  int walks = 0;
  for (int step = 0; step < 4000; ++step) {
    const Hash128& k = universe[rng() % universe.size()];
    const Key rk{k.low, k.high};
    const bool present = handles.count(rk) != 0;
    const int op = static_cast<int>(rng() % 8);
    if (!present) {
      handles[rk] = order.insert(k, step);
      ref.push_front(rk);
    } else if (op == 0) {
      order.erase(handles.at(rk));
      handles.erase(rk);
      ref.remove(rk);
    } else if (op <= 3) {
      use(k);
    } else {
      // A walk: from a random entry towards the front, each one the neighbour before the last,
      // as the reference list holds them (some walks start at or reach the front).
      std::vector<Key> walk;
      auto it = std::find(ref.begin(), ref.end(), rk);
      const size_t len = 1 + rng() % 12;
      for (;;) {
        walk.push_back(*it);
        if (walk.size() == len || it == ref.begin()) break;
        --it;
      }
      for (const Key& w : walk) use(Hash128{w.first, w.second});
      ++walks;
    }
    if (step % 3 == 0) {  // reading the order settles it; the other steps leave uses pending
      const std::vector<Key> want(ref.rbegin(), ref.rend());
      ASSERT_EQ(coldest_first(order), want) << "step " << step;
    }
  }
  EXPECT_GT(walks, 1000);
}

}  // namespace
}  // namespace kvbridge::detail
