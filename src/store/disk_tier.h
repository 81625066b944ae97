// The disk tier: one packed entry file per chunk (entry_codec.h) under
//   <disk_dir>/kvbridge-v1/<fingerprint>/<first two hex digits of the key>/<key hex>.kvb
// written as a temporary file beside it, fsynced (optionally) and published with a rename
// that never replaces a file, so a reader sees a whole file or none. Any number of stores, in
// any processes, may have one directory open: the files are the truth, each store keeps an
// index of the files it knows (built by one scan at open, grown by its writes and by files it
// finds that other stores wrote), and the byte budget is kept on a count shared through a
// mapped file (kvbridge-v1/USAGE). Thread-safe. docs/storage.md describes the layout, the
// cross-process protocol, costs and failure handling.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "src/store/tier.h"

namespace kvbridge::detail {

class DiskTier {
 public:
  /// Opens (creating if needed) the directory and scans it. Throws Unavailable when it cannot be
  /// created, or its open lock stays held for more than a minute.
  DiskTier(const StoreOptions& options, std::function<int64_t()> clock, TierCounters* counters);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  /// Whether fp's file of key exists and has not expired (an expired one is removed). Answers
  /// from the index, else with one stat (another store may have written it).
  bool contains(const Hash128& key, const Fingerprint& fp);
  /// The same, always asking the file system (one stat): for writers, whose index may still
  /// list a file another store has removed since.
  bool has_file(const Hash128& key, const Fingerprint& fp);

  /// Reads and verifies key's entry into `payload` (want.payload_bytes bytes); on kHit also sets
  /// *meta. Corrupt files are moved to the quarantine directory; never throws.
  LoadResult load(const ExpectedEntry& want, char* payload, LoadedMeta* meta);

  /// Writes one entry: `prefix` is its encoded header + tokens, `checksum` the XXH3-128 of
  /// prefix + payload. Returns false (counted) when it does not fit the budget or an I/O error
  /// occurs, true when the file is on disk (also when another store published it first);
  /// never throws.
  bool store(const Hash128& key, const Fingerprint& fp, const unsigned char* prefix,
             size_t prefix_bytes, const void* payload, size_t payload_bytes,
             const Hash128& checksum, int64_t created_ms);

  /// Removes fp's file of key; true when this call removed one.
  bool erase(const Hash128& key, const Fingerprint& fp);
  /// Removes every file of the model fingerprint (whichever store wrote it); returns how many
  /// this call removed.
  int64_t invalidate(const Fingerprint& fp);
  /// Removes every file of the model fingerprint whose provenance names `adapter` (read from
  /// each file's header, whichever store wrote it); returns how many this call removed.
  int64_t invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter);
  /// Removes every entry file of the directory; returns how many this call removed.
  int64_t clear();

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
