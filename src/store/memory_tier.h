// The memory tier of KVStore: byte accounting and buffer recycling, payload allocation (also
// for a lower tier's lookup, PayloadPool), the chunk entries, the sharded index and eviction
// (kv_store.h describes the budget and its accounting).
// Thread-safe: one lock per shard (pin_prefix alone holds several at once, always taken in
// ascending shard order); entries are shared_ptrs, pinned while a Match holds them.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kvbridge/kv_store.h"
#include "src/index/chunk_table.h"
#include "src/index/chunk_tokens.h"
#include "src/store/entry_codec.h"
#include "src/store/eviction_order.h"
#include "src/store/int8_codec.h"
#include "src/store/tier.h"

namespace kvbridge::detail {

// Bytes accounted against the budget. Shared by the store and every entry, so an entry that
// outlives the store (held by a Match) still releases what it reserved.
struct Accountant {
  explicit Accountant(int64_t cap) : capacity(cap) {}
  const int64_t capacity;
  std::atomic<int64_t> used{0};
  std::atomic<int64_t> peak{0};

  bool try_reserve(int64_t n) {
    int64_t cur = used.load(std::memory_order_relaxed);
    do {
      if (cur + n > capacity) return false;
    } while (!used.compare_exchange_weak(cur, cur + n, std::memory_order_acq_rel));
    int64_t p = peak.load(std::memory_order_relaxed);
    while (cur + n > p && !peak.compare_exchange_weak(p, cur + n, std::memory_order_relaxed)) {
    }
    return true;
  }
  void release(int64_t n) { used.fetch_sub(n, std::memory_order_acq_rel); }

  // Freed payloads of 1 MiB and more are kept, still accounted, for the next entry of the same
  // size (all entries of one spec are): fresh memory costs a page fault per 4 KiB on its first
  // write, which made large puts several times slower than the copy.
  static constexpr size_t kMinRecycled = size_t{1} << 20;
  static constexpr size_t kMaxRecycled = 4;
  std::mutex pool_mu;
  std::vector<std::pair<size_t, char*>> pool;  // (allocation size, buffer)
  std::atomic<int64_t> pooled{0};

  ~Accountant() {
    for (auto& p : pool) std::free(p.second);
  }
  // Keeps `buf` when there is room (its bytes stay accounted); false: the caller frees it.
  bool recycle(char* buf, size_t size) {
    if (size < kMinRecycled) return false;
    std::lock_guard<std::mutex> lock(pool_mu);
    if (pool.size() >= kMaxRecycled) return false;
    pool.emplace_back(size, buf);
    pooled.fetch_add(static_cast<int64_t>(size), std::memory_order_relaxed);
    return true;
  }
  // A kept buffer of exactly `size` bytes, its bytes released, or nullptr.
  char* take(size_t size) {
    char* buf = nullptr;
    {
      std::lock_guard<std::mutex> lock(pool_mu);
      for (size_t i = 0; i < pool.size(); ++i) {
        if (pool[i].first == size) {
          buf = pool[i].second;
          pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(i));
          break;
        }
      }
    }
    if (buf) {
      pooled.fetch_sub(static_cast<int64_t>(size), std::memory_order_relaxed);
      release(static_cast<int64_t>(size));
    }
    return buf;
  }
  // Frees one kept buffer to make room; false if there is none.
  bool drop_one() {
    std::pair<size_t, char*> victim{0, nullptr};
    {
      std::lock_guard<std::mutex> lock(pool_mu);
      if (pool.empty()) return false;
      victim = pool.back();
      pool.pop_back();
    }
    std::free(victim.second);
    pooled.fetch_sub(static_cast<int64_t>(victim.first), std::memory_order_relaxed);
    release(static_cast<int64_t>(victim.first));
    return true;
  }
};

