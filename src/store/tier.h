// What the store's lower tiers (disk, Redis) share: counters and the description of the entry a
// lookup requires.
#pragma once

#include <atomic>
#include <cstdint>

#include "kvbridge/kv_store.h"
#include "src/store/entry_codec.h"

namespace kvbridge::detail {

struct TierCounters {
  std::atomic<int64_t> hit_chunks{0}, misses{0}, writes{0}, write_failures{0}, evictions{0},
      expired{0}, corrupt{0}, errors{0}, bytes_read{0}, bytes_written{0};

  static void add(std::atomic<int64_t>& c, int64_t n = 1) {
    c.fetch_add(n, std::memory_order_relaxed);
  }
  void fill(TierStats* s) const {
    auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
    s->hit_chunks = get(hit_chunks);
    s->misses = get(misses);
    s->writes = get(writes);
    s->write_failures = get(write_failures);
    s->evictions = get(evictions);
    s->expired = get(expired);
    s->corrupt = get(corrupt);
    s->errors = get(errors);
    s->bytes_read = get(bytes_read);
    s->bytes_written = get(bytes_written);
  }
};

/// The entry a lookup accepts: everything a stored header must agree with.
struct ExpectedEntry {
  Hash128 key, parent, salt;
  Fingerprint fingerprint{};
  DType dtype = DType::kFloat32;
  StorageFormat storage = StorageFormat::kNative;
  int64_t layers = 0, chunk = 0, kv_heads = 0, head_dim = 0;
  int64_t payload_bytes = 0;  // stored bytes (stored_payload_bytes)
  const uint32_t* tokens = nullptr;  // chunk ids
  int64_t now_ms = 0;
  int64_t ttl_ms = 0;  // 0: no expiry
};

/// What a verified hit reports besides its payload.
struct LoadedMeta {
  int64_t created_ms = 0;
  EntryProvenance provenance;
  static LoadedMeta of(const EntryHeader& h) { return {h.created_ms, h.provenance}; }
};

enum class LoadResult {
  kHit,        // payload filled, verified
  kMiss,       // absent, expired, corrupt or unreadable (each counted by the tier)
  kCollision,  // a valid entry for this key, but of other tokens / parent / salt
};

/// Geometry and identity check of a decoded header against the lookup. Returns false when the
/// header cannot belong to this key (counted as corrupt by the caller).
inline bool header_fits(const EntryHeader& h, const ExpectedEntry& want) {
  return h.key == want.key && h.fingerprint == want.fingerprint && h.dtype == want.dtype &&
         h.storage == want.storage && h.layers == want.layers && h.chunk == want.chunk && h.kv_heads == want.kv_heads &&
         h.head_dim == want.head_dim && h.payload_bytes == want.payload_bytes;
}

/// True when the verified entry is the chunk the lookup asks for.
inline bool same_chunk(const EntryHeader& h, const uint32_t* tokens, const ExpectedEntry& want) {
  if (h.salt != want.salt || h.parent != want.parent) return false;
  for (int64_t i = 0; i < want.chunk; ++i)
    if (tokens[i] != want.tokens[i]) return false;
  return true;
}

inline bool is_expired(int64_t created_ms, const ExpectedEntry& want) {
  return want.ttl_ms > 0 && want.now_ms - created_ms >= want.ttl_ms;
}

}  // namespace kvbridge::detail
