// The Redis tier, through hiredis: one packed entry (entry_codec.h) per key
//   <prefix>:v1:<namespace, percent-encoded>:<fingerprint>:<chunk key hex>
// plus the shared Bloom filter <prefix>:v1:filter (docs/storage.md). Connections come from a
// pool (redis_pool.h: timeouts; after a failure the tier is marked down and every operation is
// an instant, counted miss until a retry with exponential backoff reconnects); writes are RESP
// written straight into the connection's buffer (redis_resp.h); the filter's format and local
// copy are redis_filter.h; the URL is parsed by redis_url.h. A background thread refreshes the
// local filter copy and rebuilds the shared filter when it is missing. Thread-safe; no method
// throws but the constructor.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "src/store/tier.h"

namespace kvbridge::detail {

/// Counters of the remote side (RemoteStats without the filter state).
struct RemoteCounters {
  KVBRIDGE_REMOTE_COUNTERS(KVBRIDGE_STATS_ATOMIC_)
  std::atomic<int64_t> latency_ns_sum{0};
  std::array<std::atomic<int64_t>, RemoteStats::kLatencyBuckets> latency_buckets{};
  void record_latency(int64_t ns);
  void fill(RemoteStats* s) const;
};

/// Sees one present value of a fetch where hiredis parsed it (`data` is valid only during the
/// call, and the value is never copied into a reply object): index into the keys, bytes. Must
/// not throw (it runs inside hiredis's parser; an exception is swallowed, the value then counts
/// as absent).
using RedisValueConsumer =
    std::function<void(size_t index, const unsigned char* data, size_t size)>;

/// Verifies a fetched value against the lookup and copies its payload (want.payload_bytes) to
/// `payload`; on kHit sets *meta. Counts misses, corrupt and expired values in `counters`;
/// *drop says the value should be deleted from the server (corrupt or expired).
LoadResult load_value(const unsigned char* data, size_t size, const ExpectedEntry& want,
                      char* payload, LoadedMeta* meta, TierCounters* counters, bool* drop);

class RedisTier final : public LowerTier {
 public:
  /// Throws InvalidArgument for a malformed URL. Never connects in the constructor's thread for
  /// longer than RedisOptions::connect_timeout_ms; an unreachable server leaves the tier marked
  /// down.
  explicit RedisTier(const StoreOptions& options);
  ~RedisTier() override;
  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  // --- LowerTier ------------------------------------------------------------------------------

  /// Its counters, and the remote section of *all.
  void fill(TierStats* own, StoreStats* all) const override;
  /// False: telling would take a round trip.
  bool contains(const Hash128&, const Fingerprint&) override { return false; }
  /// The values of about RedisOptions::batch_bytes (at least 1, at most 1024): one MGET's worth.
  size_t read_ahead_chunks(const ChunkGeometry& g) const override;
  /// may_contain().
  bool may_hold(const Hash128& key) const override { return may_contain(key); }
  /// Fetches the run in one MGET, each value verified into payloads.get(i) while hiredis
  /// parses it; answers its hits in order up to and including the first chunk that is not
  /// one. An empty run is a filter negative (and a miss).
  void lookup(const LookupBatch& batch, PayloadPool& payloads,
              std::vector<LookupAnswer>* answers) override;
  /// A put sends every chunk the server is not known to hold: new ones, and ones put or read
  /// while it was down or before it last failed (its mark in the memory entry != epoch()), so an
  /// outage is repaired by the next put.
  bool wants(const Hash128& key, const Fingerprint& fp, const ChunkEntry* pinned) override;
  /// RedisOptions::batch_bytes: a put's writes go in pipelines of about that many bytes.
  size_t batch_bytes() const override;
  /// write_values() of the batch; a success records epoch() (read before) as each entry's mark
  /// (ChunkEntry::tier_marks).
  void store(std::string_view ns, const Fingerprint& fp, const std::vector<ChunkWrite>& batch,
             std::vector<char>* stored) override;
  /// UNLINKs the keys' values (one round trip); returns 0 (the server's count is not asked for).
  int64_t erase(std::string_view ns, const Fingerprint& fp,
                const std::vector<Hash128>& keys) override;
  /// Deletes every key of the fingerprint under the prefix (SCAN + UNLINK) into r->redis and
  /// r->redis_complete.
  void invalidate(const Fingerprint& fp, InvalidateResult* r) override;
  /// The same for the keys whose value's provenance names `adapter`.
  void invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter,
                          InvalidateResult* r) override;
  /// Deletes every key under the prefix (entries of every tenant and model, and the filter).
  int64_t clear() override;

  // --- The Redis tier's own -------------------------------------------------------------------

  std::string key_for(std::string_view ns, const Fingerprint& fp, const Hash128& key) const;

  /// False only when the filter is active and says the key is surely absent.
  bool may_contain(const Hash128& key) const;

  using ValueConsumer = RedisValueConsumer;
  /// GETs `keys` in one MGET, handing each present value to `consume`. False (counted) when the
  /// tier is down or the command failed; then every key counts as a miss.
  bool fetch(const std::vector<std::string>& keys, const ValueConsumer& consume);

  struct Write {
    std::string key;
    Hash128 hash;  // the chunk key, for the filter
    const unsigned char* prefix;
    size_t prefix_bytes;
    const void* payload;
    size_t payload_bytes;
    Hash128 checksum;
  };
  /// SETs every value (with PX of the store's TTL when it has one) and their filter bits in one
  /// pipeline. Returns false (counted) when any command failed.
  bool write_values(const std::vector<Write>& writes);

  /// DELs keys (one round trip); false when it failed.
  bool remove(const std::vector<std::string>& keys);

  /// Counts the times the tier was marked down. A value written while epoch() was e is known to
  /// be on the server only while epoch() is still e: a failure may mean a restarted, emptied
  /// server (the store re-sends such chunks on their next put).
  int64_t epoch() const;

  /// Whether a usable filter copy is in use.
  bool filter_active() const;
  /// Refreshes the filter copy now (the background thread does it every refresh interval).
  void refresh_filter_now();

 private:
  struct Impl;

  RemoteCounters remote_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge::detail
