// KVStore: a thread-safe, tiered cache of chunk KV blocks keyed by the prefix-hash index.
//
// A sequence's KV is stored as one entry per whole chunk of `chunk_tokens` tokens. Each entry
// keeps its chunk's token ids, its parent hash and the salt it was stored under, and a lookup
// compares all three in every tier, so neither a hash collision nor another namespace's or
// model's entry can ever be returned. A trailing partial chunk is never stored.
//
// Tiers (docs/storage.md has the full description and the on-disk / in-Redis formats):
//   memory  always on. Sharded, with a byte budget that is never exceeded.
//   disk    on when StoreOptions::disk_dir is set: one checksummed file per entry, written
//           atomically, with its own byte budget. Any number of stores, in any processes of
//           the machine, may have one directory open at once (each with its own memory tier):
//           each finds what the others wrote, and the budget holds for the directory as a
//           whole (docs/storage.md, "One directory, many processes").
//   Redis   on when StoreOptions::redis_url is set: one checksummed value per entry, shared by
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

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "kvbridge/prefix_hash.h"

namespace kvbridge {

/// Which entry a full tier drops first. The memory and disk tiers follow the same policy; Redis
/// evicts by its own server configuration (maxmemory-policy).
enum class EvictionPolicy : uint8_t {
  kLRU = 0,  ///< least recently used (put or matched) first
  kLFU = 1,  ///< fewest uses (puts and matches since it entered the tier) first, then LRU
  kTTL = 2,  ///< soonest to expire, i.e. oldest put first; needs ttl_seconds > 0
};

/// "lru", "lfu" or "ttl".
const char* eviction_policy_name(EvictionPolicy policy) noexcept;
/// The inverse of eviction_policy_name; throws InvalidArgument otherwise.
EvictionPolicy parse_eviction_policy(const std::string& name);

/// How the store keeps an entry's KV, in memory and in the disk and Redis tiers.
///   kNative  the entry's dtype, bit-exact; payload 2*L*T*H*D*sizeof(dtype) bytes.
///   kInt8    int8 codes with float32 scales: keys one scale per (layer, KV head, channel) over
///            the chunk's T tokens, values one per (layer, KV head, token) over the head dim D;
///            match() returns them dequantized to the entry's dtype. Payload
///            2*L*T*H*D + 4*L*H*(D + T) bytes: (1/2 + 1/T + 1/D) of the bfloat16 payload, e.g.
///            0.52 for T = 256, D = 64 (accounted bytes add 4*T + kEntryOverheadBytes to both).
///            Each element comes back within scale/2 of what was put (plus float32 and dtype
///            rounding). Keys live under their own chain (h_0 is derived from the native salt
///            and "int8"), so native and int8 stores sharing a directory or Redis never see
///            each other's entries. put() throws InvalidArgument for NaN or infinite KV.
enum class StorageFormat : uint8_t { kNative = 0, kInt8 = 1 };

/// "native" or "int8".
const char* storage_format_name(StorageFormat format) noexcept;
/// The inverse of storage_format_name; throws InvalidArgument otherwise.
StorageFormat parse_storage_format(const std::string& name);

/// Tier selectors for erase() and clear(), combinable with |.
enum StoreTier : unsigned { kMemoryTier = 1u, kDiskTier = 2u, kRedisTier = 4u };
constexpr unsigned kAllTiers = kMemoryTier | kDiskTier | kRedisTier;

/// Largest StoreOptions::ttl_seconds (about 100 years; keeps every time in ms far from overflow).
constexpr int64_t kMaxTtlSeconds = int64_t{100} * 366 * 24 * 3600;

struct StoreOptions {
  int64_t capacity_bytes = int64_t{1} << 30;  ///< memory tier's accounted-bytes budget; > 0
  int64_t chunk_tokens = 256;                 ///< tokens per chunk entry; in [1, 2^24]
  int num_shards = 16;                        ///< lock shards; in [1, 1024]
  EvictionPolicy eviction = EvictionPolicy::kLRU;
  /// Entries expire this many seconds after the put that created them, in every tier (an
  /// expired entry is a miss and is removed; Redis values also get this expiry). 0: never; at
  /// most kMaxTtlSeconds.
  int64_t ttl_seconds = 0;
  /// Entry storage (see StorageFormat); lossy int8 roughly halves the bytes of 16-bit KV.
  StorageFormat storage = StorageFormat::kNative;

