// KVStore: a thread-safe, tiered cache of chunk KV blocks keyed by the prefix-hash index.
//
// A sequence's KV is stored as one entry per whole chunk of `chunk_tokens` tokens. Each entry
// keeps its chunk's token ids, its parent hash and the salt it was stored under, and a lookup
// compares all three in every tier, so neither a hash collision nor another namespace's or
// model's entry can ever be returned. A trailing partial chunk is never stored.
//
// Tiers (docs/storage.md has the full description and the on-disk / in-Redis formats):
//   memory  always on. Sharded, with a byte budget that is never exceeded.
//   disk    on when StoreOptions::disk.dir is set: one checksummed file per entry, written
//           atomically, with its own byte budget. Any number of stores, in any processes of
//           the machine, may have one directory open at once (each with its own memory tier):
//           each finds what the others wrote, and the budget holds for the directory as a
//           whole (docs/storage.md, "One directory, many processes").
//   Redis   on when StoreOptions::redis.url is set: one checksummed value per entry, shared by
//           every process and machine using the same server and key prefix.
// put() writes through: each chunk goes to memory, then (synchronously, before put returns) to
// the disk tier and the Redis tier. match() walks the chunks in order and looks each one up in
// memory, then disk, then Redis; a chunk found in a lower tier is verified and promoted to
// memory. A lower tier that fails (I/O error, full disk, Redis down or slow) is a miss or a
// skipped write, counted in stats(); it never throws into put() or match().
//
// Memory: `capacity_bytes` bounds the accounted bytes (the stored payload's allocation, see
// StorageFormat, rounded up to 64 bytes, or to 2 MiB for payloads of 32 MiB and more, + 4 bytes
// per token id + a fixed per-entry overhead, see StoreStats) at every instant; space is
// reserved before an entry is allocated and released when its memory is freed. Eviction
// follows StoreOptions::eviction within a shard, shards taken round robin (exact with
// num_shards = 1). Up to four freed payloads of 1 MiB or more are kept (and stay accounted)
// for reuse by the next entry of the same size; they are freed first when room is needed. An
// entry referenced by a live Match is pinned: it is never evicted, and its bytes stay
// accounted until the last Match holding it is destroyed. Entries evicted from memory stay in
// the lower tiers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "kvbridge/prefix_hash.h"
#include "kvbridge/provenance.h"
#include "kvbridge/store_match.h"
#include "kvbridge/store_options.h"
#include "kvbridge/store_stats.h"

namespace kvbridge {

/// One tier a store can have, as the API names it.
struct StoreTierInfo {
  const char* name;              ///< "memory", "disk", "redis": its `tier` label, Python name
  StoreTier bit;                 ///< its bit in erase()'s and clear()'s masks
  TierStats StoreStats::*stats;  ///< its section of StoreStats
};
/// Every tier a store can have, configured or not: memory, then the lower tiers in the order
/// match() walks them. stats(), metrics_text(), erase(), clear() and the Python names of the
/// tiers all follow this list.
const std::vector<StoreTierInfo>& store_tiers();

class KVStore {
 public:
  /// Throws InvalidArgument for options out of range (or a malformed redis.url), Unavailable
  /// when disk.dir cannot be created, or its open lock stays held for a minute (a store of an
  /// older kvbridge, which kept it for its lifetime). An unreachable Redis
  /// server is not an error: the tier starts marked down and is retried.
  explicit KVStore(const StoreOptions& options = {});
  ~KVStore();
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  const StoreOptions& options() const noexcept;

  /// Stores the whole chunks of `tokens` with their KV. `kv` is a CPU view matching `spec`
  /// (layers, kv_heads, head_dim, dtype) with kv.tokens() == tokens.size. Chunks already in
  /// memory are refreshed, not copied again (and written to disk if the disk tier lacks them).
  /// Returns the length of the prefix now cached from this call in at least one tier (a
  /// multiple of chunk_tokens; shorter than requested when no tier took a chunk, or on a
  /// collision). Throws InvalidArgument for bad tokens, a bad spec, or a view that does not
  /// match; never for a failing disk or Redis tier.
  /// `provenance` is recorded with the chunks this call creates (chunks already stored keep
  /// theirs); InvalidArgument unless both its fields are empty or both are fingerprints.
  /// A chunk already in memory is also sent to Redis when this store has not seen it stored
  /// there since the tier last failed (so chunks put during an outage reach Redis with the
  /// next put of their prefix).
  int64_t put(const ModelSpec& spec, TokenSpan tokens, const KVView& kv,
              std::string_view ns = "default", const Provenance& provenance = {});

  /// The longest cached prefix of `tokens` for (spec, ns), pinned. A miss is an empty Match.
  /// Throws InvalidArgument for bad tokens or a bad spec; never for a failing disk or Redis tier.
  Match match(const ModelSpec& spec, TokenSpan tokens, std::string_view ns = "default");
  /// match() for a caller that only wants the prefix's length (and provenance): the same
  /// lookups and effects (uses recorded, lower-tier hits promoted into memory, counters), but
  /// nothing is pinned, which saves a reference taken and dropped per chunk.
  MatchLength match_length(const ModelSpec& spec, TokenSpan tokens,
                           std::string_view ns = "default");

  /// Removes the entries of the whole chunks of `tokens` for (spec, ns) from the selected tiers
  /// (StoreTier bits). Pinned entries leave the index at once and free their memory when
  /// unpinned. Returns the number of memory and disk entries removed (Redis deletions are not
  /// counted: the server does not say whose they were).
  int64_t erase(const ModelSpec& spec, TokenSpan tokens, std::string_view ns = "default",
                unsigned tiers = kAllTiers);

  /// Removes every entry of `spec`'s fingerprint, in every namespace, from every tier: this
  /// store's memory, the disk directory and the Redis prefix (a SCAN of the server's keys),
  /// whichever store wrote them. Other stores' memory tiers keep their copies until evicted
  /// (docs/storage.md).
  InvalidateResult invalidate(const ModelSpec& spec);

  /// Removes every entry of `target`'s fingerprint whose provenance names the adapter
  /// (LinearAdapter::fingerprint(), 32 lowercase hex digits; InvalidArgument otherwise), in
  /// every namespace and tier: memory, disk (each of the model's files has its header read) and
  /// Redis (SCAN of the model's keys, a server-side check of each value's header). The model's
  /// own entries and other adapters' stay.
  InvalidateResult invalidate_adapter(const ModelSpec& target,
                                      std::string_view adapter_fingerprint);

  /// Removes every entry of the selected tiers. The default leaves the Redis tier alone: it is
  /// shared with other processes (clear it per model with invalidate()).
  void clear(unsigned tiers = kMemoryTier | kDiskTier);

  StoreStats stats() const;

  /// stats() in the Prometheus text exposition format (version 0.0.4), every name prefixed
  /// kvbridge_store_, tiers as a `tier` label.
  std::string metrics_text() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
