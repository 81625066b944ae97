#include "kvbridge/kv_store.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <list>
#include <mutex>
#include <unordered_map>

#include <sys/mman.h>
#include <utility>

#include "kvbridge/error.h"

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
  char* kv = nullptr;  // [layers, 2, chunk, kv_heads, head_dim], dense; kv_size bytes allocated
  size_t kv_size = 0;
  int64_t layers = 0, chunk = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kFloat32;
  int64_t accounted = 0;
  std::shared_ptr<Accountant> accountant;

  ChunkEntry() = default;
  ChunkEntry(const ChunkEntry&) = delete;
  ChunkEntry& operator=(const ChunkEntry&) = delete;
  ~ChunkEntry() {
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
  KVView view() const {
    return KVView::contiguous(kv, dtype, Device{}, layers, chunk, kv_heads, head_dim);
  }
  bool same_chunk(const Hash128& s, const Hash128& p, const int64_t* ids) const {
    if (salt != s || parent != p) return false;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] != static_cast<uint64_t>(ids[i])) return false;
    }
    return true;
  }
};

}  // namespace detail

using detail::ChunkEntry;
using detail::allocate_payload;
using detail::allocation_size;

namespace {

struct HashOf {
  size_t operator()(const Hash128& h) const noexcept { return static_cast<size_t>(h.low ^ h.high); }
};

struct Slot {
  std::shared_ptr<ChunkEntry> entry;
  std::list<Hash128>::iterator lru_pos;
};

struct Shard {
  std::mutex mu;
  std::unordered_map<Hash128, Slot, HashOf> map;
  std::list<Hash128> lru;  // front: most recently used

  void touch(Slot& slot) { lru.splice(lru.begin(), lru, slot.lru_pos); }
};

int64_t entry_bytes(const ModelSpec& spec, int64_t chunk) {
  const size_t payload = static_cast<size_t>(spec.kv_bytes_per_token() * chunk);
  return static_cast<int64_t>(allocation_size(payload)) + 4 * chunk +
         StoreStats::kEntryOverheadBytes;
}

}  // namespace

struct KVStore::Impl {
  explicit Impl(const StoreOptions& o)
      : options(o), accountant(std::make_shared<detail::Accountant>(o.capacity_bytes)),
        shards(static_cast<size_t>(o.num_shards)) {}

  StoreOptions options;
  std::shared_ptr<detail::Accountant> accountant;
  std::vector<Shard> shards;
  std::atomic<uint32_t> evict_cursor{0};

  std::atomic<int64_t> entries{0}, puts{0}, chunks_inserted{0}, chunks_present{0},
      chunks_rejected{0}, matches{0}, hits{0}, misses{0}, hit_chunks{0}, collisions{0},
      evictions{0}, erased{0};

  Shard& shard_for(const Hash128& h) { return shards[(h.high >> 7) % shards.size()]; }

