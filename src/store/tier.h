// The store's lower tiers (disk, Redis): the LowerTier interface KVStore walks, their counters,
// and the lookups it makes of them (a run of chunks, each the entry it requires).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kvbridge/kv_store.h"
#include "src/store/entry_codec.h"

namespace kvbridge::detail {

#define KVBRIDGE_STATS_ATOMIC_(type, member, metric, kind, help) std::atomic<int64_t> member{0};
#define KVBRIDGE_STATS_LOAD_(type, member, metric, kind, help) \
  s->member = member.load(std::memory_order_relaxed);

/// TierStats' counted fields (KVBRIDGE_TIER_COUNTERS), as atomics.
struct TierCounters {
  KVBRIDGE_TIER_COUNTERS(KVBRIDGE_STATS_ATOMIC_)

  static void add(std::atomic<int64_t>& c, int64_t n = 1) {
    c.fetch_add(n, std::memory_order_relaxed);
  }
  void fill(TierStats* s) const { KVBRIDGE_TIER_COUNTERS(KVBRIDGE_STATS_LOAD_) }
};

/// The most lower tiers a store may have (each keeps a word in every memory entry): the disk and
/// Redis tiers, and room for two more.
constexpr size_t kMaxLowerTiers = 4;

/// What a verified hit reports besides its payload.
struct LoadedMeta {
  int64_t created_ms = 0;
  EntryProvenance provenance;
  /// The loading tier's mark for the new memory entry (ChunkEntry::tier_marks); -1: none.
  int64_t mark = -1;
  static LoadedMeta of(const EntryHeader& h) { return {h.created_ms, h.provenance, -1}; }
};

enum class LoadResult {
  kHit,        // payload filled, verified
  kMiss,       // absent, expired, corrupt or unreadable (each counted by the tier)
  kCollision,  // a valid entry for this key, but of other tokens / parent / salt
  kNoRoom,     // the tier has the entry, but memory has no room for it (the store counts it)
};

/// Counts what verify_entry found (anything but kUnreadable, which each tier counts by its
/// cause) and gives the lookup's result: a collision and each reason for a miss count a miss;
/// corrupt and expired entries also count by reason; every entry read whole whose checksum held
/// adds its `total_bytes` to bytes_read.
inline LoadResult count_check(EntryCheck r, size_t total_bytes, TierCounters& c) {
  if (r != EntryCheck::kCorrupt) TierCounters::add(c.bytes_read, static_cast<int64_t>(total_bytes));
  if (r == EntryCheck::kValid) return LoadResult::kHit;
  TierCounters::add(c.misses);
  if (r == EntryCheck::kOtherChunk) return LoadResult::kCollision;
  TierCounters::add(r == EntryCheck::kExpired ? c.expired : c.corrupt);
  return LoadResult::kMiss;
}

struct ChunkEntry;    // memory_tier.h (which includes this header)
class PayloadPool;    // memory_tier.h

/// One lookup the store makes of a tier: a run of chunks [first, first + run.size()) of one
/// match() call's chain, each described by the entry it must be (run[i].key is its key). The
/// store cuts the run: it starts at a chunk memory and every tier walked before this one
/// missed, and stops before the first chunk that memory or such a tier holds, that the tier's
/// may_hold() rules out, or at the tier's read_ahead_chunks(). Empty: may_hold() ruled out
/// chunk `first` itself. The batch, its payload buffers (PayloadPool) and the answers are the
/// store's; a tier keeps nothing of them after lookup() returns. The store uses each answer
/// when its walk reaches the chunk (a read-ahead's later chunks after the earlier ones' hits).
struct LookupBatch {
  std::string_view ns;
  Fingerprint fp{};
  size_t first = 0;
  std::vector<ExpectedEntry> run;
};

/// A tier's answer for one chunk of a run; meta is set on kHit.
struct LookupAnswer {
  LoadResult result = LoadResult::kMiss;
  LoadedMeta meta;
};

/// The encoded header + tokens and the checksum of a chunk, made once for every tier it goes to.
struct PackedEntry {
  std::vector<unsigned char> prefix;
  Hash128 checksum;
};

/// A tier below memory (disk, Redis). KVStore keeps them in the order it walks them
/// (tier_table.h, which also names them): a lookup asks each in turn until one has the chunk;
/// a put offers each chunk to every tier that wants it. Calls run one way: the store asks, a
/// tier answers from what the call hands it and never calls back into the store.
/// docs/architecture.md says what a new tier needs besides this class.
class LowerTier {
 public:
  virtual ~LowerTier() = default;

