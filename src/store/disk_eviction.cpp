// DiskTier's budget (reservations on the shared count, eviction, rescans for other stores'
// files, recovery of dead stores) and the removal and quarantine of files.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "src/store/disk_tier_impl.h"

namespace kvbridge::detail {
namespace {

constexpr int kMaxQuarantined = 64;
constexpr int64_t kRescanMinMs = 100;

}  // namespace

using disk::FileTimes;

bool DiskTier::Impl::remove_file(const std::string& path, const std::string& to, ino_t ino) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (ino != 0 && st.st_ino != ino) return false;
  if ((to.empty() ? ::unlink(path.c_str()) : ::rename(path.c_str(), to.c_str())) != 0)
    return false;
  usage.release(disk::round_to_block(st.st_size));
  return true;
}

bool DiskTier::Impl::evict_one_locked() {
  Hash128 victim;
  if (!index.coldest(&victim)) return false;
  auto it = index.find(victim);
  if (remove_file(layout.path_of(victim, it->second.fp))) TierCounters::add(counters->evictions);
  index.drop(it);  // removed by another store already if remove_file said no
  return true;
}

bool DiskTier::Impl::reserve_locked(int64_t bytes) {
  bool rescanned = false, swept = false;
  while (!usage.try_reserve(bytes, capacity)) {
    if (evict_one_locked()) continue;
    if (!rescanned && disk::steady_ms() >= next_rescan_ms) {
      rescanned = true;
      rescan_locked();
      continue;
    }
    if (!swept) {
      swept = true;
      if (sweep_dead_stores() > 0) continue;
    }
    return false;
  }
  return true;
}

void DiskTier::Impl::shrink_locked() {
  while (usage.used() > capacity && evict_one_locked()) {
  }
}

int DiskTier::Impl::sweep_dead_stores() {
  return usage.sweep(nullptr, [&](const std::set<std::string>& dead) {
    layout.walk(
        nullptr, [](const std::string&, const Hash128&, const Fingerprint&) {},
        [&](const std::string& path, const std::string& name) {
          if (dead.count(disk::temp_owner(name))) ::unlink(path.c_str());
        });
  });
}

void DiskTier::Impl::forget(const Hash128& key, const Fingerprint& fp, uint64_t gen, Drop how,
                            ino_t ino) {
  const std::string path = layout.path_of(key, fp);
  bool moved = false;
  if (how == Drop::kQuarantine) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(mu);
      seq = ++tmp_seq;
    }
    const std::string to = layout.quarantine() + "/" + key.hex() + "." +
                           std::to_string(clock()) + "." + usage.lease_id() + "-" +
                           std::to_string(seq) + disk::kSuffix;
    moved = remove_file(path, to, ino);
    if (!moved) remove_file(path, "", ino);
  } else if (how == Drop::kDelete) {
    remove_file(path, "", ino);
  }
  std::lock_guard<std::mutex> lock(mu);
  if (moved && ++quarantined > kMaxQuarantined) trim_quarantine_locked();
  auto it = index.find(key);
  if (it != index.end() && it->second.gen == gen) index.drop(it);
}

void DiskTier::Impl::trim_quarantine_locked() {
  std::vector<std::pair<int64_t, std::string>> files;
  for (const std::string& name : disk::list_dir(layout.quarantine())) {
    struct stat st{};
    const std::string p = layout.quarantine() + "/" + name;
    if (::stat(p.c_str(), &st) == 0)
      files.emplace_back(int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec, p);
  }
  std::sort(files.begin(), files.end());
  while (static_cast<int>(files.size()) > kMaxQuarantined) {
    ::unlink(files.front().second.c_str());
    files.erase(files.begin());
  }
  quarantined = static_cast<int>(files.size());
}

std::vector<DiskTier::Impl::Found> DiskTier::Impl::find_files(
    bool only_unknown, std::function<void(const std::string&, const std::string&)> temp) {
  std::vector<Found> found;
  const int64_t now = clock();
  layout.walk(
      nullptr,
      [&](const std::string& path, const Hash128& key, const Fingerprint& fp) {
        if (only_unknown && index.contains(key)) return;
        struct stat st{};
        if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
        const FileTimes t = disk::file_times(st);
        if (expired(t, now)) {
          if (remove_file(path, "", st.st_ino)) TierCounters::add(counters->expired);
          return;
        }
        found.push_back({key, fp, disk::round_to_block(st.st_size), t});
      },
      temp);
  // Oldest first, so the LRU order ends with the newest file most recent.
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.times.order_ms() < b.times.order_ms();
  });
  return found;
}

void DiskTier::Impl::rescan_locked() {
  const int64_t start = disk::steady_ms();
  for (const Found& f : find_files(true, [](const std::string&, const std::string&) {}))
    index.add(f.key, f.fp, f.bytes, f.times);
  const int64_t took = disk::steady_ms() - start;
  next_rescan_ms = disk::steady_ms() + std::max<int64_t>(kRescanMinMs, 10 * took);
}

}  // namespace kvbridge::detail
