#include "kvbridge/kv_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <cstdio>
#include <utility>

#include "kvbridge/error.h"
#include "src/core/byte_order.h"
#include "src/core/path_check.h"
#include "src/core/prometheus.h"
#include "src/core/xxh3.h"
#include "src/index/chunk_table.h"
#include "src/index/token_ids.h"
#include "src/store/disk_tier.h"
#include "src/store/entry_codec.h"
#include "src/store/eviction_order.h"
#include "src/store/int8_codec.h"
#include "src/store/redis_tier.h"
#include "src/store/tier.h"

namespace kvbridge {
namespace detail {

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
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHugePayload = size_t{32} << 20;

size_t payload_alignment(size_t payload) { return payload >= kHugePayload ? kHugePage : 64; }

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


struct ChunkEntry {
  Hash128 salt;
  Hash128 parent;
  std::vector<uint32_t> tokens;
  // Native: [layers, 2, chunk, kv_heads, head_dim], dense; int8: int8_codec.h's layout.
  // kv_size bytes allocated.
  char* kv = nullptr;
  size_t kv_size = 0;
  size_t payload_bytes = 0;  // the stored bytes (kv_size rounds it up)
  int64_t layers = 0, chunk = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kFloat32;
  StorageFormat storage = StorageFormat::kNative;
  Fingerprint fp{};
  detail::EntryProvenance provenance;  // recorded in the lower tiers' headers too
  int64_t created_ms = 0;
  int64_t accounted = 0;
  std::shared_ptr<Accountant> accountant;
  // RedisTier::epoch() when this entry was last known to be in Redis (written or read there);
  // -1: never. A put re-sends the chunk while it differs from the tier's current epoch.
  mutable std::atomic<int64_t> redis_epoch{-1};

  ChunkEntry() = default;
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
    if (storage == StorageFormat::kInt8) return quantize_int8(src, kv);
    copy_kv(src, KVView::contiguous(kv, dtype, Device{}, layers, chunk, kv_heads, head_dim));
  }
  // Tokens [begin, begin + dst.tokens()) of this chunk into dst (the entry's geometry, dtype).
  void copy_tokens_to(int64_t begin, const KVView& dst) const {
    if (storage == StorageFormat::kInt8) return dequantize_int8(kv, chunk, begin, dst);
    copy_kv(KVView::contiguous(kv, dtype, Device{}, layers, chunk, kv_heads, head_dim)
                .slice_tokens(begin, dst.tokens()),
            dst);
  }
  bool same_chunk(const Hash128& s, const Hash128& p, const uint32_t* ids) const {
    return salt == s && parent == p &&
           std::memcmp(tokens.data(), ids, 4 * tokens.size()) == 0;
  }
};

}  // namespace detail

using detail::allocate_payload;
using detail::allocation_size;
using detail::ChunkEntry;
using detail::DiskTier;
using detail::EntryHeader;
using detail::EvictionOrder;
using detail::ExpectedEntry;
using detail::Fingerprint;
using detail::LoadResult;
using detail::RedisTier;
using detail::TierCounters;

const char* eviction_policy_name(EvictionPolicy policy) noexcept {
  switch (policy) {
    case EvictionPolicy::kLRU:
      return "lru";
    case EvictionPolicy::kLFU:
      return "lfu";
    case EvictionPolicy::kTTL:
      return "ttl";
  }
  return "unknown";
}

const char* storage_format_name(StorageFormat format) noexcept {
  switch (format) {
    case StorageFormat::kNative:
      return "native";
    case StorageFormat::kInt8:
      return "int8";
  }
  return "unknown";
}

StorageFormat parse_storage_format(const std::string& name) {
  for (StorageFormat f : {StorageFormat::kNative, StorageFormat::kInt8})
    if (name == storage_format_name(f)) return f;
  KVB_CHECK(false, "storage: expected 'native' or 'int8', got '" << name << "'");
  return StorageFormat::kNative;
}

EvictionPolicy parse_eviction_policy(const std::string& name) {
  for (EvictionPolicy p : {EvictionPolicy::kLRU, EvictionPolicy::kLFU, EvictionPolicy::kTTL})
    if (name == eviction_policy_name(p)) return p;
  KVB_CHECK(false, "eviction: expected 'lru', 'lfu' or 'ttl', got '" << name << "'");
  return EvictionPolicy::kLRU;
}

