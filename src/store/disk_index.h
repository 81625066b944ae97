// The files of the disk directory that one store knows of, in eviction order. Not thread-safe:
// the disk tier calls it under its lock.
#pragma once

#include <cstdint>
#include <iterator>
#include <unordered_map>

#include "src/store/disk_layout.h"
#include "src/store/eviction_order.h"

namespace kvbridge::detail::disk {

class DiskIndex {
 public:
  struct Item {
    Fingerprint fp{};
    int64_t bytes = 0;  // accounted (rounded to 4 KiB)
    FileTimes times;
    uint64_t gen = 0;  // changes whenever this store indexes a file at this key
    EvictionOrder::Handle order;
  };
  using Map = std::unordered_map<Hash128, Item, HashOf>;

  explicit DiskIndex(EvictionPolicy policy) : order_(policy) {}

  /// Indexes key's file (replacing what the index held for key) as the most recent.
  void add(const Hash128& key, const Fingerprint& fp, int64_t bytes, const FileTimes& t) {
    auto it = map_.find(key);
    if (it != map_.end()) drop(it);
    Item item;
    item.fp = fp;
    item.bytes = bytes;
    item.times = t;
    item.gen = ++next_gen_;
    item.order = order_.insert(key, t.order_ms());
    map_.emplace(key, item);
  }
  void drop(Map::iterator it) {
    order_.erase(it->second.order);
    map_.erase(it);
  }
  /// Drops key's file, if indexed.
  void drop(const Hash128& key) {
    auto it = map_.find(key);
    if (it != map_.end()) drop(it);
  }
  /// Records a use of key's file (found at `it`).
  void touch(Map::iterator it, const Hash128& key) { order_.touch(it->second.order, key); }
  /// The file eviction takes next; false when the index is empty.
  bool coldest(Hash128* key) {
    return order_.find_coldest([&](const Hash128& k) {
      *key = k;
      return true;
    });
  }
  /// Drops every file of fingerprint fp.
  void drop_fingerprint(const Fingerprint& fp) {
    for (auto it = map_.begin(); it != map_.end();) {
      auto next = std::next(it);
      if (it->second.fp == fp) drop(it);
      it = next;
    }
  }
  void clear() {
    map_.clear();
    order_.clear();
  }

  Map::iterator find(const Hash128& key) { return map_.find(key); }
  Map::iterator end() { return map_.end(); }
  bool contains(const Hash128& key) const { return map_.count(key) != 0; }
  size_t size() const { return map_.size(); }

 private:
  Map map_;
  EvictionOrder order_;
  uint64_t next_gen_ = 0;
};

}  // namespace kvbridge::detail::disk
