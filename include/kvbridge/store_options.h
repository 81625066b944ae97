// StoreOptions: a KVStore's settings, with the disk and Redis tiers' own in DiskOptions and
// RedisOptions (a tier is on when its location, DiskOptions::dir or RedisOptions::url, is set).
// kv_store.h describes what the store does with them; docs/storage.md the tiers in full.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

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

/// The disk tier's settings; the tier is off while `dir` is empty.
struct DiskOptions {
  /// Directory for entry files (created if missing), on a local file system. Any number of
  /// stores (in this and other processes) may have it open at once; they share its files, its
  /// byte count and invalidate / erase / clear. Stores with a TTL record each entry's expiry in
  /// its file, which binds every store reading it.
  std::string dir;
  /// Budget of the directory's entry files and writes in flight, whichever store made them
  /// (4 KiB blocks), checked by this store's writes: never exceeded. > 0
  int64_t capacity_bytes = int64_t{16} << 30;
  bool fsync = true;  ///< fsync each file before its rename (durable across power loss)

  bool enabled() const noexcept { return !dir.empty(); }
};

/// The Redis tier's settings; the tier is off while `url` is empty.
struct RedisOptions {
  /// "redis://[[user]:password@]host[:port][/db]" (port 6379, db 0 by default).
  std::string url;
  /// First component of every key; stores sharing a prefix (and server) share entries.
  std::string key_prefix = "kvb";
  int connect_timeout_ms = 200;  ///< TCP connect (and AUTH / SELECT) timeout; > 0
  /// Longest wait for one socket read or write of a command; a value still streaming in does
  /// not time out. A command that times out is a miss (or a skipped write). > 0.
  int command_timeout_ms = 500;
  int pool_size = 4;  ///< connections kept; a caller waits when all are busy; >= 1
  /// After a failure the tier is skipped (ops are instant misses, counted) until a retry is
  /// due; the wait doubles from retry_min_ms to retry_max_ms while retries fail.
  int retry_min_ms = 100;
  int retry_max_ms = 5000;
  /// Upper bound on the value bytes one MGET fetches; match() reads a prefix's chunks in as
  /// few round trips as this allows (at least one chunk per round trip).
  int64_t batch_bytes = int64_t{64} << 20;

  // The filter: a Bloom filter kept in Redis (docs/storage.md).
  /// Answer sure misses from a local copy of the shared filter, without a round trip.
  bool filter = true;
  /// Size in bits of the filter when this store creates it (a power of two in [2^10, 2^32]);
  /// a filter that exists keeps its own size and hash count.
  int64_t filter_bits = int64_t{1} << 23;
  int filter_hashes = 4;  ///< probes per key when this store creates it; in [1, 16]
  /// The local copy is refreshed this often; it is never staler than this plus one refresh
  /// round trip, so another process's put is seen at most that long after it returned. > 0.
  int filter_refresh_ms = 1000;

  bool enabled() const noexcept { return !url.empty(); }
};

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

  DiskOptions disk;    ///< the disk tier: off while disk.dir is empty
  RedisOptions redis;  ///< the Redis tier: off while redis.url is empty

  /// Clock for TTLs and entry creation times, in milliseconds since the Unix epoch. Empty: the
  /// system clock. (Settable so tests can move time.)
  std::function<int64_t()> clock_ms;
};

}  // namespace kvbridge
