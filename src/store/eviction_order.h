// The order in which a tier drops entries, for each EvictionPolicy. Not thread-safe: the owner
// guards it with the same lock as its index.
#pragma once

#include <cstdint>
#include <iterator>
#include <list>
#include <set>
#include <tuple>

#include "kvbridge/kv_store.h"

namespace kvbridge::detail {

struct HashOf {
  size_t operator()(const Hash128& h) const noexcept { return static_cast<size_t>(h.low ^ h.high); }
};

class EvictionOrder {
 public:
  // LRU keeps a list (front: most recent) so a use is one splice. LFU and TTL keep an ordered
  // set of (uses or creation time, insertion sequence, key): coldest first.
  using Rank = std::tuple<int64_t, uint64_t, uint64_t, uint64_t>;  // (primary, seq, low, high)
  struct Handle {
    std::list<Hash128>::iterator pos;
    std::set<Rank>::iterator rank;
    int64_t uses = 0;
  };

  explicit EvictionOrder(EvictionPolicy policy) : policy_(policy) {}

  EvictionPolicy policy() const noexcept { return policy_; }

  Handle insert(const Hash128& key, int64_t created_ms) {
    settle();
    Handle h;
    h.uses = 1;
    if (policy_ == EvictionPolicy::kLRU) {
      lru_.push_front(key);
      h.pos = lru_.begin();
    } else {
      const int64_t primary = policy_ == EvictionPolicy::kLFU ? h.uses : created_ms;
      h.rank = ranks_.emplace(primary, ++seq_, key.low, key.high).first;
    }
    return h;
  }

  /// A use of h's entry. Under LRU the move to the front waits until the next call of another
  /// method (or settle()), so that uses of neighbours walking towards the front, as a prefix
  /// lookup makes them each time it hits the same prefix again, move as one range: one splice
  /// instead of one per entry, and none when the range is at the front already. The order
  /// every other method sees is the one of moving each entry in turn.
  void touch(Handle& h, const Hash128& key) {
    ++h.uses;
    if (policy_ == EvictionPolicy::kLRU) {
      if (pending_ && std::next(h.pos) == pending_front_) {
        pending_front_ = h.pos;  // the entry just before the range: it joins at the front
      } else {
        settle();
        pending_ = true;
        pending_front_ = pending_back_ = h.pos;
      }
    } else if (policy_ == EvictionPolicy::kLFU) {
      ranks_.erase(h.rank);
      h.rank = ranks_.emplace(h.uses, ++seq_, key.low, key.high).first;
    }  // TTL: a use does not move an entry's expiry
  }

  /// Starts loading what touch(h) reads and writes first (a hint).
  void prefetch(const Handle& h) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
    if (policy_ == EvictionPolicy::kLRU) __builtin_prefetch(&*h.pos);  // LFU / TTL: a set node
#else
    (void)h;
#endif
  }

  /// Moves the pending uses' range to the front.
  void settle() {
    if (!pending_) return;
    pending_ = false;
    if (pending_front_ != lru_.begin())
      lru_.splice(lru_.begin(), lru_, pending_front_, std::next(pending_back_));
  }

  void erase(const Handle& h) {
    settle();
    if (policy_ == EvictionPolicy::kLRU) {
      lru_.erase(h.pos);
    } else {
      ranks_.erase(h.rank);
    }
  }

  void clear() {
    pending_ = false;
    lru_.clear();
    ranks_.clear();
  }

  /// Calls f(key) for entries coldest first until f returns true; returns whether it did.
  template <class F>
  bool find_coldest(F&& f) {
    settle();
    if (policy_ == EvictionPolicy::kLRU) {
      for (auto it = lru_.rbegin(); it != lru_.rend(); ++it)
        if (f(*it)) return true;
    } else {
      for (const Rank& r : ranks_)
        if (f(Hash128{std::get<2>(r), std::get<3>(r)})) return true;
    }
    return false;
  }

 private:
  EvictionPolicy policy_;
  std::list<Hash128> lru_;
  // LRU uses not yet moved: the range [pending_front_, pending_back_] of lru_, front first,
  // whose entries were used back to front.
  bool pending_ = false;
  std::list<Hash128>::iterator pending_front_, pending_back_;
  std::set<Rank> ranks_;
  uint64_t seq_ = 0;
};

}  // namespace kvbridge::detail