  // --- Disk tier: off while disk_dir is empty. ---
  /// Directory for entry files (created if missing), on a local file system. Any number of
  /// stores (in this and other processes) may have it open at once; they share its files, its
  /// byte count and invalidate / erase / clear. Stores with a TTL record each entry's expiry in
  /// its file, which binds every store reading it.
  std::string disk_dir;
  /// Budget of the directory's entry files and writes in flight, whichever store made them
  /// (4 KiB blocks), checked by this store's writes: never exceeded. > 0
  int64_t disk_capacity_bytes = int64_t{16} << 30;
  bool disk_fsync = true;  ///< fsync each file before its rename (durable across power loss)

  // --- Redis tier: off while redis_url is empty. ---
  /// "redis://[[user]:password@]host[:port][/db]" (port 6379, db 0 by default).
  std::string redis_url;
  /// First component of every key; stores sharing a prefix (and server) share entries.
  std::string redis_key_prefix = "kvb";
  int redis_connect_timeout_ms = 200;  ///< TCP connect (and AUTH / SELECT) timeout; > 0
  /// Longest wait for one socket read or write of a command; a value still streaming in does
  /// not time out. A command that times out is a miss (or a skipped write). > 0.
  int redis_command_timeout_ms = 500;
  int redis_pool_size = 4;  ///< connections kept; a caller waits when all are busy; >= 1
  /// After a failure the tier is skipped (ops are instant misses, counted) until a retry is
  /// due; the wait doubles from redis_retry_min_ms to redis_retry_max_ms while retries fail.
  int redis_retry_min_ms = 100;
  int redis_retry_max_ms = 5000;
  /// Upper bound on the value bytes one MGET fetches; match() reads a prefix's chunks in as
  /// few round trips as this allows (at least one chunk per round trip).
  int64_t redis_batch_bytes = int64_t{64} << 20;

  // --- Redis filter (a Bloom filter kept in Redis, see docs/storage.md). ---
  /// Answer sure misses from a local copy of the shared filter, without a round trip.
  bool redis_filter = true;
  /// Size in bits of the filter when this store creates it (a power of two in [2^10, 2^32]);
  /// a filter that exists keeps its own size and hash count.
  int64_t redis_filter_bits = int64_t{1} << 23;
  int redis_filter_hashes = 4;  ///< probes per key when this store creates it; in [1, 16]
  /// The local copy is refreshed this often; it is never staler than this plus one refresh
  /// round trip, so another process's put is seen at most that long after it returned. > 0.
  int redis_filter_refresh_ms = 1000;

  /// Clock for TTLs and entry creation times, in milliseconds since the Unix epoch. Empty: the
  /// system clock. (Settable so tests can move time.)
  std::function<int64_t()> clock_ms;
};

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
/// Where a stored chunk's KV came from; recorded with the entry in every tier
/// (docs/storage.md). Both fields empty: the model's own KV. Otherwise both are 32 lowercase hex
/// digits: ModelSpec::fingerprint() of the model whose cache was converted, and
/// LinearAdapter::fingerprint() of the adapter that converted it (Bridge write-back).
struct Provenance {
  std::string source_fingerprint;
  std::string adapter_fingerprint;
  bool converted() const noexcept { return !adapter_fingerprint.empty(); }
};

struct InvalidateResult {
  int64_t memory = 0;
  int64_t disk = 0;
  int64_t redis = 0;
  bool redis_complete = true;  ///< false: Redis was unreachable or failed part way
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

  /// Where chunk `chunk` (0 <= chunk < chunks()) came from. Throws InvalidArgument otherwise.
  Provenance provenance(int64_t chunk) const;
  /// The provenance of the first chunk that is not the model's own prefill (converted through
  /// an adapter, or computed over such a prefix); empty when every chunk is the model's own.
  /// KV computed after this prefix derives from it and should be stored with this provenance.
  Provenance converted_provenance() const;

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

/// The result of KVStore::match_length: what Match::tokens() and Match::converted_provenance()
/// of the same match() would say, without the KV.
struct MatchLength {
  int64_t tokens = 0;
  Provenance converted_provenance;
};

class KVStore {
 public:
  /// Throws InvalidArgument for options out of range (or a malformed redis_url), Unavailable
  /// when disk_dir cannot be created, or its open lock stays held for a minute (a store of an
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
