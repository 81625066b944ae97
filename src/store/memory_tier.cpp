#include "src/store/memory_tier.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>

#include "kvbridge/error.h"

namespace kvbridge::detail {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHugePayload = size_t{32} << 20;

size_t payload_alignment(size_t payload) { return payload >= kHugePayload ? kHugePage : 64; }

}  // namespace

size_t allocation_size(size_t payload) {
  const size_t a = payload_alignment(payload);
  return (payload + a - 1) / a * a;
}

char* allocate_payload(size_t payload) {
  const size_t size = allocation_size(payload);
  void* p = std::aligned_alloc(payload_alignment(payload), size);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (payload_alignment(payload) == kHugePage) madvise(p, size, MADV_HUGEPAGE);  // a hint only
#endif
  return static_cast<char*>(p);
}

MemoryTier::MemoryTier(const StoreOptions& o)
    : ttl_ms_(o.ttl_seconds * 1000), accountant_(std::make_shared<Accountant>(o.capacity_bytes)) {
  for (int i = 0; i < o.num_shards; ++i) shards_.push_back(std::make_unique<Shard>(o.eviction));
  const size_t n = shards_.size();
  if (n > 1 && (n & (n - 1)) == 0) shard_mask_ = n - 1;
}

// Removes a slot under its shard lock; the entry is handed back to be freed after unlocking.
std::shared_ptr<ChunkEntry> MemoryTier::unlink_locked(Shard& s, const Hash128& key) {
  Slot gone = s.map.erase(key);
  s.order.erase(gone.order);
  entries_.fetch_sub(1, std::memory_order_relaxed);
  return std::move(gone.entry);
}

// Evicts the coldest unpinned entry of the next shard that has one.
bool MemoryTier::evict_one() {
  const size_t n = shards_.size();
  for (size_t i = 0; i < n; ++i) {
    Shard& s = *shards_[evict_cursor_.fetch_add(1, std::memory_order_relaxed) % n];
    std::shared_ptr<ChunkEntry> victim;  // freed after the lock is dropped
    {
      std::lock_guard<std::mutex> lock(s.mu);
      Hash128 key;
      // use_count is exact here: every other copy is made under this lock.
      if (s.order.find_coldest([&](const Hash128& k) {
            key = k;
            return s.map.find(k)->entry.use_count() == 1;
          }))
        victim = unlink_locked(s, key);
    }
    if (victim) {
      TierCounters::add(counters_.evictions);
      return true;
    }
  }
  return false;
}

bool MemoryTier::reserve(int64_t bytes) {
  while (!accountant_->try_reserve(bytes)) {
    if (!accountant_->drop_one() && !evict_one()) return false;
  }
  return true;
}

MemoryTier::Probe MemoryTier::probe(const Hash128& key, const Hash128& salt,
                                    const Hash128& parent, const uint32_t* ids, int64_t now,
                                    std::shared_ptr<const ChunkEntry>* pin) {
  Shard& s = shard_for(key);
  std::shared_ptr<ChunkEntry> gone;  // an expired entry, freed after the lock is dropped
  std::lock_guard<std::mutex> lock(s.mu);
  Slot* slot = s.map.find(key);
  if (!slot) return Probe::kAbsent;
  if (expired(*slot->entry, now)) {
    gone = unlink_locked(s, key);
    TierCounters::add(counters_.expired);
    return Probe::kAbsent;
  }
  if (!slot->entry->same_chunk(salt, parent, ids)) return Probe::kCollision;
  s.order.touch(slot->order, key);
  if (pin) *pin = slot->entry;
  return Probe::kSame;
}

