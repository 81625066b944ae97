#include "kvbridge/kv_store.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <utility>

#include "kvbridge/error.h"
#include "src/core/byte_order.h"
#include "src/core/prometheus.h"
#include "src/core/xxh3.h"
#include "src/index/chain_hashes.h"
#include "src/index/token_ids.h"
#include "src/store/entry_codec.h"
#include "src/store/memory_tier.h"
#include "src/store/tier.h"
#include "src/store/tier_table.h"

namespace kvbridge {
using detail::ChunkEntry;
using detail::ChunkShape;
using detail::EntryHeader;
using detail::ExpectedEntry;
using detail::Fingerprint;
using detail::LoadResult;
using detail::LowerTier;
using detail::MemoryTier;
using detail::PackedEntry;
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
PackedEntry pack(const ChunkEntry& e, const Hash128& key) {
  EntryHeader h;
  h.geometry = e.geometry;
  h.created_ms = e.created_ms;
  h.key = key;
  h.parent = e.parent;
  h.salt = e.salt;
  h.fingerprint = e.fp;
  h.provenance = e.provenance;
  PackedEntry p;
  p.prefix.resize(detail::entry_prefix_bytes(e.geometry.chunk));
  detail::encode_entry_prefix(h, e.tokens.data(), p.prefix.data());
  p.checksum = detail::entry_checksum(p.prefix.data(), p.prefix.size(), e.kv, e.payload_size());
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
  // The tiers below memory that the options turn on, in the order lookups walk them
  // (tier_table.h), and their rows of the table.
  std::vector<std::unique_ptr<LowerTier>> tiers;
  std::vector<const detail::TierKind*> kinds;

  KVBRIDGE_STORE_COUNTERS(KVBRIDGE_STATS_ATOMIC_)

  bool lower_tiers() const { return !tiers.empty(); }

  // The geometry of spec's chunk entries in this store.
  detail::ChunkGeometry geometry(const ModelSpec& spec) const {
    const auto g = detail::ChunkGeometry::of(options.storage, spec.dtype, spec.num_layers,
                                             options.chunk_tokens, spec.num_kv_heads,
                                             spec.head_dim);
    KVB_CHECK(g.payload_bytes > 0, "spec: a chunk's KV size overflows");
    return g;
  }

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
    shape.geometry = geometry(spec);
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
    w.geometry = shape.geometry;
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
      const size_t have = h.size();
      if (have <= c) {
        h.resize(c + 1);
        detail::chain_hashes(have ? h[have - 1] : salt, tokens + static_cast<int64_t>(have) * chunk,
                             chunk, c + 1 - have, h.data() + have);
      }
      return h[c];
    }
    Hash128 parent(size_t c) { return c == 0 ? salt : at(c - 1); }
  };

  // One match() call's lookups of the lower tiers: for each tier the run it last asked about
  // and the answers (a tier reading ahead answers chunks the walk reaches later), and the
  // payload buffers of that run.
  struct Lookup {
    struct Asked {
      explicit Asked(MemoryTier& memory) : payloads(memory) {}
      detail::LookupBatch batch;
      detail::PayloadPool payloads;
      std::vector<detail::LookupAnswer> answers;
      bool answers_for(size_t c) const {
        return c >= batch.first && c - batch.first < answers.size();
      }
    };
    Lookup(Impl& store, const Call& c, Keys& k, size_t n) : m(store), call(c), keys(k), count(n) {
      asked.reserve(store.tiers.size());
      for (size_t t = 0; t < store.tiers.size(); ++t) asked.emplace_back(store.memory);
    }
    Impl& m;
    const Call& call;
    Keys& keys;
    size_t count;
    std::vector<Asked> asked;  // one per tier

    const uint32_t* ids(size_t c) const {
      return keys.tokens + static_cast<int64_t>(c) * call.shape.geometry.chunk;
    }
    // Whether memory or a tier walked before tier t holds chunk c (a run stops there).
    bool held_above(size_t c, size_t t) {
      const Hash128& k = keys.at(c);
      if (m.memory.contains(k)) return true;
      for (size_t above = 0; above < t; ++above)
        if (m.tiers[above]->contains(k, call.shape.fp)) return true;
      return false;
    }
    // Asks tier t about the run from chunk c (keys are hashed as the run grows: it stops
    // early) and frees the buffers of the chunks it did not answer as hits.
    void ask(size_t t, size_t c) {
      LowerTier& tier = *m.tiers[t];
      Asked& a = asked[t];
      a.batch.ns = call.ns;
      a.batch.fp = call.shape.fp;
      a.batch.first = c;
      a.batch.run.clear();
      a.answers.clear();
      const size_t cap = std::min(tier.read_ahead_chunks(call.shape.geometry), count - c);
      for (size_t k = c; k < c + cap; ++k) {
        const Hash128 key = keys.at(k);
        if (!tier.may_hold(key) || (k > c && held_above(k, t))) break;
        a.batch.run.push_back(m.expected(call, key, keys.parent(k), ids(k)));
      }
      a.payloads.start(a.batch.run);
      tier.lookup(a.batch, a.payloads, &a.answers);
      for (size_t i = 0; i < a.batch.run.size(); ++i)
        if (i >= a.answers.size() || a.answers[i].result != LoadResult::kHit)
          a.payloads.discard(i);
    }
  };

  int64_t walk(const ModelSpec& spec, TokenSpan tokens, std::string_view ns,
               std::vector<std::shared_ptr<const ChunkEntry>>* pins,
               detail::EntryProvenance* converted);

  // Looks chunk c up in each lower tier in turn and promotes a hit into memory. Returns the
  // pinned entry, or nullptr (a miss or a collision, *collision says which; or no room).
  std::shared_ptr<const ChunkEntry> load_lower(Lookup& lookup, size_t c, bool* collision) {
    const Hash128 key = lookup.keys.at(c);
    for (size_t t = 0; t < tiers.size(); ++t) {
      LowerTier& tier = *tiers[t];
      Lookup::Asked& asked = lookup.asked[t];
      if (!asked.answers_for(c)) lookup.ask(t, c);
      if (!asked.answers_for(c)) continue;  // ruled out without a read
      const size_t i = c - asked.batch.first;
      const detail::LookupAnswer& a = asked.answers[i];
      if (a.result == LoadResult::kMiss) continue;
      if (a.result == LoadResult::kNoRoom) {
        promotions_rejected.fetch_add(1, std::memory_order_relaxed);
        return nullptr;
      }
      if (a.result == LoadResult::kCollision) {
        *collision = true;
        return nullptr;
      }
      std::shared_ptr<ChunkEntry> entry = asked.payloads.take(i);
      entry->created_ms = a.meta.created_ms;
      entry->provenance = a.meta.provenance;
      if (a.meta.mark >= 0)
        entry->tier_marks[tier.slot()].store(a.meta.mark, std::memory_order_relaxed);
      std::shared_ptr<const ChunkEntry> pin;
      bool inserted = false;
      if (memory.insert(key, std::move(entry), lookup.call.now_ms, &pin, &inserted) ==
          MemoryTier::Probe::kCollision) {
        *collision = true;
        return nullptr;
      }
      if (inserted) promotions.fetch_add(1, std::memory_order_relaxed);
      tier.served();
      return pin;
    }
    return nullptr;
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
  impl_ = std::make_unique<Impl>(options);
  for (const detail::TierKind& kind : detail::tier_kinds()) {
    if (!kind.make || !kind.enabled(options)) continue;
    impl_->tiers.push_back(kind.make(options, impl_->clock));
    impl_->tiers.back()->set_slot(impl_->tiers.size() - 1);
    impl_->kinds.push_back(&kind);
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
  const int64_t chunk = call.shape.geometry.chunk;
  const int64_t chunks = static_cast<int64_t>(tokens.size) / chunk;
  Hash128 parent = call.shape.salt;
  // This call's chunks stay pinned until it returns, so making room for chunk c never evicts
  // chunks 0..c-1 of the same prefix (and the lower tiers can be written from them).
  std::vector<std::shared_ptr<const ChunkEntry>> held;
  held.reserve(static_cast<size_t>(chunks));
  // kept[c]: chunk c is in memory or in a tier that stores each chunk at once; stored_below[c]:
  // a batched write of it succeeded (known when its batch is flushed).
  std::vector<char> kept;
  std::vector<char> stored_below(static_cast<size_t>(chunks), 0);
  // The writes each batching tier has gathered; a deque keeps the packed entries in place.
  std::deque<PackedEntry> packs;
  struct Batch {
    std::vector<LowerTier::ChunkWrite> writes;
    std::vector<int64_t> chunk_of;
    size_t bytes = 0;
  };
  std::vector<Batch> batches(m.tiers.size());
  std::vector<char> done;
  auto flush = [&](size_t t) {
    Batch& b = batches[t];
    if (b.writes.empty()) return;
    m.tiers[t]->store(ns, call.shape.fp, b.writes, &done);
    for (size_t i = 0; i < b.writes.size(); ++i)
      if (done[i]) stored_below[static_cast<size_t>(b.chunk_of[i])] = 1;
    b = Batch{};
  };
  std::vector<char> wanted(m.tiers.size());

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
    bool in_lower = false;  // in a tier that stores at once (or already held there)
    bool batched = false;   // handed to a batching tier
    if (m.lower_tiers()) {
      bool any = false;
      for (size_t t = 0; t < m.tiers.size(); ++t)
        any |= (wanted[t] = m.tiers[t]->wants(key, call.shape.fp, pinned.get()));
      if (any) {
        // Without room in memory the chunk is packed from the caller's view into a transient
        // entry of its own (not accounted: it lives only until this call returns).
        std::shared_ptr<const ChunkEntry> source = pinned;
        if (!source) {
          auto transient = MemoryTier::transient_entry(call.shape, parent, ids, call.now_ms);
          transient->provenance = origin;
          transient->fill_from(kv.slice_tokens(c * chunk, chunk));
          source = std::move(transient);
        }
        packs.push_back(pack(*source, key));
        const LowerTier::ChunkWrite write{key, &packs.back(), source};
        for (size_t t = 0; t < m.tiers.size(); ++t) {
          LowerTier& tier = *m.tiers[t];
          if (!wanted[t]) {
            in_lower = true;  // the tier holds it already
          } else if (tier.batch_bytes() == 0) {
            tier.store(ns, call.shape.fp, {write}, &done);
            in_lower |= done[0] != 0;
          } else {
            Batch& batch = batches[t];
            batch.writes.push_back(write);
            batch.chunk_of.push_back(c);
            batch.bytes += write.packed->prefix.size() + source->payload_size();
            batched = true;
            if (batch.bytes >= tier.batch_bytes()) flush(t);
          }
        }
      } else {
        in_lower = true;  // every tier holds it already
      }
    }
    if (!pinned && !in_lower && !batched) {
      m.chunks_rejected.fetch_add(chunks - c, std::memory_order_relaxed);
      break;
    }
    kept.push_back(pinned != nullptr || in_lower);
    if (pinned) held.push_back(std::move(pinned));
    parent = key;
  }
  for (size_t t = 0; t < m.tiers.size(); ++t) flush(t);
  int64_t stored = 0;
  while (stored < static_cast<int64_t>(kept.size()) &&
         (kept[static_cast<size_t>(stored)] || stored_below[static_cast<size_t>(stored)]))
    ++stored;
  if (stored < static_cast<int64_t>(kept.size()))
    m.chunks_rejected.fetch_add(static_cast<int64_t>(kept.size()) - stored,
                                std::memory_order_relaxed);
  return stored * chunk;
}

