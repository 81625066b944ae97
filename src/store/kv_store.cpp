#include "kvbridge/kv_store.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <utility>

#include "kvbridge/error.h"
#include "src/core/byte_order.h"
#include "src/core/path_check.h"
#include "src/core/prometheus.h"
#include "src/core/xxh3.h"
#include "src/index/token_ids.h"
#include "src/store/disk_tier.h"
#include "src/store/entry_codec.h"
#include "src/store/memory_tier.h"
#include "src/store/redis_tier.h"
#include "src/store/tier.h"

namespace kvbridge {
using detail::ChunkEntry;
using detail::ChunkShape;
using detail::DiskTier;
using detail::EntryHeader;
using detail::ExpectedEntry;
using detail::Fingerprint;
using detail::LoadResult;
using detail::MemoryTier;
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

int64_t stored_bytes(const ModelSpec& spec, int64_t chunk, StorageFormat storage) {
  const int64_t bytes = detail::stored_payload_bytes(storage, spec.dtype, spec.num_layers, chunk,
                                                     spec.num_kv_heads, spec.head_dim);
  KVB_CHECK(bytes > 0, "spec: a chunk's KV size overflows");
  return bytes;
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
  ChunkShape shape;
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
        ttl_ms(o.ttl_seconds * 1000), memory(o) {}

  StoreOptions options;
  std::function<int64_t()> clock;
  const int64_t ttl_ms;
  MemoryTier memory;
  std::unique_ptr<DiskTier> disk;
  std::unique_ptr<RedisTier> redis;

  KVBRIDGE_STORE_COUNTERS(KVBRIDGE_STATS_ATOMIC_)
  TierCounters disk_counters, redis_counters;
  detail::RemoteCounters remote_counters;

  bool lower_tiers() const { return disk || redis; }

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
    ChunkShape shape;
    shape.salt = last.salt;
    shape.fp = last.fp;
    shape.layers = spec.num_layers;
    shape.chunk = options.chunk_tokens;
    shape.kv_heads = spec.num_kv_heads;
    shape.head_dim = spec.head_dim;
    shape.dtype = spec.dtype;
    shape.storage = options.storage;
    shape.payload_bytes = stored_bytes(spec, options.chunk_tokens, options.storage);
    return Call{spec, ns, shape, clock()};
  }

