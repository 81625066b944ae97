// KVStore: an in-memory, thread-safe cache of chunk KV blocks keyed by the prefix-hash index.
//
// A sequence's KV is stored as one entry per whole chunk of `chunk_tokens` tokens. Each entry
// keeps its chunk's token ids, its parent hash and the salt it was stored under, and a lookup
// compares all three, so neither a hash collision nor another namespace's or model's entry can
// ever be returned. A trailing partial chunk is never stored.
//
// Memory: `capacity_bytes` bounds the accounted bytes (the KV payload's allocation, rounded up
// to 64 bytes, or to 2 MiB for payloads of 32 MiB and more, + 4 bytes per token id + a fixed
// per-entry overhead, see StoreStats) at every instant; space is reserved before an entry is
// allocated and released when its memory is freed. Eviction is LRU within a shard, shards taken
// round robin (exact LRU with num_shards = 1). Up to four freed payloads of 1 MiB or more are kept
// (and stay accounted) for reuse by the next entry of the same size; they are freed first when
// room is needed. An entry referenced by a live Match is pinned: it
// is never evicted, and its bytes stay accounted until the last Match holding it is destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "kvbridge/prefix_hash.h"

namespace kvbridge {

struct StoreOptions {
  int64_t capacity_bytes = int64_t{1} << 30;  ///< accounted-bytes budget; > 0
  int64_t chunk_tokens = 256;                 ///< tokens per chunk entry; > 0
  int num_shards = 16;                        ///< lock shards; in [1, 1024]
};

struct StoreStats {
  int64_t capacity_bytes = 0;
  int64_t bytes_used = 0;       ///< accounted bytes now (entries and recycled_bytes)
  int64_t recycled_bytes = 0;   ///< freed payload buffers kept for reuse (up to 4, >= 1 MiB each)
  int64_t peak_bytes = 0;       ///< highest bytes_used ever reached (never > capacity_bytes)
  int64_t entries = 0;          ///< chunk entries in the index
  int64_t puts = 0;             ///< put() calls
  int64_t chunks_inserted = 0;  ///< new entries created by put()
  int64_t chunks_present = 0;   ///< put() chunks already cached (refreshed, not copied)
  int64_t chunks_rejected = 0;  ///< put() chunks that found no room (everything else pinned)
  int64_t matches = 0;          ///< match() calls
  int64_t hits = 0;             ///< match() calls that returned >= 1 chunk
  int64_t misses = 0;           ///< match() calls that returned nothing
  int64_t hit_chunks = 0;       ///< chunks returned by match()
  int64_t collisions = 0;       ///< index hits rejected by the token / parent / salt check
  int64_t evictions = 0;        ///< entries evicted to make room
  int64_t erased = 0;           ///< entries removed by erase()
  static constexpr int64_t kEntryOverheadBytes = 128;  ///< fixed accounted bytes per entry
};

namespace detail {
struct ChunkEntry;
}

/// The result of KVStore::match: the longest cached prefix, pinned while this object lives.
/// Movable, not copyable. Thread-compatible (use one Match from one thread at a time).
class Match {
 public:
  Match() = default;
  Match(Match&&) noexcept = default;
  Match& operator=(Match&&) noexcept = default;
  Match(const Match&) = delete;
  Match& operator=(const Match&) = delete;
  ~Match();

  /// Length of the matched prefix in tokens: a multiple of chunk_tokens, 0 on a miss.
  int64_t tokens() const noexcept { return tokens_; }
  int64_t chunks() const noexcept { return static_cast<int64_t>(entries_.size()); }
  explicit operator bool() const noexcept { return tokens_ > 0; }

  /// Copies the matched prefix into `dst`, which must be a CPU view with the store entry's
  /// layers, kv_heads, head_dim and dtype, and exactly tokens() tokens.
  void copy_to(const KVView& dst) const;
  /// Copies tokens [begin, begin + dst.tokens()) of the matched prefix into `dst`.
  void copy_range_to(int64_t begin, const KVView& dst) const;

 private:
  friend class KVStore;
  std::vector<std::shared_ptr<const detail::ChunkEntry>> entries_;
  int64_t tokens_ = 0;
  int64_t chunk_tokens_ = 0;
};

class KVStore {
 public:
  /// Throws InvalidArgument for options out of range.
  explicit KVStore(const StoreOptions& options = {});
  ~KVStore();
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  const StoreOptions& options() const noexcept;

  /// Stores the whole chunks of `tokens` with their KV. `kv` is a CPU view matching `spec`
  /// (layers, kv_heads, head_dim, dtype) with kv.tokens() == tokens.size. Chunks already cached
  /// are refreshed, not copied again. Returns the length of the prefix now cached from this call
  /// (a multiple of chunk_tokens; shorter than requested when space ran out or on a collision).
  /// Throws InvalidArgument for bad tokens, a bad spec, or a view that does not match.
  int64_t put(const ModelSpec& spec, TokenSpan tokens, const KVView& kv,
              std::string_view ns = "default");

  /// The longest cached prefix of `tokens` for (spec, ns), pinned. A miss is an empty Match.
  /// Throws InvalidArgument for bad tokens or a bad spec.
  Match match(const ModelSpec& spec, TokenSpan tokens, std::string_view ns = "default");

  /// Removes the entries of the whole chunks of `tokens` for (spec, ns) from the index.
  /// Pinned entries leave the index at once and free their memory when unpinned.
  /// Returns the number of entries removed.
  int64_t erase(const ModelSpec& spec, TokenSpan tokens, std::string_view ns = "default");

  /// Removes every entry. Pinned memory is freed when unpinned.
  void clear();

  StoreStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