// match() and match_length(): the chunks of the longest cached prefix, in order. With pins null
// nothing is pinned and *converted gets the first converted chunk's provenance.
int64_t KVStore::Impl::walk(const ModelSpec& spec, TokenSpan tokens, std::string_view ns,
                            std::vector<std::shared_ptr<const ChunkEntry>>* pins,
                            detail::EntryProvenance* converted) {
  Impl& m = *this;
  spec.validate();
  const detail::TokenIds ids_all(tokens);
  const Call call = m.call(spec, ns);
  const int64_t chunk = call.shape.geometry.chunk;
  const size_t chunks = tokens.size / static_cast<size_t>(chunk);
  Impl::Keys keys{ids_all.data(), chunk, {}, call.shape.salt};  // hashed lazily: a miss stops early
  keys.h.reserve(chunks);
  if (pins) pins->reserve(chunks);
  std::unique_ptr<Impl::Lookup> lookup;  // made at the first memory miss
  int64_t memory_hits = 0;  // counted once per call, not per chunk
  size_t hits = 0;
  // Memory hits are pinned a run at a time (16 chunks, doubling while they hit): one lock per
  // shard per run instead of one per chunk; the run's keys are hashed just before.
  size_t run = 16;
  for (size_t c = 0; c < chunks;) {
    const size_t n = std::min({run, chunks - c, MemoryTier::kMaxPrefixRun});
    keys.at(c + n - 1);
    const MemoryTier::PrefixRun hit = m.memory.pin_prefix(
        keys.h.data() + c, n, call.shape.salt, keys.parent(c),
        ids_all.data() + static_cast<int64_t>(c) * chunk, chunk, call.now_ms, pins, converted);
    memory_hits += static_cast<int64_t>(hit.hits);
    c += hit.hits;
    hits += hit.hits;
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
    if (!lookup) lookup = std::make_unique<Impl::Lookup>(m, call, keys, chunks);
    std::shared_ptr<const ChunkEntry> pinned = m.load_lower(*lookup, c, &collision);
    if (collision) m.collisions.fetch_add(1, std::memory_order_relaxed);
    if (!pinned) break;
    if (pins) {
      pins->push_back(std::move(pinned));
    } else if (converted && !converted->converted() && pinned->provenance.converted()) {
      *converted = pinned->provenance;
    }
    ++hits;
    ++c;
  }
  TierCounters::add(m.memory.counters().hit_chunks, memory_hits);
  m.matches.fetch_add(1, std::memory_order_relaxed);
  (hits ? m.hits : m.misses).fetch_add(1, std::memory_order_relaxed);
  m.hit_chunks.fetch_add(static_cast<int64_t>(hits), std::memory_order_relaxed);
  return static_cast<int64_t>(hits) * chunk;
}