  // Evicts the least recently used unpinned entry of the next shard that has one.
  bool evict_one() {
    const size_t n = shards.size();
    for (size_t i = 0; i < n; ++i) {
      Shard& s = shards[evict_cursor.fetch_add(1, std::memory_order_relaxed) % n];
      std::shared_ptr<ChunkEntry> victim;  // freed after the lock is dropped
      {
        std::lock_guard<std::mutex> lock(s.mu);
        for (auto it = s.lru.rbegin(); it != s.lru.rend(); ++it) {
          auto slot = s.map.find(*it);
          // use_count is exact here: every other copy is made under this lock.
          if (slot->second.entry.use_count() == 1) {
            victim = std::move(slot->second.entry);
            s.lru.erase(std::next(it).base());
            s.map.erase(slot);
            break;
          }
        }
      }
      if (victim) {
        entries.fetch_sub(1, std::memory_order_relaxed);
        evictions.fetch_add(1, std::memory_order_relaxed);
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

  Probe probe_and_touch(Shard& s, const Hash128& key, const Hash128& salt, const Hash128& parent,
                        const int64_t* ids, std::shared_ptr<const ChunkEntry>* pin) {
    auto it = s.map.find(key);
    if (it == s.map.end()) return Probe::kAbsent;
    if (!it->second.entry->same_chunk(salt, parent, ids)) return Probe::kCollision;
    s.touch(it->second);
    if (pin) *pin = it->second.entry;
    return Probe::kSame;
  }
};

KVStore::KVStore(const StoreOptions& options) {
  KVB_CHECK(options.capacity_bytes > 0,
            "capacity_bytes must be > 0, got " << options.capacity_bytes);
  KVB_CHECK(options.chunk_tokens > 0, "chunk_tokens must be > 0, got " << options.chunk_tokens);
  KVB_CHECK(options.num_shards >= 1 && options.num_shards <= 1024,
            "num_shards must be in [1, 1024], got " << options.num_shards);
  impl_ = std::make_unique<Impl>(options);
}

KVStore::~KVStore() = default;

const StoreOptions& KVStore::options() const noexcept { return impl_->options; }

int64_t KVStore::put(const ModelSpec& spec, TokenSpan tokens, const KVView& kv,
                     std::string_view ns) {
  Impl& m = *impl_;
  spec.validate();
  check_tokens(tokens);
  kv.check_matches(spec, "kv");
  KVB_CHECK(kv.tokens() == static_cast<int64_t>(tokens.size),
            "kv holds " << kv.tokens() << " tokens but tokens has " << tokens.size);
  KVB_CHECK(kv.device().type == DeviceType::kCPU,
            "kv: the store copies host memory; move CUDA tensors to the CPU first");
  m.puts.fetch_add(1, std::memory_order_relaxed);

  const int64_t chunk = m.options.chunk_tokens;
  const int64_t chunks = static_cast<int64_t>(tokens.size) / chunk;
  const int64_t bytes = entry_bytes(spec, chunk);
  const Hash128 salt = prefix_salt(ns, spec);
  Hash128 parent = salt;
  int64_t stored = 0;
  // This call's chunks stay pinned until it returns, so making room for chunk c never evicts
  // chunks 0..c-1 of the same prefix.
  std::vector<std::shared_ptr<const ChunkEntry>> held;
  held.reserve(static_cast<size_t>(chunks));
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t* ids = tokens.data + c * chunk;
    const Hash128 key = chain_hash(parent, ids, chunk);
    Shard& s = m.shard_for(key);
    Impl::Probe found;
    std::shared_ptr<const ChunkEntry> pinned;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      found = m.probe_and_touch(s, key, salt, parent, ids, &pinned);
    }
    if (found == Impl::Probe::kCollision) {
      m.collisions.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    if (found == Impl::Probe::kAbsent) {
      auto entry = std::make_shared<ChunkEntry>();
      entry->accountant = m.accountant;
      if (!m.reserve(bytes)) {
        m.chunks_rejected.fetch_add(chunks - c, std::memory_order_relaxed);
        break;
      }
      entry->accounted = bytes;
      entry->salt = salt;
      entry->parent = parent;
      entry->tokens.assign(ids, ids + chunk);
      entry->layers = spec.num_layers;
      entry->chunk = chunk;
      entry->kv_heads = spec.num_kv_heads;
      entry->head_dim = spec.head_dim;
      entry->dtype = spec.dtype;
      const size_t payload = static_cast<size_t>(spec.kv_bytes_per_token() * chunk);
      entry->kv_size = allocation_size(payload);
      entry->kv = m.accountant->take(entry->kv_size);
      if (!entry->kv) entry->kv = allocate_payload(payload);
      copy_kv(kv.slice_tokens(c * chunk, chunk), entry->view());

      std::lock_guard<std::mutex> lock(s.mu);
      found = m.probe_and_touch(s, key, salt, parent, ids, &pinned);
      if (found == Impl::Probe::kCollision) {
        m.collisions.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      if (found == Impl::Probe::kAbsent) {  // else another thread stored it meanwhile
        pinned = entry;
        s.lru.push_front(key);
        s.map.emplace(key, Slot{std::move(entry), s.lru.begin()});
        m.entries.fetch_add(1, std::memory_order_relaxed);
        m.chunks_inserted.fetch_add(1, std::memory_order_relaxed);
      } else {
        m.chunks_present.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      m.chunks_present.fetch_add(1, std::memory_order_relaxed);
    }
    held.push_back(std::move(pinned));
    parent = key;
    stored = c + 1;
  }
  return stored * chunk;
}

Match KVStore::match(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  Impl& m = *impl_;
  spec.validate();
  check_tokens(tokens);
  const int64_t chunk = m.options.chunk_tokens;
  const int64_t chunks = static_cast<int64_t>(tokens.size) / chunk;
  const Hash128 salt = prefix_salt(ns, spec);
  Match result;
  result.chunk_tokens_ = chunk;
  Hash128 parent = salt;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t* ids = tokens.data + c * chunk;
    const Hash128 key = chain_hash(parent, ids, chunk);  // hashed lazily: a miss stops early
    Shard& s = m.shard_for(key);
    std::shared_ptr<const ChunkEntry> pinned;
    Impl::Probe found;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      found = m.probe_and_touch(s, key, salt, parent, ids, &pinned);
    }
    if (found == Impl::Probe::kCollision) m.collisions.fetch_add(1, std::memory_order_relaxed);
    if (found != Impl::Probe::kSame) break;
    result.entries_.push_back(std::move(pinned));
    parent = key;
  }
  result.tokens_ = result.chunks() * chunk;
  m.matches.fetch_add(1, std::memory_order_relaxed);
  (result.tokens_ ? m.hits : m.misses).fetch_add(1, std::memory_order_relaxed);
  m.hit_chunks.fetch_add(result.chunks(), std::memory_order_relaxed);
  return result;
}

int64_t KVStore::erase(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  Impl& m = *impl_;
  spec.validate();
  const int64_t chunk = m.options.chunk_tokens;
  const Hash128 salt = prefix_salt(ns, spec);
  const std::vector<Hash128> keys = prefix_hashes(salt, tokens, chunk);
  int64_t removed = 0;
  Hash128 parent = salt;
  for (size_t c = 0; c < keys.size(); ++c) {
    Shard& s = m.shard_for(keys[c]);
    std::shared_ptr<ChunkEntry> gone;  // freed after the lock is dropped
    {
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.map.find(keys[c]);
      if (it != s.map.end() &&
          it->second.entry->same_chunk(salt, parent, tokens.data + c * chunk)) {
        gone = std::move(it->second.entry);
        s.lru.erase(it->second.lru_pos);
        s.map.erase(it);
      }
    }
    if (gone) ++removed;
    parent = keys[c];
  }
  m.entries.fetch_sub(removed, std::memory_order_relaxed);
  m.erased.fetch_add(removed, std::memory_order_relaxed);
  return removed;
}

void KVStore::clear() {
  Impl& m = *impl_;
  for (Shard& s : m.shards) {
    std::unordered_map<Hash128, Slot, HashOf> gone;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      gone.swap(s.map);
      s.lru.clear();
    }
    m.entries.fetch_sub(static_cast<int64_t>(gone.size()), std::memory_order_relaxed);
    m.erased.fetch_add(static_cast<int64_t>(gone.size()), std::memory_order_relaxed);
  }
}

StoreStats KVStore::stats() const {
  const Impl& m = *impl_;
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  StoreStats st;
  st.capacity_bytes = m.options.capacity_bytes;
  st.bytes_used = get(m.accountant->used);
  st.recycled_bytes = get(m.accountant->pooled);
  st.peak_bytes = get(m.accountant->peak);
  st.entries = get(m.entries);
  st.puts = get(m.puts);
  st.chunks_inserted = get(m.chunks_inserted);
  st.chunks_present = get(m.chunks_present);
  st.chunks_rejected = get(m.chunks_rejected);
  st.matches = get(m.matches);
  st.hits = get(m.hits);
  st.misses = get(m.misses);
  st.hit_chunks = get(m.hit_chunks);
  st.collisions = get(m.collisions);
  st.evictions = get(m.evictions);
  st.erased = get(m.erased);
  return st;
}

Match::~Match() = default;

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
    copy_kv(entries_[static_cast<size_t>(c)]->view().slice_tokens(offset, take),
            dst.slice_tokens(pos - begin, take));
    pos += take;
  }
}

}  // namespace kvbridge
