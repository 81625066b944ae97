// The disk tier: one packed entry file per chunk (entry_codec.h) under
//   <disk_dir>/kvbridge-v1/<fingerprint>/<first two hex digits of the key>/<key hex>.kvb
// written as a temporary file beside it, fsynced (optionally) and renamed into place, so a
// reader sees a whole file or none. An in-memory index of the files (built by one directory scan
// at open) answers absent keys without a system call and keeps the byte budget.
// Thread-safe. docs/storage.md describes the layout, costs and failure handling.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "src/store/tier.h"

namespace kvbridge::detail {

class DiskTier {
 public:
  /// Opens (creating if needed) the directory and scans it. Throws Unavailable when it cannot be
  /// created or another live store holds it.
  DiskTier(const StoreOptions& options, std::function<int64_t()> clock, TierCounters* counters);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  bool contains(const Hash128& key) const;

  /// Reads and verifies key's entry into `payload` (want.payload_bytes bytes); on kHit also sets
  /// *meta. Corrupt files are moved to the quarantine directory; never throws.
  LoadResult load(const ExpectedEntry& want, char* payload, LoadedMeta* meta);

  /// Writes one entry: `prefix` is its encoded header + tokens, `checksum` the XXH3-128 of
  /// prefix + payload. Returns false (counted) when it does not fit the budget or an I/O error
  /// occurs; never throws.
  bool store(const Hash128& key, const Fingerprint& fp, const unsigned char* prefix,
             size_t prefix_bytes, const void* payload, size_t payload_bytes,
             const Hash128& checksum, int64_t created_ms);

  /// Removes key's file; true when there was one.
  bool erase(const Hash128& key);
  /// Removes every file of the model fingerprint; returns how many.
  int64_t invalidate(const Fingerprint& fp);
  /// Removes every file of the model fingerprint whose provenance names `adapter` (read from
  /// each file's header); returns how many.
  int64_t invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter);
  /// Removes every entry file.
  int64_t clear();

  int64_t bytes_used() const;
  int64_t entries() const;
  int64_t capacity_bytes() const;
  /// The directory holding quarantined (corrupt) files.
  std::string quarantine_dir() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge::detail