namespace {

struct Slot {
  std::shared_ptr<ChunkEntry> entry;
  EvictionOrder::Handle order;
  explicit operator bool() const noexcept { return entry != nullptr; }  // in use
};

struct Shard {
  explicit Shard(EvictionPolicy p) : order(p) {}
  std::mutex mu;
  detail::ChunkTable<Slot> map;
  EvictionOrder order;
};

int64_t stored_bytes(const ModelSpec& spec, int64_t chunk, StorageFormat storage) {
  const int64_t bytes = detail::stored_payload_bytes(storage, spec.dtype, spec.num_layers, chunk,
                                                     spec.num_kv_heads, spec.head_dim);
  KVB_CHECK(bytes > 0, "spec: a chunk's KV size overflows");
  return bytes;
}

int64_t entry_bytes(const ModelSpec& spec, int64_t chunk, StorageFormat storage) {
  const size_t payload = static_cast<size_t>(stored_bytes(spec, chunk, storage));
  return static_cast<int64_t>(allocation_size(payload)) + 4 * chunk +
         StoreStats::kEntryOverheadBytes;
}

int64_t system_clock_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One put() or match() call's identity: everything every chunk of it shares.
struct Call {
  const ModelSpec& spec;
  std::string_view ns;
  Hash128 salt;
  Fingerprint fp;
  int64_t chunk;
  int64_t payload_bytes;  // stored bytes of one chunk
  int64_t now_ms;
};

// h_0 of the store's chains: the prefix salt for native storage; for int8 a salt derived from it,
// so entries of the two formats never share a key in any tier.
Hash128 store_salt(std::string_view ns, const ModelSpec& spec, StorageFormat storage) {
  const Hash128 salt = prefix_salt(ns, spec);
  if (storage == StorageFormat::kNative) return salt;
  unsigned char bytes[16];
  detail::store_hash(bytes, salt);
  detail::Xxh3Stream s;
  s.update(bytes, sizeof bytes);
  s.update("kvbridge-storage-int8", 21);
  return s.digest();
}

// The encoded header + tokens and checksum of a chunk, for the lower tiers.
struct Packed {
  std::vector<unsigned char> prefix;
  Hash128 checksum;
};

Packed pack(const ChunkEntry& e, const Hash128& key) {
  EntryHeader h;
  h.dtype = e.dtype;
  h.storage = e.storage;
  h.layers = e.layers;
  h.chunk = e.chunk;
  h.kv_heads = e.kv_heads;
  h.head_dim = e.head_dim;
  h.payload_bytes = static_cast<int64_t>(e.payload_bytes);
  h.created_ms = e.created_ms;
  h.key = key;
  h.parent = e.parent;
  h.salt = e.salt;
  h.fingerprint = e.fp;
  h.provenance = e.provenance;
  Packed p;
  p.prefix.resize(detail::entry_prefix_bytes(e.chunk));
  detail::encode_entry_prefix(h, e.tokens.data(), p.prefix.data());
  p.checksum = detail::entry_checksum(p.prefix.data(), p.prefix.size(), e.kv, e.payload_bytes);
  return p;
}

}  // namespace

struct KVStore::Impl {
  explicit Impl(const StoreOptions& o)
      : options(o), clock(o.clock_ms ? o.clock_ms : std::function<int64_t()>(system_clock_ms)),
        ttl_ms(o.ttl_seconds * 1000),
        accountant(std::make_shared<detail::Accountant>(o.capacity_bytes)) {
    for (int i = 0; i < o.num_shards; ++i) shards.push_back(std::make_unique<Shard>(o.eviction));
  }

  StoreOptions options;
  std::function<int64_t()> clock;
  const int64_t ttl_ms;
  std::shared_ptr<detail::Accountant> accountant;
  std::vector<std::unique_ptr<Shard>> shards;
  std::atomic<uint32_t> evict_cursor{0};
  std::unique_ptr<DiskTier> disk;
  std::unique_ptr<RedisTier> redis;

  std::atomic<int64_t> entries{0};
  KVBRIDGE_STORE_COUNTERS(KVBRIDGE_STATS_ATOMIC_)
  TierCounters memory_counters, disk_counters, redis_counters;
  detail::RemoteCounters remote_counters;

  bool lower_tiers() const { return disk || redis; }

  Shard& shard_for(const Hash128& h) { return *shards[(h.high >> 7) % shards.size()]; }

  Call call(const ModelSpec& spec, std::string_view ns) const {
    // The fingerprint formats every field (doubles with %.17g): a few microseconds, worth
    // keeping for the next call with the same model and namespace on this thread.
    struct Identity {
      ModelSpec spec;
      std::string ns;
      StorageFormat storage = StorageFormat::kNative;  // stores of both formats share a thread
      Hash128 salt;
      Fingerprint fp{};
      bool valid = false;
    };
    thread_local Identity last;
    if (!last.valid || last.ns != ns || last.storage != options.storage || last.spec != spec) {
      last.valid = false;
      last.spec = spec;
      last.storage = options.storage;
      last.ns.assign(ns.data(), ns.size());
      last.fp = detail::to_fingerprint(spec.fingerprint());
      last.salt = store_salt(ns, spec, options.storage);
      last.valid = true;
    }
    return Call{spec,
                ns,
                last.salt,
                last.fp,
                options.chunk_tokens,
                stored_bytes(spec, options.chunk_tokens, options.storage),
                clock()};
  }

  ExpectedEntry expected(const Call& c, const Hash128& key, const Hash128& parent,
                         const uint32_t* ids) const {
    ExpectedEntry w;
    w.key = key;
    w.parent = parent;
    w.salt = c.salt;
    w.fingerprint = c.fp;
    w.dtype = c.spec.dtype;
    w.storage = options.storage;
    w.layers = c.spec.num_layers;
    w.chunk = c.chunk;
    w.kv_heads = c.spec.num_kv_heads;
    w.head_dim = c.spec.head_dim;
    w.payload_bytes = c.payload_bytes;
    w.tokens = ids;
    w.now_ms = c.now_ms;
    w.ttl_ms = ttl_ms;
    return w;
  }

  bool expired(const ChunkEntry& e, int64_t now) const {
    return ttl_ms > 0 && now - e.created_ms >= ttl_ms;
  }

  // Removes a slot under its shard lock; the entry is handed back to be freed after unlocking.
  std::shared_ptr<ChunkEntry> unlink_locked(Shard& s, const Hash128& key) {
    Slot gone = s.map.erase(key);
    s.order.erase(gone.order);
    entries.fetch_sub(1, std::memory_order_relaxed);
    return std::move(gone.entry);
  }