  ExpectedEntry expected(const Call& c, const Hash128& key, const Hash128& parent,
                         const uint32_t* ids) const {
    const ChunkShape& shape = c.shape;
    ExpectedEntry w;
    w.key = key;
    w.parent = parent;
    w.salt = shape.salt;
    w.fingerprint = shape.fp;
    w.dtype = shape.dtype;
    w.storage = shape.storage;
    w.layers = shape.layers;
    w.chunk = shape.chunk;
    w.kv_heads = shape.kv_heads;
    w.head_dim = shape.head_dim;
    w.payload_bytes = shape.payload_bytes;
    w.tokens = ids;
    w.now_ms = c.now_ms;
    w.ttl_ms = ttl_ms;
    return w;
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
        detail::entry_encoded_bytes(call.shape.chunk, call.shape.payload_bytes);
    const size_t limit = std::max<size_t>(
        1, std::min<size_t>(1024, static_cast<size_t>(options.redis_batch_bytes) / value_bytes));
    w->begin = c;
    w->epoch = redis->epoch();
    w->names.clear();
    w->names.push_back(redis->key_for(call.ns, call.shape.fp, keys.at(c)));
    for (size_t k = c + 1; k < chunks && w->names.size() < limit; ++k) {
      const Hash128& key = keys.at(k);
      if (!redis->may_contain(key) || memory.contains(key) || (disk && disk->contains(key, call.shape.fp)))
        break;
      w->names.push_back(redis->key_for(call.ns, call.shape.fp, key));
    }
    w->count = w->names.size();
    w->slots.assign(w->count, RemoteSlot{});
    // Each value is verified and copied into its entry while hiredis parses the reply.
    auto consume = [&](size_t i, const unsigned char* data, size_t size) {
      if (i >= w->count) return;
      RemoteSlot& slot = w->slots[i];
      slot.present = true;
      const size_t k = w->begin + i;
      const uint32_t* ids = keys.tokens + static_cast<int64_t>(k) * call.shape.chunk;
      const ExpectedEntry want = expected(call, keys.at(k), keys.parent(k), ids);
      slot.entry = memory.new_entry(call.shape, keys.parent(k), ids, call.now_ms);
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
    const uint32_t* ids = keys.tokens + static_cast<int64_t>(c) * call.shape.chunk;
    const ExpectedEntry want = expected(call, key, parent, ids);
    std::shared_ptr<ChunkEntry> entry;
    auto promote = [&](TierCounters& tier) -> std::shared_ptr<const ChunkEntry> {
      std::shared_ptr<const ChunkEntry> pin;
      bool inserted = false;
      if (memory.insert(key, std::move(entry), call.now_ms, &pin, &inserted) ==
          MemoryTier::Probe::kCollision) {
        *collision = true;
        return nullptr;
      }
      if (inserted) promotions.fetch_add(1, std::memory_order_relaxed);
      TierCounters::add(tier.hit_chunks);
      return pin;
    };
    auto allocate = [&](int64_t created) {
      if (!entry) entry = memory.new_entry(call.shape, parent, ids, created);
      if (!entry) promotions_rejected.fetch_add(1, std::memory_order_relaxed);
      return entry != nullptr;
    };

    if (disk) {
      if (disk->contains(key, call.shape.fp)) {
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
  const int64_t chunk = call.shape.chunk;
  const int64_t chunks = static_cast<int64_t>(tokens.size) / chunk;
  Hash128 parent = call.shape.salt;
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
      writes.push_back({m.redis->key_for(ns, call.shape.fp, w.key), w.key, w.packed.prefix.data(),
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
    MemoryTier::Probe found = m.memory.probe(key, call.shape.salt, parent, ids, call.now_ms, &pinned);
    if (found == MemoryTier::Probe::kCollision) {
      m.collisions.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    bool inserted = false;
    std::shared_ptr<ChunkEntry> fresh;
    if (found == MemoryTier::Probe::kAbsent) {
      fresh = m.memory.new_entry(call.shape, parent, ids, call.now_ms);
      if (fresh) {
        fresh->provenance = origin;
        fresh->fill_from(kv.slice_tokens(c * chunk, chunk));
        found = m.memory.insert(key, fresh, call.now_ms, &pinned, &inserted);
        if (found == MemoryTier::Probe::kCollision) {
          m.collisions.fetch_add(1, std::memory_order_relaxed);
          break;
        }
      } else {
        TierCounters::add(m.memory.counters().write_failures);
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
        auto transient = MemoryTier::transient_entry(call.shape, parent, ids, call.now_ms);
        transient->provenance = origin;
        transient->fill_from(kv.slice_tokens(c * chunk, chunk));
        source = std::move(transient);
      }
      const bool to_disk = m.disk && !m.disk->has_file(key, call.shape.fp);
      // Redis gets every chunk it is not known to hold: new ones, and ones put or promoted
      // while it was down or before it last failed (so an outage is repaired by the next put).
      const bool to_redis =
          m.redis && (!pinned || pinned->redis_epoch.load(std::memory_order_relaxed) !=
                                     m.redis->epoch());
      if (to_disk || to_redis) {
        Packed packed = pack(*source, key);
        if (to_disk) {
          in_lower = m.disk->store(key, call.shape.fp, packed.prefix.data(), packed.prefix.size(),
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
  const int64_t chunk = call.shape.chunk;
  const size_t chunks = tokens.size / static_cast<size_t>(chunk);
  Match result;
  result.chunk_tokens_ = chunk;
  Impl::Keys keys{ids_all.data(), chunk, {}, call.shape.salt};  // hashed lazily: a miss stops early
  keys.h.reserve(chunks);
  result.entries_.reserve(chunks);
  Impl::RemoteWindow window;
  int64_t memory_hits = 0;  // counted once per call, not per chunk
  // Memory hits are pinned a run at a time (16 chunks, doubling while they hit): one lock per
  // shard per run instead of one per chunk; the run's keys are hashed just before.
  size_t run = 16;
  for (size_t c = 0; c < chunks;) {
    const size_t n = std::min({run, chunks - c, MemoryTier::kMaxPrefixRun});
    keys.at(c + n - 1);
    const MemoryTier::PrefixRun hit = m.memory.pin_prefix(
        keys.h.data() + c, n, call.shape.salt, keys.parent(c),
        ids_all.data() + static_cast<int64_t>(c) * chunk, chunk, call.now_ms, &result.entries_);
    memory_hits += static_cast<int64_t>(hit.hits);
    c += hit.hits;
    if (hit.hits == n) {
      run = std::min(2 * run, MemoryTier::kMaxPrefixRun);
      continue;
    }
    run = 16;
    if (hit.stop == MemoryTier::Probe::kCollision) {
      m.collisions.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    TierCounters::add(m.memory.counters().misses);
    if (!m.lower_tiers()) break;
    bool collision = false;
    std::shared_ptr<const ChunkEntry> pinned = m.load_lower(call, keys, c, chunks, &window, &collision);
    if (collision) m.collisions.fetch_add(1, std::memory_order_relaxed);
    if (!pinned) break;
    result.entries_.push_back(std::move(pinned));
    ++c;
  }
  TierCounters::add(m.memory.counters().hit_chunks, memory_hits);
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
    if ((tiers & kMemoryTier) && m.memory.erase(keys[c], salt, parent, ids.data() + c * chunk)) {
      ++removed;
      m.erased.fetch_add(1, std::memory_order_relaxed);
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
  r.memory = m.memory.erase_if([&](const ChunkEntry& e) { return e.fp == fp; });
  m.erased.fetch_add(r.memory, std::memory_order_relaxed);
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
  r.memory = m.memory.erase_if(
      [&](const ChunkEntry& e) { return e.fp == fp && e.provenance.adapter == adapter;
  m.erased.fetch_add(r.memory, std::memory_order_relaxed); });
  if (m.disk) r.disk = m.disk->invalidate_adapter(fp, adapter);
  if (m.redis) r.redis = m.redis->invalidate_adapter(fp, adapter, &r.redis_complete);
  return r;
}

void KVStore::clear(unsigned tiers) {
  Impl& m = *impl_;
  if (tiers & kMemoryTier) m.erased.fetch_add(m.memory.clear(), std::memory_order_relaxed);
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
  m.memory.fill(&st);

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