// Payloads of 32 MiB and more (which glibc always maps fresh, whatever was freed before) are
// 2 MiB aligned and advised as transparent huge pages: otherwise the first write pays one page
// fault per 4 KiB, which cost more than the copy itself (64 MiB puts ran at under 30% of memcpy
// speed). Smaller payloads come from malloc's reused memory. The rounding is accounted.
size_t allocation_size(size_t payload);
/// A payload buffer of allocation_size(payload) bytes (free with std::free).
char* allocate_payload(size_t payload);

/// What every chunk entry of one put() or match() call shares.
struct ChunkShape {
  Hash128 salt;  // h_0 of the chains
  Fingerprint fp{};
  ChunkGeometry geometry;
};

// Cache-line aligned: a lookup compares salt, parent and ids (the first 104 bytes), two lines.
struct alignas(64) ChunkEntry {
  Hash128 salt;
  Hash128 parent;
  ChunkTokens tokens;  // chunk ids
  // Native: [layers, 2, chunk, kv_heads, head_dim], dense; int8: int8_codec.h's layout.
  // kv_size bytes allocated (geometry.payload_bytes rounded up).
  char* kv = nullptr;
  size_t kv_size = 0;
  ChunkGeometry geometry;
  Fingerprint fp{};
  EntryProvenance provenance;  // recorded in the lower tiers' headers too
  int64_t created_ms = 0;
  int64_t accounted = 0;
  std::shared_ptr<Accountant> accountant;
  // One word per lower tier (LowerTier::slot()), the tier's own record of its copy of this
  // chunk (docs/storage.md); -1: none. The Redis tier keeps its epoch() here when it wrote or
  // read the chunk, and a put re-sends the chunk while that differs from the current epoch.
  mutable std::array<std::atomic<int64_t>, kMaxLowerTiers> tier_marks;

  ChunkEntry() {
    for (auto& mark : tier_marks) mark.store(-1, std::memory_order_relaxed);
  }
  /// Sets everything but the payload and its accounting: the one list of an entry's fields.
  void init(const ChunkShape& shape, const Hash128& parent_key, const uint32_t* ids,
            int64_t created) {
    salt = shape.salt;
    parent = parent_key;
    tokens.assign(ids, static_cast<size_t>(shape.geometry.chunk));
    geometry = shape.geometry;
    fp = shape.fp;
    created_ms = created;
    kv_size = allocation_size(payload_size());
  }
  size_t payload_size() const { return static_cast<size_t>(geometry.payload_bytes); }
  ChunkEntry(const ChunkEntry&) = delete;
  ChunkEntry& operator=(const ChunkEntry&) = delete;
  ~ChunkEntry() {
    if (!accountant) {  // a transient entry of put(), never accounted
      std::free(kv);
      return;
    }
    int64_t released = accounted;
    if (kv) {
      if (accountant->recycle(kv, kv_size)) {
        released -= static_cast<int64_t>(kv_size);
      } else {
        std::free(kv);
      }
    }
    if (released) accountant->release(released);
  }
  // The one storage dispatch of put() and of Match's copies.
  void fill_from(const KVView& src) {
    if (geometry.storage == StorageFormat::kInt8) return quantize_int8(src, kv);
    copy_kv(src, native_view());
  }
  // Tokens [begin, begin + dst.tokens()) of this chunk into dst (the entry's geometry, dtype).
  void copy_tokens_to(int64_t begin, const KVView& dst) const {
    if (geometry.storage == StorageFormat::kInt8)
      return dequantize_int8(kv, geometry.chunk, begin, dst);
    copy_kv(native_view().slice_tokens(begin, dst.tokens()), dst);
  }
  KVView native_view() const {
    const ChunkGeometry& g = geometry;
    return KVView::contiguous(kv, g.dtype, Device{}, g.layers, g.chunk, g.kv_heads, g.head_dim);
  }
  bool same_chunk(const Hash128& s, const Hash128& p, const uint32_t* ids) const {
    return salt == s && parent == p && tokens.equals(ids);
  }
};

