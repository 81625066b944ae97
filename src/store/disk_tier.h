// The disk tier: one packed entry file per chunk (entry_codec.h) under
//   <DiskOptions::dir>/kvbridge-v1/<fingerprint>/<first two hex digits of the key>/<key hex>.kvb
// written as a temporary file beside it, fsynced (optionally) and published with a rename
// that never replaces a file (src/core/atomic_file.h), so a reader sees a whole file or none.
// Any number of stores, in any processes, may have one directory open: the files are the
// truth, each store keeps an index of the files it knows (built by one scan at open, grown by
// its writes and by files it finds that other stores wrote), and the byte budget is kept on a
// count shared through a mapped file (kvbridge-v1/USAGE). Thread-safe. docs/storage.md
// describes the layout, the cross-process protocol, costs and failure handling.
//
// The parts, one job each: disk_layout.h (the tree, file names and ages), disk_usage.h (the
// shared count and the stores' leases), disk_index.h (the files this store knows, in eviction
// order); DiskTier's own files: disk_tier.cpp (opening, the LowerTier calls), disk_io.cpp
// (reading and writing entry files), disk_eviction.cpp (the budget, removal and quarantine).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "src/store/tier.h"

namespace kvbridge::detail {

class DiskTier final : public LowerTier {
 public:
  /// Opens (creating if needed) the directory and scans it. Throws Unavailable when it cannot be
  /// created, or its open lock stays held for more than a minute.
  DiskTier(const StoreOptions& options, std::function<int64_t()> clock);
  ~DiskTier() override;
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // --- LowerTier ------------------------------------------------------------------------------

  /// Its counters, budget, bytes used and entries.
  void fill(TierStats* own, StoreStats* all) const override;

  /// Whether fp's file of key exists and has not expired (an expired one is removed). Answers
  /// from the index, else with one stat (another store may have written it).
  bool contains(const Hash128& key, const Fingerprint& fp) override;
  /// 1: files are read one at a time.
  size_t read_ahead_chunks(const ChunkGeometry&) const override { return 1; }
  /// True: contains() tells, with a stat when the index does not know the key.
  bool may_hold(const Hash128&) const override { return true; }
  /// The run's one chunk: contains(), then read_entry() into payloads.get(0).
  void lookup(const LookupBatch& batch, PayloadPool& payloads,
              std::vector<LookupAnswer>* answers) override;
  /// A put writes every chunk whose file is not there (has_file).
  bool wants(const Hash128& key, const Fingerprint& fp, const ChunkEntry* pinned) override;
  /// Each chunk is written as the put reaches it.
  size_t batch_bytes() const override { return 0; }
  /// write_entry() of each write.
  void store(std::string_view ns, const Fingerprint& fp, const std::vector<ChunkWrite>& batch,
             std::vector<char>* stored) override;
  /// Removes fp's files of the keys (of every namespace: the chain keys carry it); counts what
  /// this call removed.
  int64_t erase(std::string_view ns, const Fingerprint& fp,
                const std::vector<Hash128>& keys) override;
  /// Removes every file of the model fingerprint (whichever store wrote it) into r->disk.
  void invalidate(const Fingerprint& fp, InvalidateResult* r) override;
  /// The same for the files whose provenance names `adapter` (read from each file's header).
  void invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter,
                          InvalidateResult* r) override;
  /// Removes every entry file of the directory; returns how many this call removed.
  int64_t clear() override;

  // --- The disk tier's own --------------------------------------------------------------------

  /// Whether fp's file of key exists and has not expired, always asking the file system (one
  /// stat): for writers, whose index may still list a file another store has removed since.
  bool has_file(const Hash128& key, const Fingerprint& fp);

  /// Reads and verifies key's entry into `payload` (want.geometry.payload_bytes bytes); on kHit
  /// also sets *meta. Corrupt files are moved to the quarantine directory; never throws.
  LoadResult read_entry(const ExpectedEntry& want, char* payload, LoadedMeta* meta);

  /// Writes one entry: `prefix` is its encoded header + tokens, `checksum` the XXH3-128 of
  /// prefix + payload. Returns false (counted) when it does not fit the budget or an I/O error
  /// occurs, true when the file is on disk (also when another store published it first);
  /// never throws.
  bool write_entry(const Hash128& key, const Fingerprint& fp, const unsigned char* prefix,
                   size_t prefix_bytes, const void* payload, size_t payload_bytes,
                   const Hash128& checksum, int64_t created_ms);

  /// Removes fp's file of key; true when this call removed one.
  bool erase_file(const Hash128& key, const Fingerprint& fp);

  /// The directory's file bytes (4 KiB blocks), counted by every store that has it open.
  int64_t bytes_used() const;
  /// Entry files this store knows of.
  int64_t entries() const;
  int64_t capacity_bytes() const;
  /// The directory holding quarantined (corrupt) files.
  std::string quarantine_dir() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge::detail
