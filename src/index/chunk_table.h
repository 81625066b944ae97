// The memory tier's index of one shard: an open-addressing hash table keyed by chunk hashes.
//
// Keys are 128-bit chain hashes, uniformly distributed already, so the home slot is the low
// bits of key.low and collisions are resolved by linear probing; a key and its value share one
// slot of a flat array (a lookup touches one cache line on a hit, no node chasing). Deletion
// shifts the following entries back, so there are no tombstones. The table doubles when it is
// half full. Not thread-safe: the owner guards it with its shard lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvbridge/prefix_hash.h"

namespace kvbridge::detail {

/// `Value` is default-constructible and movable; a slot is in use iff bool(value) is true, and
/// a value stored with insert() must be made true before the next call on the table.
template <typename Value>
class ChunkTable {
 public:
  ChunkTable() : slots_(kInitialSlots) {}

  size_t size() const noexcept { return size_; }

  Value* find(const Hash128& key) noexcept {
    for (size_t i = home(key);; i = next(i)) {
      Slot& s = slots_[i];
      if (!s.value) return nullptr;
      if (s.key == key) return &s.value;
    }
  }
  bool contains(const Hash128& key) noexcept { return find(key) != nullptr; }

  /// Starts loading key's home slot into the cache (a hint; the table is not read).
  void prefetch(const Hash128& key) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&slots_[home(key)]);
#else
    (void)key;
#endif
  }

  /// The value under `key`, which must be absent, default-constructed for the caller to fill.
  Value& insert(const Hash128& key) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    size_t i = home(key);
    while (slots_[i].value) i = next(i);
    ++size_;
    slots_[i].key = key;
    return slots_[i].value;
  }

  /// Removes `key`'s entry and returns its value (a false value if there was none).
  Value erase(const Hash128& key) {
    size_t i = home(key);
    for (;; i = next(i)) {
      if (!slots_[i].value) return Value();
      if (slots_[i].key == key) break;
    }
    Value gone = std::move(slots_[i].value);
    slots_[i].value = Value();
    --size_;
    // Backward shift: move each later entry of the run into the hole when its home slot does
    // not lie (cyclically) in (hole, its position].
    for (size_t j = next(i); slots_[j].value; j = next(j)) {
      const size_t h = home(slots_[j].key);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (stays) continue;
      slots_[i] = std::move(slots_[j]);
      slots_[j].value = Value();
      i = j;
    }
    return gone;
  }

  /// Calls f(key, value) for every entry; f must not modify the table.
  template <class F>
  void for_each(F&& f) {
    for (Slot& s : slots_)
      if (s.value) f(s.key, s.value);
  }

  /// Empties the table, handing its values to the caller (e.g. to free them unlocked).
  std::vector<Value> take_all() {
    std::vector<Value> out;
    out.reserve(size_);
    for (Slot& s : slots_)
      if (s.value) out.push_back(std::move(s.value));
    std::vector<Slot>(kInitialSlots).swap(slots_);
    size_ = 0;
    return out;
  }

 private:
  static constexpr size_t kInitialSlots = 16;
  // One cache line per slot: unaligned 56-byte slots (the store's) straddled two lines in six
  // of eight, and the prefetch of a home slot fetched only the first.
  struct alignas(64) Slot {
    Hash128 key;
    Value value;
  };

  size_t home(const Hash128& key) const noexcept {
    return static_cast<size_t>(key.low) & (slots_.size() - 1);
  }
  size_t next(size_t i) const noexcept { return (i + 1) & (slots_.size() - 1); }

  void grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    for (Slot& s : old) {
      if (!s.value) continue;
      size_t i = home(s.key);
      while (slots_[i].value) i = next(i);
      slots_[i] = std::move(s);
    }
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace kvbridge::detail
