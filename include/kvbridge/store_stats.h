// The store's statistics (KVStore::stats()): StoreStats with a TierStats per tier and the Redis
// tier's RemoteStats, each described once by a field table.
#pragma once

#include <array>
#include <cstdint>

namespace kvbridge {

// --- Stats -------------------------------------------------------------------------------------
// Each stats struct is described once, by the field tables below: one row per field,
//   X(type, member, metric, kind, help)
// `metric` is the field's Prometheus name (after the kvbridge_store_ prefix; "" when the field is
// not exported on its own), `kind` counter, gauge or none, `help` its meaning. The tables produce
// the structs, the counters behind stats(), the Python dicts (KVStore.stats()) and
// metrics_text(). A new counter is one row (docs/architecture.md).

/// TierStats, set from the tier's state. Chunk counts are entries (one per chunk_tokens tokens).
#define KVBRIDGE_TIER_GAUGES(X)                                                                   \
  X(bool, enabled, "tier_enabled", gauge, "1 when the tier is configured.")                      \
  X(int64_t, capacity_bytes, "capacity_bytes", gauge,                                            \
    "Byte budget of the tier (0: none of its own).")                                             \
  X(int64_t, bytes_used, "bytes", gauge,                                                         \
    "Bytes the tier holds (memory: accounted; disk: file blocks).")                             \
  X(int64_t, entries, "entries", gauge, "Chunk entries the tier indexes.")
/// TierStats, counted by the tier.
#define KVBRIDGE_TIER_COUNTERS(X)                                                                 \
  X(int64_t, hit_chunks, "hits_total", counter, "Chunks served to match() by the tier.")         \
  X(int64_t, misses, "misses_total", counter,                                                    \
    "Chunk lookups that reached the tier and found nothing.")                                    \
  X(int64_t, writes, "writes_total", counter, "Entries written to the tier.")                    \
  X(int64_t, write_failures, "write_failures_total", counter,                                    \
    "Writes that failed or were skipped.")                                                       \
  X(int64_t, evictions, "evictions_total", counter, "Entries evicted to make room.")             \
  X(int64_t, expired, "expired_total", counter, "Entries found past their TTL.")                 \
  X(int64_t, corrupt, "corrupt_total", counter, "Entries that failed validation.")               \
  X(int64_t, errors, "errors_total", counter, "I/O or remote errors.")                           \
  X(int64_t, bytes_read, "read_bytes_total", counter, "Entry bytes read from the tier.")         \
  X(int64_t, bytes_written, "written_bytes_total", counter, "Entry bytes written to the tier.")

/// RemoteStats (Redis round trips and the filter), counted by the Redis tier.
#define KVBRIDGE_REMOTE_COUNTERS(X)                                                               \
  X(int64_t, round_trips, "remote_round_trips_total", counter,                                   \
    "Redis commands or pipelines answered.")                                                     \
  X(int64_t, skipped, "remote_skipped_total", counter,                                           \
    "Redis operations skipped while it was marked down.")                                        \
  X(int64_t, reconnects, "remote_reconnects_total", counter,                                     \
    "Reconnects to Redis after a failure.")                                                      \
  X(int64_t, filter_negatives, "filter_negatives_total", counter,                                \
    "Lookups the filter answered as sure misses.")                                               \
  X(int64_t, filter_passes, "filter_passes_total", counter, "Lookups the filter let through.")   \
  X(int64_t, filter_false_positives, "filter_false_positives_total", counter,                    \
    "Lookups let through that found nothing.")                                                   \
  X(int64_t, filter_refreshes, "filter_refreshes_total", counter, "Filter copies fetched.")      \
  X(int64_t, filter_rebuilds, "filter_rebuilds_total", counter, "Filters rebuilt from the keys.")
/// RemoteStats, set from the tier's state (the latency histogram follows the struct).
#define KVBRIDGE_REMOTE_GAUGES(X)                                                                 \
  X(bool, filter_active, "filter_active", gauge, "1 while a usable filter copy is in use.")      \
  X(double, latency_seconds_sum, "", none, "Total time of answered Redis round trips.")

/// StoreStats, set from the memory tier's state (evictions: the memory tier's counter).
/// metrics_text() writes the store's counters, then these, then the remote ones.
#define KVBRIDGE_STORE_GAUGES(X)                                                                  \
  X(int64_t, capacity_bytes, "", none, "Memory tier budget.")                                    \
  X(int64_t, bytes_used, "", none,                                                               \
    "Accounted memory bytes now (entries and recycled_bytes).")                                  \
  X(int64_t, peak_bytes, "peak_bytes", gauge, "Highest accounted memory bytes reached.")         \
  X(int64_t, recycled_bytes, "recycled_bytes", gauge, "Freed payload buffers kept for reuse.")   \
  X(int64_t, entries, "", none, "Chunk entries in the memory index.")                            \
  X(int64_t, evictions, "", none, "Memory entries evicted to make room.")
/// StoreStats, counted by the store.
#define KVBRIDGE_STORE_COUNTERS(X)                                                                \
  X(int64_t, puts, "puts_total", counter, "put() calls.")                                        \
  X(int64_t, chunks_inserted, "", none, "New memory entries created by put().")                  \
  X(int64_t, chunks_present, "", none,                                                           \
    "put() chunks already in memory (refreshed, not copied).")                                   \
  X(int64_t, matches, "matches_total", counter, "match() calls.")                                \
  X(int64_t, hits, "match_hits_total", counter, "match() calls that returned at least one chunk.") \
  X(int64_t, misses, "match_misses_total", counter, "match() calls that returned nothing.")      \
  X(int64_t, hit_chunks, "hit_chunks_total", counter, "Chunks returned by match(), from any tier.") \
  X(int64_t, collisions, "collisions_total", counter,                                            \
    "Entries rejected by the token, parent or salt check.")                                      \
  X(int64_t, chunks_rejected, "chunks_rejected_total", counter, "put() chunks that no tier took.") \
  X(int64_t, erased, "", none, "Memory entries removed by erase(), clear(), invalidate().")      \
  X(int64_t, promotions, "promotions_total", counter,                                            \
    "Chunks copied into memory from a lower tier.")                                              \
  X(int64_t, promotions_rejected, "promotions_rejected_total", counter,                          \
    "Lower-tier hits dropped for lack of memory.")

#define KVBRIDGE_STATS_MEMBER_(type, member, metric, kind, help) type member{};

/// Counters of one tier (KVBRIDGE_TIER_GAUGES, KVBRIDGE_TIER_COUNTERS).
struct TierStats {
  KVBRIDGE_TIER_GAUGES(KVBRIDGE_STATS_MEMBER_)
  KVBRIDGE_TIER_COUNTERS(KVBRIDGE_STATS_MEMBER_)
};

/// Redis round trips, their latency, and the filter (KVBRIDGE_REMOTE_COUNTERS,
/// KVBRIDGE_REMOTE_GAUGES, and the latency histogram).
struct RemoteStats {
  KVBRIDGE_REMOTE_COUNTERS(KVBRIDGE_STATS_MEMBER_)
  KVBRIDGE_REMOTE_GAUGES(KVBRIDGE_STATS_MEMBER_)
  /// Round trips by latency: count with latency <= kLatencyBounds[i] seconds; the last slot
  /// counts every round trip (+Inf).
  static constexpr int kLatencyBuckets = 12;
  static constexpr std::array<double, kLatencyBuckets - 1> kLatencyBounds = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5};
  std::array<int64_t, kLatencyBuckets> latency_buckets{};  ///< cumulative, as Prometheus's
};

/// The store's counters (KVBRIDGE_STORE_GAUGES, KVBRIDGE_STORE_COUNTERS) and each tier's.
/// peak_bytes is never above capacity_bytes; recycled_bytes holds up to 4 buffers of >= 1 MiB.
struct StoreStats {
  KVBRIDGE_STORE_GAUGES(KVBRIDGE_STATS_MEMBER_)
  KVBRIDGE_STORE_COUNTERS(KVBRIDGE_STATS_MEMBER_)
  TierStats memory, disk, redis;
  RemoteStats remote;
  static constexpr int64_t kEntryOverheadBytes = 128;  ///< fixed accounted bytes per entry
};

/// Entries removed by KVStore::invalidate, per tier.
struct InvalidateResult {
  int64_t memory = 0;
  int64_t disk = 0;
  int64_t redis = 0;
  bool redis_complete = true;  ///< false: Redis was unreachable or failed part way
};

}  // namespace kvbridge