Match KVStore::match(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  Match result;
  result.chunk_tokens_ = impl_->options.chunk_tokens;
  result.tokens_ = impl_->walk(spec, tokens, ns, &result.entries_, nullptr);
  return result;
}

MatchLength KVStore::match_length(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  detail::EntryProvenance converted;
  MatchLength result;
  result.tokens = impl_->walk(spec, tokens, ns, nullptr, &converted);
  result.converted_provenance = detail::from_entry_provenance(converted);
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
  for (size_t c = 0; c < keys.size(); ++c) {
    if ((tiers & kMemoryTier) && m.memory.erase(keys[c], salt, parent, ids.data() + c * chunk)) {
      ++removed;
      m.erased.fetch_add(1, std::memory_order_relaxed);
    }
    parent = keys[c];
  }
  const Fingerprint fp = detail::to_fingerprint(spec.fingerprint());
  for (size_t t = 0; t < m.tiers.size(); ++t)
    if (tiers & m.kinds[t]->info.bit) removed += m.tiers[t]->erase(ns, fp, keys);
  return removed;
}

InvalidateResult KVStore::invalidate(const ModelSpec& spec) {
  Impl& m = *impl_;
  spec.validate();
  const Fingerprint fp = detail::to_fingerprint(spec.fingerprint());
  InvalidateResult r;
  r.memory = m.memory.erase_if([&](const ChunkEntry& e) { return e.fp == fp; });
  m.erased.fetch_add(r.memory, std::memory_order_relaxed);
  for (const auto& tier : m.tiers) tier->invalidate(fp, &r);
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
      [&](const ChunkEntry& e) { return e.fp == fp && e.provenance.adapter == adapter; });
  m.erased.fetch_add(r.memory, std::memory_order_relaxed);
  for (const auto& tier : m.tiers) tier->invalidate_adapter(fp, adapter, &r);
  return r;
}