class MemoryTier {
 public:
  /// capacity_bytes, num_shards, eviction and ttl_seconds of `options` (already checked).
  explicit MemoryTier(const StoreOptions& options);
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  /// Result of looking a chunk up under its shard lock.
  enum class Probe { kAbsent, kSame, kCollision };

  /// Looks key up: kSame (and *pin, when not null, the entry; its use is recorded) when it
  /// holds this chunk (salt, parent, ids), kCollision when another chunk, kAbsent otherwise
  /// (an expired entry is removed and counted).
  Probe probe(const Hash128& key, const Hash128& salt, const Hash128& parent, const uint32_t* ids,
              int64_t now, std::shared_ptr<const ChunkEntry>* pin);
  /// What pin_prefix found: chunks [0, hits) of the run are pinned; when hits < count, `stop`
  /// is what probe() would have returned for chunk `hits` (kAbsent or kCollision).
  struct PrefixRun {
    size_t hits = 0;
    Probe stop = Probe::kSame;
  };
  static constexpr size_t kMaxPrefixRun = 256;
  /// probe() of chunks 0, 1, ... of a chained run until the first that is not kSame, with
  /// the same effects (uses recorded, an expired entry removed and counted), appending each
  /// pinned entry to *pins. Chunk i has key keys[i], parent keys[i - 1] (first_parent for
  /// i = 0) and ids [i * chunk, (i + 1) * chunk) of `ids`. count <= kMaxPrefixRun. Each shard
  /// the run touches is locked once (all of them together, in ascending order, so two runs
  /// never deadlock) instead of once per chunk, and the run's table slots are prefetched.
  /// With pins null nothing is pinned (a lookup that only wants the length: pinning is an
  /// atomic increment per chunk and a decrement when released); then `converted`, when not
  /// null and not yet converted(), gets the provenance of the run's first converted hit.
  PrefixRun pin_prefix(const Hash128* keys, size_t count, const Hash128& salt,
                       const Hash128& first_parent, const uint32_t* ids, int64_t chunk,
                       int64_t now, std::vector<std::shared_ptr<const ChunkEntry>>* pins,
                       EntryProvenance* converted = nullptr);

  /// Whether the index holds key (whatever its chunk).
  bool contains(const Hash128& key);

  /// A new entry with its budget reserved (evicting as needed) and its payload allocated
  /// (contents not yet written), or nullptr when no room can be made.
  std::shared_ptr<ChunkEntry> new_entry(const ChunkShape& shape, const Hash128& parent,
                                        const uint32_t* ids, int64_t created_ms);
  /// An entry outside the budget (never indexed): put() packs a chunk for the lower tiers in
  /// one when memory has no room.
  static std::shared_ptr<ChunkEntry> transient_entry(const ChunkShape& shape,
                                                     const Hash128& parent, const uint32_t* ids,
                                                     int64_t created_ms);

  /// Inserts a filled entry unless the key is present meanwhile. *pin gets whichever entry the
  /// index holds for the chunk; returns kCollision (and no pin) when it holds another chunk.
  Probe insert(const Hash128& key, std::shared_ptr<ChunkEntry> entry, int64_t now,
               std::shared_ptr<const ChunkEntry>* pin, bool* inserted);

  /// Removes key's entry if it holds this chunk; true when it did. Pinned entries leave the
  /// index at once and are freed when unpinned (so for every removal below).
  bool erase(const Hash128& key, const Hash128& salt, const Hash128& parent, const uint32_t* ids);
  /// Removes every entry `doomed` selects; returns how many.
  template <typename Pred>
  int64_t erase_if(const Pred& doomed);
  /// Removes every entry; returns how many.
  int64_t clear();

  /// The memory fields of StoreStats (capacity, bytes, recycled, peak, entries, evictions) and
  /// its TierStats `memory`.
  void fill(StoreStats* st) const;
  TierCounters& counters() noexcept { return counters_; }