MemoryTier::PrefixRun MemoryTier::pin_prefix(
    const Hash128* keys, size_t count, const Hash128& salt, const Hash128& first_parent,
    const uint32_t* ids, int64_t chunk, int64_t now,
    std::vector<std::shared_ptr<const ChunkEntry>>* pins, EntryProvenance* converted) {
  PrefixRun run;
  if (count == 0) return run;
  KVB_CHECK(count <= kMaxPrefixRun, "pin_prefix: a run of " << count << " chunks is longer than "
                                                              << kMaxPrefixRun);
  // The shards of the run, as a bit set (num_shards <= 1024), then locked in ascending order.
  constexpr size_t kWords = 1024 / 64;
  uint64_t needed[kWords] = {};
  uint16_t shard_of[kMaxPrefixRun];
  for (size_t i = 0; i < count; ++i) {
    const size_t s = shard_index(keys[i]);
    shard_of[i] = static_cast<uint16_t>(s);
    needed[s >> 6] |= uint64_t{1} << (s & 63);
  }
  std::shared_ptr<ChunkEntry> gone;  // an expired entry, freed after the locks are dropped
  struct Locks {
    Shard* held[kMaxPrefixRun];
    size_t n = 0;
    ~Locks() {
      while (n) held[--n]->mu.unlock();
    }
  } locks;
  for (size_t w = 0; w < kWords; ++w) {
    for (uint64_t bits = needed[w]; bits; bits &= bits - 1) {
      Shard& s = *shards_[w * 64 + static_cast<size_t>(__builtin_ctzll(bits))];
      s.mu.lock();
      locks.held[locks.n++] = &s;
    }
  }
  // Under the locks the tables are stable. The run's memory is loaded ahead of its compares in
  // two waves, a block of chunks at a time: the home slots of a block, then the entries and
  // eviction-order nodes those slots point to (a run's entries are scattered over the heap; one
  // cold miss after another was most of a long match's time). A block's loads fit in L1, and
  // the next block's slots are on their way while this block is compared.
  constexpr size_t kBlock = 32;
  const auto prefetch_slots = [&](size_t from) {
    for (size_t i = from; i < std::min(from + kBlock, count); ++i)
      shards_[shard_of[i]]->map.prefetch(keys[i]);
  };
  prefetch_slots(0);
  for (size_t block = 0; block < count; block += kBlock) {
    const size_t end = std::min(block + kBlock, count);
    prefetch_slots(end);
    Slot* slots[kBlock];
    size_t found = block;
    for (; found < end; ++found) {
      Slot* slot = shards_[shard_of[found]]->map.find(keys[found]);
      if (!slot) break;
      slots[found - block] = slot;
      // Salt, parent and the ids the compare reads: two lines (the entry is line aligned).
      const char* entry = reinterpret_cast<const char*>(slot->entry.get());
      __builtin_prefetch(entry);
      __builtin_prefetch(entry + 64);
      shards_[shard_of[found]]->order.prefetch(slot->order);
    }
    for (size_t i = block; i < end; ++i, ++run.hits) {
      Shard& s = *shards_[shard_of[i]];
      if (i == found) {
        run.stop = Probe::kAbsent;
        return run;
      }
      Slot* slot = slots[i - block];
      if (expired(*slot->entry, now)) {
        gone = unlink_locked(s, keys[i]);
        TierCounters::add(counters_.expired);
        run.stop = Probe::kAbsent;
        return run;
      }
      const Hash128& parent = i == 0 ? first_parent : keys[i - 1];
      if (!slot->entry->same_chunk(salt, parent, ids + static_cast<int64_t>(i) * chunk)) {
        run.stop = Probe::kCollision;
        return run;
      }
      s.order.touch(slot->order, keys[i]);
      if (pins) {
        pins->push_back(slot->entry);
      } else if (converted && !converted->converted() && slot->converted) {
        *converted = slot->entry->provenance;
      }
    }
  }
  return run;
}

bool MemoryTier::contains(const Hash128& key) {
  Shard& s = shard_for(key);
  std::lock_guard<std::mutex> lock(s.mu);
  return s.map.contains(key);
}