  // Removes every memory entry `doomed` selects (pinned ones leave the index at once and are
  // freed when unpinned); returns how many.
  template <typename Pred>
  int64_t erase_memory_if(const Pred& doomed) {
    int64_t removed = 0;
    for (auto& shard : shards) {
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
    erased.fetch_add(removed, std::memory_order_relaxed);
    return removed;
  }

  // Evicts the coldest unpinned entry of the next shard that has one.
  bool evict_one() {
    const size_t n = shards.size();
    for (size_t i = 0; i < n; ++i) {
      Shard& s = *shards[evict_cursor.fetch_add(1, std::memory_order_relaxed) % n];
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
        TierCounters::add(memory_counters.evictions);
        return true;
      }
    }
    return false;
  }

  bool reserve(int64_t bytes) {
    while (!accountant->try_reserve(bytes)) {
      if (!accountant->drop_one() && !evict_one()) return false;
    }
    return true;
  }

  // Result of looking a chunk up under its shard lock.
  enum class Probe { kAbsent, kSame, kCollision };

  // An expired entry is unlinked (handed back in *gone) and reported absent.
  Probe probe_and_touch(Shard& s, const Hash128& key, const Hash128& salt, const Hash128& parent,
                        const uint32_t* ids, int64_t now, std::shared_ptr<const ChunkEntry>* pin,
                        std::shared_ptr<ChunkEntry>* gone) {
    Slot* slot = s.map.find(key);
    if (!slot) return Probe::kAbsent;
    if (expired(*slot->entry, now)) {
      *gone = unlink_locked(s, key);
      TierCounters::add(memory_counters.expired);
      return Probe::kAbsent;
    }
    if (!slot->entry->same_chunk(salt, parent, ids)) return Probe::kCollision;
    s.order.touch(slot->order, key);
    if (pin) *pin = slot->entry;
    return Probe::kSame;
  }

  Probe probe(const Hash128& key, const Hash128& salt, const Hash128& parent, const uint32_t* ids,
              int64_t now, std::shared_ptr<const ChunkEntry>* pin) {
    Shard& s = shard_for(key);
    std::shared_ptr<ChunkEntry> gone;
    std::lock_guard<std::mutex> lock(s.mu);
    return probe_and_touch(s, key, salt, parent, ids, now, pin, &gone);
  }

  bool in_memory(const Hash128& key) {
    Shard& s = shard_for(key);
    std::lock_guard<std::mutex> lock(s.mu);
    return s.map.contains(key);
  }

  // A new entry with its budget reserved and its payload allocated (contents not yet written),
  // or nullptr when no room can be made.
  std::shared_ptr<ChunkEntry> new_entry(const Call& c, const Hash128& parent, const uint32_t* ids,
                                        int64_t created_ms) {
    const int64_t bytes = entry_bytes(c.spec, c.chunk, options.storage);
    auto entry = std::make_shared<ChunkEntry>();
    entry->accountant = accountant;
    if (!reserve(bytes)) return nullptr;
    entry->accounted = bytes;
    entry->salt = c.salt;
    entry->parent = parent;
    entry->tokens.assign(ids, ids + c.chunk);
    entry->layers = c.spec.num_layers;
    entry->chunk = c.chunk;
    entry->kv_heads = c.spec.num_kv_heads;
    entry->head_dim = c.spec.head_dim;
    entry->dtype = c.spec.dtype;
    entry->storage = options.storage;
    entry->fp = c.fp;
    entry->created_ms = created_ms;
    entry->payload_bytes = static_cast<size_t>(c.payload_bytes);
    entry->kv_size = allocation_size(entry->payload_bytes);
    entry->kv = accountant->take(entry->kv_size);
    if (!entry->kv) entry->kv = allocate_payload(entry->payload_bytes);
    return entry;
  }