  /// The tier's index in the store's walk, given when the store adds it (< kMaxLowerTiers): its
  /// word in each memory entry is ChunkEntry::tier_marks[slot()].
  size_t slot() const noexcept { return slot_; }
  void set_slot(size_t slot) noexcept { slot_ = slot; }

  /// Writes its section of the stats, `own` (counters and gauges; the store sets `enabled`),
  /// and any stats of its own beyond TierStats in *all (Redis: RemoteStats).
  virtual void fill(TierStats* own, StoreStats* all) const = 0;

  /// Whether the tier holds fp's entry of key, as far as it can tell without a round trip
  /// (a remote tier answers false).
  virtual bool contains(const Hash128& key, const Fingerprint& fp) = 0;

  /// The longest run one lookup() reads (for chunks of geometry g): 1 reads chunk by chunk;
  /// more reads ahead in one round trip.
  virtual size_t read_ahead_chunks(const ChunkGeometry& g) const = 0;
  /// False when the tier is sure it does not hold key, without I/O and without counting (a
  /// filter); the store stops a run before such a chunk.
  virtual bool may_hold(const Hash128& key) const = 0;
  /// Answers the run's chunks in order into *answers (empty when called): one per chunk it
  /// tried, at least the first unless the run is empty; it may stop early (after a non-hit).
  /// Chunk i's payload goes to payloads.get(i) (null: memory has no room, answer kNoRoom); a
  /// buffer it did not fill with a hit it may hand back with payloads.discard(i). Counts what
  /// it found (misses, corrupt and expired entries, bytes read; an empty run as one miss), but
  /// not the hits: served() does once the store has the entry. Never throws.
  virtual void lookup(const LookupBatch& batch, PayloadPool& payloads,
                      std::vector<LookupAnswer>* answers) = 0;
  /// The store served one of the tier's kHit answers from memory (promoted, or already there
  /// by then): the tier's hit_chunks.
  void served() { TierCounters::add(counters_.hit_chunks); }

  /// The write policy: whether a put should write fp's chunk `key` here. `pinned` is the chunk's
  /// memory entry, null when memory had no room.
  virtual bool wants(const Hash128& key, const Fingerprint& fp, const ChunkEntry* pinned) = 0;
  /// 0: store() is called for each chunk as the put reaches it; otherwise the put gathers
  /// writes until their bytes reach this, and once at its end.
  virtual size_t batch_bytes() const = 0;
  struct ChunkWrite {
    Hash128 key;
    const PackedEntry* packed;
    std::shared_ptr<const ChunkEntry> entry;  // the payload, creation time and provenance
  };
  /// Writes the batch; sets (*stored)[i] (sized to the batch) when write i is in the tier.
  /// Counts its failures; never throws.
  virtual void store(std::string_view ns, const Fingerprint& fp,
                     const std::vector<ChunkWrite>& batch, std::vector<char>* stored) = 0;

  /// Removes ns's entries of `keys` (fp's); returns how many it knows it removed.
  virtual int64_t erase(std::string_view ns, const Fingerprint& fp,
                        const std::vector<Hash128>& keys) = 0;
  /// Remove every entry of the model fingerprint (of any namespace, whichever store wrote it),
  /// or only those whose provenance names `adapter`; each sets its own fields of *r.
  virtual void invalidate(const Fingerprint& fp, InvalidateResult* r) = 0;
  virtual void invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter,
                                  InvalidateResult* r) = 0;
  /// Removes every entry; returns how many it removed.
  virtual int64_t clear() = 0;

 protected:
  TierCounters counters_;  // the tier's own: it counts all but hit_chunks (served())

 private:
  size_t slot_ = 0;
};

}  // namespace kvbridge::detail