void KVStore::clear(unsigned tiers) {
  Impl& m = *impl_;
  if (tiers & kMemoryTier) m.erased.fetch_add(m.memory.clear(), std::memory_order_relaxed);
  for (size_t t = 0; t < m.tiers.size(); ++t)
    if (tiers & m.kinds[t]->info.bit) m.tiers[t]->clear();
}

StoreStats KVStore::stats() const {
  const Impl& m = *impl_;
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  StoreStats st;
#define KVBRIDGE_STORE_LOAD_(type, member, metric, kind, help) st.member = get(m.member);
  KVBRIDGE_STORE_COUNTERS(KVBRIDGE_STORE_LOAD_)
#undef KVBRIDGE_STORE_LOAD_
  m.memory.fill(&st);
  for (size_t t = 0; t < m.tiers.size(); ++t) {  // an absent tier's section stays zero
    TierStats& own = st.*(m.kinds[t]->info.stats);
    own.enabled = true;
    m.tiers[t]->fill(&own, &st);
  }
  return st;
}

std::string KVStore::metrics_text() const {
  const StoreStats st = stats();
  detail::PrometheusText out("kvbridge_store_");
  // Tier fields: one family each, a sample per tier (configured or not).
#define KVBRIDGE_TIER_FAMILY_(type, member, metric, kind, help)                           \
  out.family(metric, #kind, help);                                                        \
  for (const StoreTierInfo& tier : store_tiers())                                         \
    out.sample(metric, std::string("tier=\"") + tier.name + "\"",                       \
               static_cast<double>((st.*tier.stats).member));
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

Provenance Match::converted_provenance() const {
  for (const auto& entry : entries_) {
    if (entry->provenance.converted()) return detail::from_entry_provenance(entry->provenance);
  }
  return {};
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
  const detail::ChunkGeometry& first = entries_.front()->geometry;
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