 private:
  struct Slot {
    std::shared_ptr<ChunkEntry> entry;
    EvictionOrder::Handle order;
    // entry->provenance.converted(), fixed before the entry is indexed: a length-only lookup
    // reads it here instead of a third line of every entry.
    bool converted = false;
    explicit operator bool() const noexcept { return entry != nullptr; }  // in use
  };

  struct Shard {
    explicit Shard(EvictionPolicy p) : order(p) {}
    std::mutex mu;
    detail::ChunkTable<Slot> map;
    EvictionOrder order;
  };


  // A mask for power-of-two shard counts (the default 16): a division per chunk was a tenth of
  // a long match's lookups.
  size_t shard_index(const Hash128& h) const {
    return shard_mask_ ? (h.high >> 7) & shard_mask_ : (h.high >> 7) % shards_.size();
  }
  Shard& shard_for(const Hash128& h) { return *shards_[shard_index(h)]; }
  bool expired(const ChunkEntry& e, int64_t now) const {
    return ttl_ms_ > 0 && now - e.created_ms >= ttl_ms_;
  }
  std::shared_ptr<ChunkEntry> unlink_locked(Shard& s, const Hash128& key);
  bool evict_one();
  bool reserve(int64_t bytes);

  const int64_t ttl_ms_;
  std::shared_ptr<Accountant> accountant_;
  std::vector<std::unique_ptr<Shard>> shards_;
  size_t shard_mask_ = 0;  // shards - 1 when a power of two above 1, else 0
  std::atomic<uint32_t> evict_cursor_{0};
  std::atomic<int64_t> entries_{0};
  TierCounters counters_;
};

/// The payload buffers of one lookup's run (LookupBatch), owned by the store: chunk i's is a
/// new memory entry made when the tier first asks for it, so only values a tier actually has
/// take memory (making one may evict). The store takes the hits' entries and frees the rest.
class PayloadPool {
 public:
  explicit PayloadPool(MemoryTier& memory) : memory_(memory) {}

  /// Frees every buffer of the last run and starts this one (kept by the caller meanwhile).
  void start(const std::vector<ExpectedEntry>& run) {
    fresh_.clear();
    fresh_.resize(run.size());
    run_ = &run;
  }
  /// Chunk i's payload buffer (run[i].geometry.payload_bytes; the same one until discard(i)),
  /// or null when memory has no room.
  char* get(size_t i) {
    if (!fresh_[i]) {
      const ExpectedEntry& w = (*run_)[i];
      fresh_[i] = memory_.new_entry(ChunkShape{w.salt, w.fingerprint, w.geometry}, w.parent,
                                    w.tokens, w.now_ms);
    }
    return fresh_[i] ? fresh_[i]->kv : nullptr;
  }
  /// Frees chunk i's buffer (what was read into it is not the entry).
  void discard(size_t i) { fresh_[i].reset(); }
  /// Chunk i's entry, for the store to index (a hit's).
  std::shared_ptr<ChunkEntry> take(size_t i) { return std::move(fresh_[i]); }

 private:
  MemoryTier& memory_;
  const std::vector<ExpectedEntry>* run_ = nullptr;
  std::vector<std::shared_ptr<ChunkEntry>> fresh_;
};

template <typename Pred>
int64_t MemoryTier::erase_if(const Pred& doomed) {
  int64_t removed = 0;
  for (auto& shard : shards_) {
    Shard& s = *shard;
    std::vector<std::shared_ptr<ChunkEntry>> gone;  // freed after the lock is dropped
    {
      std::lock_guard<std::mutex> lock(s.mu);
      std::vector<Hash128> keys;  // collected first: unlinking moves the table's slots
      s.map.for_each([&](const Hash128& key, const Slot& slot) {
        if (doomed(*slot.entry)) keys.push_back(key);
      });
      for (const Hash128& key : keys) gone.push_back(unlink_locked(s, key));
    }
    removed += static_cast<int64_t>(gone.size());
  }
  return removed;
}

}  // namespace kvbridge::detail