  // Inserts a filled entry unless the key is present meanwhile. *pin gets whichever entry the
  // index holds for the chunk; returns kCollision (and no pin) when it holds another chunk.
  Probe insert(const Hash128& key, std::shared_ptr<ChunkEntry> entry, int64_t now,
               std::shared_ptr<const ChunkEntry>* pin, bool* inserted) {
    Shard& s = shard_for(key);
    std::shared_ptr<ChunkEntry> gone;
    std::lock_guard<std::mutex> lock(s.mu);
    *inserted = false;
    if (Slot* held_slot = s.map.find(key)) {
      const ChunkEntry& held = *held_slot->entry;
      if (expired(held, now)) {
        gone = unlink_locked(s, key);
        TierCounters::add(memory_counters.expired);
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
    slot.entry = std::move(entry);
    slot.order = s.order.insert(key, created);
    entries.fetch_add(1, std::memory_order_relaxed);
    TierCounters::add(memory_counters.writes);
    *inserted = true;
    return Probe::kAbsent;
  }

  // --- match(): the lower tiers -------------------------------------------------------------

  // The chain keys of one call, hashed on demand.
  struct Keys {
    const uint32_t* tokens;
    int64_t chunk;
    std::vector<Hash128> h;  // h[c] = key of chunk c
    Hash128 salt;
    const Hash128& at(size_t c) {
      while (h.size() <= c) {
        const Hash128 parent = h.empty() ? salt : h.back();
        h.push_back(chain_hash(parent, tokens + static_cast<int64_t>(h.size()) * chunk, chunk));
      }
      return h[c];
    }
    Hash128 parent(size_t c) { return c == 0 ? salt : at(c - 1); }
  };

  // What one fetched Redis value became: verified into a new (not yet indexed) entry, or not.
  struct RemoteSlot {
    bool present = false;
    bool no_room = false;
    bool drop = false;  // corrupt or expired: delete it from the server
    LoadResult result = LoadResult::kMiss;
    std::shared_ptr<ChunkEntry> entry;
  };
  // A window of Redis values fetched in one round trip: chunks [begin, begin + count).
  struct RemoteWindow {
    size_t begin = 0;
    size_t count = 0;
    std::vector<RemoteSlot> slots;
    std::vector<std::string> names;
    int64_t epoch = -1;  // RedisTier::epoch() before the fetch
  };

  // Fetches the values of chunk c and of the following chunks that neither memory nor disk
  // holds and the filter lets through, up to redis_batch_bytes. False: chunk c is a miss.
  bool fetch_window(const Call& call, Keys& keys, size_t c, size_t chunks, RemoteWindow* w) {
    detail::RemoteCounters& rc = remote_counters;
    if (!redis->may_contain(keys.at(c))) {
      TierCounters::add(rc.filter_negatives);
      TierCounters::add(redis_counters.misses);
      return false;
    }
    TierCounters::add(rc.filter_passes);
    const size_t value_bytes =
        detail::entry_encoded_bytes(call.chunk, call.payload_bytes);
    const size_t limit = std::max<size_t>(
        1, std::min<size_t>(1024, static_cast<size_t>(options.redis_batch_bytes) / value_bytes));
    w->begin = c;
    w->epoch = redis->epoch();
    w->names.clear();
    w->names.push_back(redis->key_for(call.ns, call.fp, keys.at(c)));
    for (size_t k = c + 1; k < chunks && w->names.size() < limit; ++k) {
      const Hash128& key = keys.at(k);
      if (!redis->may_contain(key) || in_memory(key) || (disk && disk->contains(key, call.fp)))
        break;
      w->names.push_back(redis->key_for(call.ns, call.fp, key));
    }
    w->count = w->names.size();
    w->slots.assign(w->count, RemoteSlot{});
    // Each value is verified and copied into its entry while hiredis parses the reply.
    auto consume = [&](size_t i, const unsigned char* data, size_t size) {
      if (i >= w->count) return;
      RemoteSlot& slot = w->slots[i];
      slot.present = true;
      const size_t k = w->begin + i;
      const uint32_t* ids = keys.tokens + static_cast<int64_t>(k) * call.chunk;
      const ExpectedEntry want = expected(call, keys.at(k), keys.parent(k), ids);
      slot.entry = new_entry(call, keys.parent(k), ids, call.now_ms);
      if (!slot.entry) {
        slot.no_room = true;
        return;
      }
      detail::LoadedMeta meta;
      slot.result = detail::load_value(data, size, want, slot.entry->kv, &meta,
                                       &redis_counters, &slot.drop);
      if (slot.result == LoadResult::kHit) {
        slot.entry->created_ms = meta.created_ms;
        slot.entry->provenance = meta.provenance;
      } else {
        slot.entry.reset();
      }
    };
    if (!redis->fetch(w->names, consume)) {
      w->count = 0;
      w->slots.clear();
      TierCounters::add(redis_counters.misses);
      return false;
    }
    std::vector<std::string> damaged;
    for (size_t i = 0; i < w->count; ++i)
      if (w->slots[i].drop) damaged.push_back(w->names[i]);
    if (!damaged.empty()) redis->remove(damaged);
    return true;
  }

  // Looks chunk c up in the disk tier, then Redis, and promotes a hit into memory. Returns the
  // pinned entry, or nullptr (a miss or a collision, *collision says which; or no room).
  std::shared_ptr<const ChunkEntry> load_lower(const Call& call, Keys& keys, size_t c,
                                               size_t chunks, RemoteWindow* window,
                                               bool* collision) {
    const Hash128 key = keys.at(c);
    const Hash128 parent = keys.parent(c);
    const uint32_t* ids = keys.tokens + static_cast<int64_t>(c) * call.chunk;
    const ExpectedEntry want = expected(call, key, parent, ids);
    std::shared_ptr<ChunkEntry> entry;
    auto promote = [&](TierCounters& tier) -> std::shared_ptr<const ChunkEntry> {
      std::shared_ptr<const ChunkEntry> pin;
      bool inserted = false;
      if (insert(key, std::move(entry), call.now_ms, &pin, &inserted) == Probe::kCollision) {
        *collision = true;
        return nullptr;
      }
      if (inserted) promotions.fetch_add(1, std::memory_order_relaxed);
      TierCounters::add(tier.hit_chunks);
      return pin;
    };
    auto allocate = [&](int64_t created) {
      if (!entry) entry = new_entry(call, parent, ids, created);
      if (!entry) promotions_rejected.fetch_add(1, std::memory_order_relaxed);
      return entry != nullptr;
    };

    if (disk) {
      if (disk->contains(key, call.fp)) {
        if (!allocate(call.now_ms)) return nullptr;
        detail::LoadedMeta meta;
        const LoadResult r = disk->load(want, entry->kv, &meta);
        if (r == LoadResult::kHit) {
          entry->created_ms = meta.created_ms;
          entry->provenance = meta.provenance;
          return promote(disk_counters);
        }
        if (r == LoadResult::kCollision) {
          *collision = true;
          return nullptr;
        }
      } else {
        TierCounters::add(disk_counters.misses);
      }
    }
    if (!redis) return nullptr;
    if (c < window->begin || c >= window->begin + window->count) {
      if (!fetch_window(call, keys, c, chunks, window)) return nullptr;
    }
    RemoteSlot& slot = window->slots[c - window->begin];
    if (!slot.present) {
      TierCounters::add(redis_counters.misses);
      if (redis->filter_active())
        TierCounters::add(remote_counters.filter_false_positives);
      return nullptr;
    }
    if (slot.no_room) {
      promotions_rejected.fetch_add(1, std::memory_order_relaxed);
      return nullptr;
    }
    if (slot.result == LoadResult::kCollision) *collision = true;
    if (slot.result != LoadResult::kHit) return nullptr;
    entry = std::move(slot.entry);
    entry->redis_epoch.store(window->epoch, std::memory_order_relaxed);
    return promote(redis_counters);
  }
};

KVStore::KVStore(const StoreOptions& options) {
  KVB_CHECK(options.capacity_bytes > 0,
            "capacity_bytes must be > 0, got " << options.capacity_bytes);
  KVB_CHECK(options.chunk_tokens > 0 && options.chunk_tokens <= detail::kEntryMaxDim,
            "chunk_tokens must be in [1, " << detail::kEntryMaxDim << "], got "
                                           << options.chunk_tokens);
  KVB_CHECK(options.num_shards >= 1 && options.num_shards <= 1024,
            "num_shards must be in [1, 1024], got " << options.num_shards);
  KVB_CHECK(options.ttl_seconds >= 0 && options.ttl_seconds <= kMaxTtlSeconds,
            "ttl_seconds must be in [0, " << kMaxTtlSeconds << "], got " << options.ttl_seconds);
  KVB_CHECK(options.eviction != EvictionPolicy::kTTL || options.ttl_seconds > 0,
            "eviction 'ttl' needs ttl_seconds > 0");
  KVB_CHECK(options.storage == StorageFormat::kNative || options.storage == StorageFormat::kInt8,
            "storage: unknown format " << static_cast<int>(options.storage));
  KVB_CHECK(options.disk_dir.empty() || options.disk_capacity_bytes > 0,
            "disk_capacity_bytes must be > 0, got " << options.disk_capacity_bytes);
  if (!options.disk_dir.empty()) detail::check_path(options.disk_dir, "disk_dir");
  impl_ = std::make_unique<Impl>(options);
  if (!options.disk_dir.empty()) {
    impl_->disk = std::make_unique<DiskTier>(options, impl_->clock, &impl_->disk_counters);
  }
  if (!options.redis_url.empty()) {
    impl_->redis = std::make_unique<RedisTier>(options, &impl_->redis_counters,
                                               &impl_->remote_counters);
  }
}

KVStore::~KVStore() = default;

const StoreOptions& KVStore::options() const noexcept { return impl_->options; }

int64_t KVStore::put(const ModelSpec& spec, TokenSpan tokens, const KVView& kv,
                     std::string_view ns, const Provenance& provenance) {
  Impl& m = *impl_;
  spec.validate();
  const detail::EntryProvenance origin = detail::to_entry_provenance(provenance);
  const detail::TokenIds ids_all(tokens);
  kv.check_matches(spec, "kv");
  KVB_CHECK(kv.tokens() == static_cast<int64_t>(tokens.size),
            "kv holds " << kv.tokens() << " tokens but tokens has " << tokens.size);
  KVB_CHECK(kv.device().type == DeviceType::kCPU,
            "kv: the store copies host memory; move CUDA tensors to the CPU first");
  m.puts.fetch_add(1, std::memory_order_relaxed);

  const Call call = m.call(spec, ns);
  const int64_t chunk = call.chunk;
  const int64_t chunks = static_cast<int64_t>(tokens.size) / chunk;
  Hash128 parent = call.salt;
  // This call's chunks stay pinned until it returns, so making room for chunk c never evicts
  // chunks 0..c-1 of the same prefix (and the lower tiers can be written from them).
  std::vector<std::shared_ptr<const ChunkEntry>> held;
  held.reserve(static_cast<size_t>(chunks));
  // kept[c]: chunk c is in memory or on disk; Redis results arrive when a batch is flushed.
  std::vector<char> kept;
  struct RemoteWrite {
    int64_t chunk;
    Hash128 key;
    std::shared_ptr<const ChunkEntry> entry;
    Packed packed;
  };
  std::deque<RemoteWrite> pending;  // deque: stable element addresses
  std::vector<char> remote_ok(static_cast<size_t>(chunks), 0);
  size_t pending_bytes = 0;
  auto flush = [&] {
    if (pending.empty()) return;
    std::vector<RedisTier::Write> writes;
    for (const RemoteWrite& w : pending) {
      writes.push_back({m.redis->key_for(ns, call.fp, w.key), w.key, w.packed.prefix.data(),
                        w.packed.prefix.size(), w.entry->kv, w.entry->payload_bytes,
                        w.packed.checksum});
    }
    const int64_t epoch = m.redis->epoch();  // read first: a failure meanwhile re-sends
    const bool ok = m.redis->store(writes, m.ttl_ms);
    for (const RemoteWrite& w : pending) {
      remote_ok[static_cast<size_t>(w.chunk)] = ok;
      if (ok) w.entry->redis_epoch.store(epoch, std::memory_order_relaxed);
    }
    pending.clear();
    pending_bytes = 0;
  };

  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* ids = ids_all.data() + c * chunk;
    const Hash128 key = chain_hash(parent, ids, chunk);
    std::shared_ptr<const ChunkEntry> pinned;
    Impl::Probe found = m.probe(key, call.salt, parent, ids, call.now_ms, &pinned);
    if (found == Impl::Probe::kCollision) {
      m.collisions.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    bool inserted = false;
    std::shared_ptr<ChunkEntry> fresh;
    if (found == Impl::Probe::kAbsent) {
      fresh = m.new_entry(call, parent, ids, call.now_ms);
      if (fresh) {
        fresh->provenance = origin;
        fresh->fill_from(kv.slice_tokens(c * chunk, chunk));
        found = m.insert(key, fresh, call.now_ms, &pinned, &inserted);
        if (found == Impl::Probe::kCollision) {
          m.collisions.fetch_add(1, std::memory_order_relaxed);
          break;
        }
      } else {
        TierCounters::add(m.memory_counters.write_failures);
      }
    }
    if (inserted) {
      m.chunks_inserted.fetch_add(1, std::memory_order_relaxed);
    } else if (pinned) {
      m.chunks_present.fetch_add(1, std::memory_order_relaxed);
    }
    bool in_lower = false;
    if (m.lower_tiers()) {
      // Without room in memory the chunk is packed from the caller's view into a transient
      // entry of its own (not accounted: it lives only until this call returns).
      std::shared_ptr<const ChunkEntry> source = pinned;
      if (!source) {
        auto transient = std::make_shared<ChunkEntry>();
        transient->salt = call.salt;
        transient->parent = parent;
        transient->tokens.assign(ids, ids + chunk);
        transient->layers = spec.num_layers;
        transient->chunk = chunk;
        transient->kv_heads = spec.num_kv_heads;
        transient->head_dim = spec.head_dim;
        transient->dtype = spec.dtype;
        transient->storage = m.options.storage;
        transient->fp = call.fp;
        transient->provenance = origin;
        transient->created_ms = call.now_ms;
        transient->payload_bytes = static_cast<size_t>(call.payload_bytes);
        transient->kv_size = allocation_size(transient->payload_bytes);
        transient->kv = allocate_payload(transient->payload_bytes);
        transient->fill_from(kv.slice_tokens(c * chunk, chunk));
        source = std::move(transient);
      }
      const bool to_disk = m.disk && !m.disk->has_file(key, call.fp);
      // Redis gets every chunk it is not known to hold: new ones, and ones put or promoted
      // while it was down or before it last failed (so an outage is repaired by the next put).
      const bool to_redis =
          m.redis && (!pinned || pinned->redis_epoch.load(std::memory_order_relaxed) !=
                                     m.redis->epoch());
      if (to_disk || to_redis) {
        Packed packed = pack(*source, key);
        if (to_disk) {
          in_lower = m.disk->store(key, call.fp, packed.prefix.data(), packed.prefix.size(),
                                   source->kv, source->payload_bytes, packed.checksum,
                                   source->created_ms);
        } else if (m.disk) {
          in_lower = true;  // already there
        }
        if (to_redis) {
          pending_bytes += packed.prefix.size() + source->payload_bytes;
          pending.push_back({c, key, source, std::move(packed)});
          if (pending_bytes >= static_cast<size_t>(m.options.redis_batch_bytes)) flush();
        }
      } else {
        in_lower = m.disk != nullptr;
      }
    }
    if (!pinned && !in_lower && !m.redis) {
      m.chunks_rejected.fetch_add(chunks - c, std::memory_order_relaxed);
      break;
    }
    kept.push_back(pinned != nullptr || in_lower);
    if (pinned) held.push_back(std::move(pinned));
    parent = key;
  }
  if (m.redis) flush();
  int64_t stored = 0;
  while (stored < static_cast<int64_t>(kept.size()) &&
         (kept[static_cast<size_t>(stored)] || remote_ok[static_cast<size_t>(stored)]))
    ++stored;
  if (stored < static_cast<int64_t>(kept.size()))
    m.chunks_rejected.fetch_add(static_cast<int64_t>(kept.size()) - stored,
                                std::memory_order_relaxed);
  return stored * chunk;
}

Match KVStore::match(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  Impl& m = *impl_;
  spec.validate();
  const detail::TokenIds ids_all(tokens);
  const Call call = m.call(spec, ns);
  const int64_t chunk = call.chunk;
  const size_t chunks = tokens.size / static_cast<size_t>(chunk);
  Match result;
  result.chunk_tokens_ = chunk;
  Impl::Keys keys{ids_all.data(), chunk, {}, call.salt};  // hashed lazily: a miss stops early
  keys.h.reserve(chunks);
  result.entries_.reserve(chunks);
  Impl::RemoteWindow window;
  int64_t memory_hits = 0;  // counted once per call, not per chunk
  for (size_t c = 0; c < chunks; ++c) {
    const Hash128 key = keys.at(c);
    const uint32_t* ids = ids_all.data() + static_cast<int64_t>(c) * chunk;
    std::shared_ptr<const ChunkEntry> pinned;
    const Impl::Probe found = m.probe(key, call.salt, keys.parent(c), ids, call.now_ms, &pinned);
    if (found == Impl::Probe::kCollision) {
      m.collisions.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    if (found == Impl::Probe::kSame) {
      ++memory_hits;
    } else {
      TierCounters::add(m.memory_counters.misses);
      if (!m.lower_tiers()) break;
      bool collision = false;
      pinned = m.load_lower(call, keys, c, chunks, &window, &collision);
      if (collision) m.collisions.fetch_add(1, std::memory_order_relaxed);
      if (!pinned) break;
    }
    result.entries_.push_back(std::move(pinned));
  }
  TierCounters::add(m.memory_counters.hit_chunks, memory_hits);
  result.tokens_ = result.chunks() * chunk;
  m.matches.fetch_add(1, std::memory_order_relaxed);
  (result.tokens_ ? m.hits : m.misses).fetch_add(1, std::memory_order_relaxed);
  m.hit_chunks.fetch_add(result.chunks(), std::memory_order_relaxed);
  return result;
}

int64_t KVStore::erase(const ModelSpec& spec, TokenSpan tokens, std::string_view ns,
                       unsigned tiers) {
  Impl& m = *impl_;
  spec.validate();
  const int64_t chunk = m.options.chunk_tokens;
  const Hash128 salt = store_salt(ns, spec, m.options.storage);
  const detail::TokenIds ids(tokens);
  const std::vector<Hash128> keys = prefix_hashes(salt, TokenSpan(ids.data(), ids.size()), chunk);
  int64_t removed = 0;
  Hash128 parent = salt;
  std::vector<std::string> remote;
  const Fingerprint fp = detail::to_fingerprint(spec.fingerprint());
  for (size_t c = 0; c < keys.size(); ++c) {
    if (tiers & kMemoryTier) {
      Shard& s = m.shard_for(keys[c]);
      std::shared_ptr<ChunkEntry> gone;  // freed after the lock is dropped
      {
        std::lock_guard<std::mutex> lock(s.mu);
        const Slot* slot = s.map.find(keys[c]);
        if (slot && slot->entry->same_chunk(salt, parent, ids.data() + c * chunk)) {
          gone = m.unlink_locked(s, keys[c]);
        }
      }
      if (gone) {
        ++removed;
        m.erased.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if ((tiers & kDiskTier) && m.disk && m.disk->erase(keys[c], fp)) ++removed;
    if ((tiers & kRedisTier) && m.redis) remote.push_back(m.redis->key_for(ns, fp, keys[c]));
    parent = keys[c];
  }
  if (!remote.empty()) m.redis->remove(remote);
  return removed;
}

InvalidateResult KVStore::invalidate(const ModelSpec& spec) {
  Impl& m = *impl_;
  spec.validate();
  const Fingerprint fp = detail::to_fingerprint(spec.fingerprint());
  InvalidateResult r;
  r.memory = m.erase_memory_if([&](const ChunkEntry& e) { return e.fp == fp; });
  if (m.disk) r.disk = m.disk->invalidate(fp);
  if (m.redis) r.redis = m.redis->invalidate(fp, &r.redis_complete);
  return r;
}

InvalidateResult KVStore::invalidate_adapter(const ModelSpec& target,
                                             std::string_view adapter_fingerprint) {
  Impl& m = *impl_;
  target.validate();
  const std::string target_fp = target.fingerprint();
  // Only to validate the adapter's digits (the source is not needed to find its entries).
  const Fingerprint adapter =
      detail::to_entry_provenance(Provenance{target_fp, std::string(adapter_fingerprint)}).adapter;
  const Fingerprint fp = detail::to_fingerprint(target_fp);
  InvalidateResult r;
  r.memory = m.erase_memory_if(
      [&](const ChunkEntry& e) { return e.fp == fp && e.provenance.adapter == adapter; });
  if (m.disk) r.disk = m.disk->invalidate_adapter(fp, adapter);
  if (m.redis) r.redis = m.redis->invalidate_adapter(fp, adapter, &r.redis_complete);
  return r;
}

void KVStore::clear(unsigned tiers) {
  Impl& m = *impl_;
  if (tiers & kMemoryTier) {
    for (auto& shard : m.shards) {
      Shard& s = *shard;
      std::vector<Slot> gone;  // freed after the lock is dropped
      {
        std::lock_guard<std::mutex> lock(s.mu);
        gone = s.map.take_all();
        s.order.clear();
      }
      m.entries.fetch_sub(static_cast<int64_t>(gone.size()), std::memory_order_relaxed);
      m.erased.fetch_add(static_cast<int64_t>(gone.size()), std::memory_order_relaxed);
    }
  }
  if ((tiers & kDiskTier) && m.disk) m.disk->clear();
  if ((tiers & kRedisTier) && m.redis) m.redis->clear();
}

StoreStats KVStore::stats() const {
  const Impl& m = *impl_;
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  StoreStats st;
#define KVBRIDGE_STORE_LOAD_(type, member, metric, kind, help) st.member = get(m.member);
  KVBRIDGE_STORE_COUNTERS(KVBRIDGE_STORE_LOAD_)
#undef KVBRIDGE_STORE_LOAD_
  st.capacity_bytes = m.options.capacity_bytes;
  st.bytes_used = get(m.accountant->used);
  st.recycled_bytes = get(m.accountant->pooled);
  st.peak_bytes = get(m.accountant->peak);
  st.entries = get(m.entries);
  st.evictions = get(m.memory_counters.evictions);

  m.memory_counters.fill(&st.memory);
  st.memory.enabled = true;
  st.memory.capacity_bytes = st.capacity_bytes;
  st.memory.bytes_used = st.bytes_used;
  st.memory.entries = st.entries;

  m.disk_counters.fill(&st.disk);
  if (m.disk) {
    st.disk.enabled = true;
    st.disk.capacity_bytes = m.disk->capacity_bytes();
    st.disk.bytes_used = m.disk->bytes_used();
    st.disk.entries = m.disk->entries();
  }
  m.redis_counters.fill(&st.redis);
  m.remote_counters.fill(&st.remote);
  if (m.redis) {
    st.redis.enabled = true;
    st.remote.filter_active = m.redis->filter_active();
  }
  return st;
}

std::string KVStore::metrics_text() const {
  const StoreStats st = stats();
  detail::PrometheusText out("kvbridge_store_");
  // Tier fields: one family each, a sample per tier.
  const std::pair<const char*, const TierStats*> tiers[] = {
      {"memory", &st.memory}, {"disk", &st.disk}, {"redis", &st.redis}};
#define KVBRIDGE_TIER_FAMILY_(type, member, metric, kind, help)                       \
  out.family(metric, #kind, help);                                                    \
  for (const auto& [tier, ts] : tiers)                                                \
    out.sample(metric, std::string("tier=\"") + tier + "\"", static_cast<double>(ts->member));
  KVBRIDGE_TIER_GAUGES(KVBRIDGE_TIER_FAMILY_)
  KVBRIDGE_TIER_COUNTERS(KVBRIDGE_TIER_FAMILY_)
#undef KVBRIDGE_TIER_FAMILY_
#define KVBRIDGE_ROW_(type, member, metric, kind, help) \
  detail::emit_row(out, metric, #kind, help, static_cast<double>(from.member));
  {
    const StoreStats& from = st;
    KVBRIDGE_STORE_COUNTERS(KVBRIDGE_ROW_)
    KVBRIDGE_STORE_GAUGES(KVBRIDGE_ROW_)
  }
  {
    const RemoteStats& from = st.remote;
    // remote_errors_total (the Redis tier's errors_total under its older name, kept for
    // existing dashboards) follows remote_round_trips_total, as it always has.
#define KVBRIDGE_REMOTE_ROW_(type, member, metric, kind, help)                               \
  KVBRIDGE_ROW_(type, member, metric, kind, help)                                            \
  if (std::string_view(#member) == "round_trips")                                            \
    out.single("remote_errors_total", "counter", "Redis errors (failed or timed-out commands).", \
               static_cast<double>(st.redis.errors));
    KVBRIDGE_REMOTE_COUNTERS(KVBRIDGE_REMOTE_ROW_)
#undef KVBRIDGE_REMOTE_ROW_
    KVBRIDGE_REMOTE_GAUGES(KVBRIDGE_ROW_)
  }
#undef KVBRIDGE_ROW_
  out.family("remote_latency_seconds", "histogram", "Latency of answered Redis round trips.");
  for (int i = 0; i < RemoteStats::kLatencyBuckets; ++i) {
    char le[32] = "+Inf";
    if (i + 1 < RemoteStats::kLatencyBuckets)
      std::snprintf(le, sizeof le, "%g", RemoteStats::kLatencyBounds[static_cast<size_t>(i)]);
    out.sample("remote_latency_seconds_bucket", std::string("le=\"") + le + "\"",
               static_cast<double>(st.remote.latency_buckets[static_cast<size_t>(i)]));
  }
  out.sample("remote_latency_seconds_sum", "", st.remote.latency_seconds_sum);
  out.sample("remote_latency_seconds_count", "",
             static_cast<double>(st.remote.latency_buckets[RemoteStats::kLatencyBuckets - 1]));
  return out.text();
}

Match::~Match() = default;

Provenance Match::provenance(int64_t chunk) const {
  KVB_CHECK(chunk >= 0 && chunk < chunks(),
            "provenance: chunk " << chunk << " is outside the match's " << chunks() << " chunks");
  return detail::from_entry_provenance(entries_[static_cast<size_t>(chunk)]->provenance);
}

void Match::copy_to(const KVView& dst) const {
  KVB_CHECK(dst.tokens() == tokens_,
            "dst holds " << dst.tokens() << " tokens but the match has " << tokens_);
  copy_range_to(0, dst);
}

void Match::copy_range_to(int64_t begin, const KVView& dst) const {
  const int64_t n = dst.tokens();
  KVB_CHECK(begin >= 0 && begin + n <= tokens_,
            "range [" << begin << ", " << begin + n << ") is outside the match [0, " << tokens_
                      << ")");
  KVB_CHECK(dst.device().type == DeviceType::kCPU, "dst: must be a CPU view");
  if (n == 0) return;
  const ChunkEntry& first = *entries_.front();
  KVB_CHECK(dst.num_layers() == first.layers && dst.kv_heads() == first.kv_heads &&
                dst.head_dim() == first.head_dim && dst.dtype() == first.dtype,
            "dst: geometry " << dst.num_layers() << "x" << dst.kv_heads() << "x" << dst.head_dim()
                             << " " << dtype_name(dst.dtype()) << " differs from the entry's "
                             << first.layers << "x" << first.kv_heads << "x" << first.head_dim
                             << " " << dtype_name(first.dtype));
  for (int64_t pos = begin; pos < begin + n;) {
    const int64_t c = pos / chunk_tokens_;
    const int64_t offset = pos - c * chunk_tokens_;
    const int64_t take = std::min(chunk_tokens_ - offset, begin + n - pos);
    entries_[static_cast<size_t>(c)]->copy_tokens_to(offset, dst.slice_tokens(pos - begin, take));
    pos += take;
  }
}

}  // namespace kvbridge
