// DiskTier's state, shared by its files: disk_tier.cpp (opening the directory and the LowerTier
// calls), disk_io.cpp (reading and writing entry files), disk_eviction.cpp (the budget:
// reservations, eviction, rescans; removal and quarantine of files). The parts with a job of
// their own are disk_layout.h (the tree), disk_usage.h (the shared count and leases) and
// disk_index.h (the files this store knows).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "src/core/atomic_file.h"
#include "src/store/disk_index.h"
#include "src/store/disk_layout.h"
#include "src/store/disk_tier.h"
#include "src/store/disk_usage.h"

namespace kvbridge::detail {

struct DiskTier::Impl {
  Impl(const StoreOptions& o, std::function<int64_t()> clk, TierCounters* c)
      : capacity(o.disk.capacity_bytes), fsync_files(o.disk.fsync),
        ttl_ms(o.ttl_seconds * 1000), clock(std::move(clk)), counters(c), index(o.eviction) {}

  const int64_t capacity;
  const bool fsync_files;
  const int64_t ttl_ms;
  std::function<int64_t()> clock;
  TierCounters* counters;
  disk::Layout layout;
  disk::SharedUsage usage;

  mutable std::mutex mu;
  disk::DiskIndex index;  // guarded by mu, as everything below
  uint64_t tmp_seq = 0;
  std::set<std::string> made_dirs;
  int quarantined = 0;
  int64_t next_rescan_ms = 0;  // steady clock

  bool expired(const disk::FileTimes& t, int64_t now) const {
    return (t.expires_ms > 0 && now >= t.expires_ms) ||
           (ttl_ms > 0 && t.created_ms >= 0 && now - t.created_ms >= ttl_ms);
  }

  // --- opening (disk_tier.cpp) ----------------------------------------------------------------

  // Opens the directory under its LOCK (which only serializes opens): maps the shared count,
  // takes a lease, recovers dead stores, scans the tree. With no other store alive the count is
  // recomputed from the files, exactly.
  void open(const std::string& dir);

  // --- the budget, removal and quarantine (disk_eviction.cpp) ---------------------------------

  // Deletes the entry file at `path` (or moves it to `to`) and takes its blocks off the shared
  // count. Only the one call (of any store) whose unlink or rename succeeds releases them, so
  // the count stays exact however many stores remove the same file. `ino` != 0: only that file
  // (not one published since under the same name). True when this call removed it.
  bool remove_file(const std::string& path, const std::string& to = "", ino_t ino = 0);
  // Drops the coldest file this store knows of. Caller holds mu. False: it knows none.
  bool evict_one_locked();
  // Reserves `bytes` on the shared count, evicting the coldest files this store knows of; when
  // it knows none, rescans the directory for other stores' files (at most every
  // kRescanMinMs, or ten times the last rescan's duration), then recovers the reservations of
  // stores that died. Caller holds mu.
  bool reserve_locked(int64_t bytes);
  // Evicts until the shared count is within this store's budget (a smaller budget than the
  // last run's). Caller holds mu.
  void shrink_locked();
  // Moves key's file to quarantine (or deletes it) and forgets it, if the index still holds
  // generation `gen` (0: not indexed) and the file is still inode `ino` (0: any).
  enum class Drop { kForget, kDelete, kQuarantine };
  void forget(const Hash128& key, const Fingerprint& fp, uint64_t gen, Drop how, ino_t ino);
  // Keeps the newest kMaxQuarantined files (names sort by key, so use mtimes).
  void trim_quarantine_locked();
  // Recovers the stores that died (SharedUsage::sweep), deleting their temporary files.
  int sweep_dead_stores();

  struct Found {
    Hash128 key;
    Fingerprint fp;
    int64_t bytes;
    disk::FileTimes times;
  };
  // Stats the entry files (all, or those this store does not index yet), deleting the expired
  // ones. Costs one readdir per directory and one stat per file; no file is opened.
  std::vector<Found> find_files(bool only_unknown,
                                std::function<void(const std::string&, const std::string&)> temp);
  // Learns the files other stores wrote since this one opened (caller holds mu; the index
  // knows none when this runs, see reserve_locked).
  void rescan_locked();

  // --- files (disk_io.cpp) --------------------------------------------------------------------

  // Makes root/fp and root/fp/xx for `path` = root/fp/xx/name. `again`: even if this store made
  // them before (another store's invalidate may have removed them since).
  bool ensure_dirs(const std::string& path, bool again);
  // Creates the entry's temporary file (named after this store's lease, so a sweep after its
  // death finds it): 0 or the errno. An empty directory removed by an invalidate (of this or
  // any store) between making it and the open is made again, so that race costs no write.
  int open_temp(AtomicFile* file, const std::string& path);
  // Whether fp's file of key exists and has not expired, by one stat: indexes it if it does,
  // removes it if it expired, forgets it if it is gone.
  bool stat_file(const Hash128& key, const Fingerprint& fp, int64_t now);
};

}  // namespace kvbridge::detail