std::shared_ptr<ChunkEntry> MemoryTier::new_entry(const ChunkShape& shape, const Hash128& parent,
                                                  const uint32_t* ids, int64_t created_ms) {
  const int64_t bytes =
      static_cast<int64_t>(allocation_size(static_cast<size_t>(shape.geometry.payload_bytes))) +
      4 * shape.geometry.chunk + StoreStats::kEntryOverheadBytes;
  auto entry = std::make_shared<ChunkEntry>();
  entry->accountant = accountant_;
  if (!reserve(bytes)) return nullptr;
  entry->accounted = bytes;
  entry->init(shape, parent, ids, created_ms);
  entry->kv = accountant_->take(entry->kv_size);
  if (!entry->kv) entry->kv = allocate_payload(entry->payload_size());
  return entry;
}

std::shared_ptr<ChunkEntry> MemoryTier::transient_entry(const ChunkShape& shape,
                                                        const Hash128& parent,
                                                        const uint32_t* ids, int64_t created_ms) {
  auto entry = std::make_shared<ChunkEntry>();
  entry->init(shape, parent, ids, created_ms);
  entry->kv = allocate_payload(entry->payload_size());
  return entry;
}

MemoryTier::Probe MemoryTier::insert(const Hash128& key, std::shared_ptr<ChunkEntry> entry,
                                     int64_t now, std::shared_ptr<const ChunkEntry>* pin,
                                     bool* inserted) {
  Shard& s = shard_for(key);
  std::shared_ptr<ChunkEntry> gone;
  std::lock_guard<std::mutex> lock(s.mu);
  *inserted = false;
  if (Slot* held_slot = s.map.find(key)) {
    const ChunkEntry& held = *held_slot->entry;
    if (expired(held, now)) {
      gone = unlink_locked(s, key);
      TierCounters::add(counters_.expired);
    } else if (held.salt != entry->salt || held.parent != entry->parent ||
               held.tokens != entry->tokens) {
      return Probe::kCollision;
    } else {
      s.order.touch(held_slot->order, key);
      *pin = held_slot->entry;
      return Probe::kSame;
    }
  }
  *pin = entry;
  const int64_t created = entry->created_ms;
  Slot& slot = s.map.insert(key);
  slot.converted = entry->provenance.converted();
  slot.entry = std::move(entry);
  slot.order = s.order.insert(key, created);
  entries_.fetch_add(1, std::memory_order_relaxed);
  TierCounters::add(counters_.writes);
  *inserted = true;
  return Probe::kAbsent;
}

bool MemoryTier::erase(const Hash128& key, const Hash128& salt, const Hash128& parent,
                       const uint32_t* ids) {
  Shard& s = shard_for(key);
  std::shared_ptr<ChunkEntry> gone;  // freed after the lock is dropped
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const Slot* slot = s.map.find(key);
    if (slot && slot->entry->same_chunk(salt, parent, ids)) gone = unlink_locked(s, key);
  }
  return gone != nullptr;
}

int64_t MemoryTier::clear() {
  int64_t removed = 0;
  for (auto& shard : shards_) {
    Shard& s = *shard;
    std::vector<Slot> gone;  // freed after the lock is dropped
    {
      std::lock_guard<std::mutex> lock(s.mu);
      gone = s.map.take_all();
      s.order.clear();
    }
    entries_.fetch_sub(static_cast<int64_t>(gone.size()), std::memory_order_relaxed);
    removed += static_cast<int64_t>(gone.size());
  }
  return removed;
}

void MemoryTier::fill(StoreStats* st) const {
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  st->capacity_bytes = accountant_->capacity;
  st->bytes_used = get(accountant_->used);
  st->recycled_bytes = get(accountant_->pooled);
  st->peak_bytes = get(accountant_->peak);
  st->entries = get(entries_);
  st->evictions = get(counters_.evictions);
  counters_.fill(&st->memory);
  st->memory.enabled = true;
  st->memory.capacity_bytes = st->capacity_bytes;
  st->memory.bytes_used = st->bytes_used;
  st->memory.entries = st->entries;
}

}  // namespace kvbridge::detail
