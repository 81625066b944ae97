// DiskTier: opening the directory, and the LowerTier calls (disk_io.cpp reads and writes the
// files, disk_eviction.cpp keeps the budget).
#include "src/store/disk_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <set>
#include <thread>

#include "kvbridge/error.h"
#include "src/store/disk_tier_impl.h"
#include "src/store/memory_tier.h"

namespace kvbridge::detail {
namespace {

constexpr int64_t kOpenLockWaitMs = 60000;

}  // namespace

using disk::ends_with;
using disk::errno_text;
using disk::is_hex;
using disk::kRootName;
using disk::list_dir;
using disk::make_dir;
using disk::steady_ms;
using disk::temp_owner;

void DiskTier::Impl::open(const std::string& dir) {
  KVB_CHECK_AS(Unavailable, make_dir(dir),
               "disk_dir '" << dir << "': cannot create: " << errno_text(errno));
  layout.root = dir + "/" + kRootName;
  const std::string& root = layout.root;
  KVB_CHECK_AS(Unavailable,
               make_dir(root) && make_dir(layout.quarantine()) && make_dir(layout.stores_dir()),
               "disk_dir '" << dir << "': cannot create '" << root
                            << "': " << errno_text(errno));
  const std::string lock_path = root + "/LOCK";
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  KVB_CHECK_AS(Unavailable, lock_fd >= 0,
               "disk_dir: cannot open '" << lock_path << "': " << errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }  // releases the LOCK
  } lock_closer{lock_fd};
  // Opens take turns (a scan lasts well under a second per 100,000 files); a lock held far
  // longer is not an open in progress (e.g. a store of a kvbridge older than the shared
  // directory, which held it for its lifetime).
  const int64_t give_up = steady_ms() + kOpenLockWaitMs;
  while (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    KVB_CHECK_AS(Unavailable, (err == EWOULDBLOCK || err == EINTR) && steady_ms() < give_up,
                 "disk_dir '" << dir << "': its open lock '" << lock_path << "' "
                              << (err == EWOULDBLOCK ? "stayed held for a minute"
                                                     : errno_text(err)));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }

  const bool fresh = usage.map_count(root);
  usage.take_lease(layout.stores_dir());

  std::set<std::string> live;
  usage.sweep(&live, nullptr);  // the scan below removes the dead stores' temporary files
  const bool alone = live.size() == 1;
  for (const std::string& name : list_dir(layout.stores_dir()))
    if (ends_with(name, ".new") && alone) ::unlink((layout.stores_dir() + "/" + name).c_str());

  std::lock_guard<std::mutex> lock(mu);
  const std::vector<Found> found =
      find_files(false, [&](const std::string& path, const std::string& name) {
        if (!live.count(temp_owner(name))) ::unlink(path.c_str());  // its writer died
      });
  int64_t total = 0;
  std::set<std::string> full;  // leaf directories holding entries
  for (const Found& f : found) {
    index.add(f.key, f.fp, f.bytes, f.times);
    total += f.bytes;
    const std::string path = layout.path_of(f.key, f.fp);
    full.insert(path.substr(0, path.rfind('/')));
  }
  if (alone || fresh) usage.set_used(total);
  for (const std::string& sub : list_dir(root)) {
    if (!is_hex(sub, 32)) continue;
    for (const std::string& leaf : list_dir(root + "/" + sub)) {
      const std::string d = root + "/" + sub + "/" + leaf;
      if (!is_hex(leaf, 2)) continue;
      if (alone && !full.count(d) && ::rmdir(d.c_str()) == 0) continue;  // left empty
      made_dirs.insert(d);
    }
    if (alone) ::rmdir((root + "/" + sub).c_str());  // fails unless empty
  }
  quarantined = static_cast<int>(list_dir(layout.quarantine()).size());
  shrink_locked();
}

DiskTier::DiskTier(const StoreOptions& options, std::function<int64_t()> clock)
    : impl_(std::make_unique<Impl>(options, std::move(clock), &counters_)) {
  impl_->open(options.disk.dir);
}

DiskTier::~DiskTier() = default;

bool DiskTier::contains(const Hash128& key, const Fingerprint& fp) {
  Impl& m = *impl_;
  const int64_t now = m.clock();
  {
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.index.find(key);
    if (it != m.index.end()) {
      if (!m.expired(it->second.times, now)) return true;
      if (m.remove_file(m.layout.path_of(key, it->second.fp)))
        TierCounters::add(m.counters->expired);
      m.index.drop(it);
      return false;
    }
  }
  return m.stat_file(key, fp, now);  // not known here: another store may have written it
}

bool DiskTier::has_file(const Hash128& key, const Fingerprint& fp) {
  return impl_->stat_file(key, fp, impl_->clock());
}

void DiskTier::fill(TierStats* own, StoreStats*) const {
  counters_.fill(own);
  own->capacity_bytes = capacity_bytes();
  own->bytes_used = bytes_used();
  own->entries = entries();
}

void DiskTier::lookup(const LookupBatch& batch, PayloadPool& payloads,
                      std::vector<LookupAnswer>* answers) {
  if (batch.run.empty()) {  // may_hold() rules nothing out, so never; counted as the miss
    TierCounters::add(counters_.misses);
    return;
  }
  LookupAnswer& a = answers->emplace_back();
  const ExpectedEntry& want = batch.run[0];
  if (!contains(want.key, batch.fp)) {
    TierCounters::add(counters_.misses);
    a.result = LoadResult::kMiss;
    return;
  }
  char* payload = payloads.get(0);
  a.result = payload ? read_entry(want, payload, &a.meta) : LoadResult::kNoRoom;
}

bool DiskTier::wants(const Hash128& key, const Fingerprint& fp, const ChunkEntry*) {
  return !has_file(key, fp);
}

void DiskTier::store(std::string_view, const Fingerprint& fp,
                     const std::vector<ChunkWrite>& batch, std::vector<char>* stored) {
  stored->assign(batch.size(), 0);
  for (size_t i = 0; i < batch.size(); ++i) {
    const ChunkWrite& w = batch[i];
    (*stored)[i] = write_entry(w.key, fp, w.packed->prefix.data(), w.packed->prefix.size(),
                               w.entry->kv, w.entry->payload_size(), w.packed->checksum,
                               w.entry->created_ms);
  }
}

int64_t DiskTier::erase(std::string_view, const Fingerprint& fp,
                        const std::vector<Hash128>& keys) {
  int64_t removed = 0;
  for (const Hash128& key : keys) removed += erase_file(key, fp);
  return removed;
}

bool DiskTier::erase_file(const Hash128& key, const Fingerprint& fp) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const bool removed = m.remove_file(m.layout.path_of(key, fp));
  m.index.drop(key);
  return removed;
}

void DiskTier::invalidate(const Fingerprint& fp, InvalidateResult* r) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  int64_t removed = 0;
  m.layout.walk(
      &fp, [&](const std::string& path, const Hash128&, const Fingerprint&) {
        removed += m.remove_file(path);
      },
      [](const std::string&, const std::string&) {});  // writes in flight publish later
  m.index.drop_fingerprint(fp);
  // The emptied directories stay: another store may be writing into them (a directory made
  // again between its mkdir and its open would fail the write). A store that opens the
  // directory alone removes empty ones.
  r->disk = removed;
}

void DiskTier::invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter,
                                  InvalidateResult* r) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  int64_t removed = 0;
  m.layout.walk(
      &fp,
      [&](const std::string& path, const Hash128& key, const Fingerprint&) {
        Fingerprint field{};
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) return;
        struct stat st{};
        const bool named = ::fstat(fd, &st) == 0 &&
                           ::pread(fd, field.data(), field.size(), kEntryAdapterOffset) ==
                               static_cast<ssize_t>(field.size()) &&
                           field == adapter;
        ::close(fd);
        if (!named || !m.remove_file(path, "", st.st_ino)) return;
        ++removed;
        m.index.drop(key);
      },
      [](const std::string&, const std::string&) {});
  r->disk = removed;
}

int64_t DiskTier::clear() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  int64_t removed = 0;
  m.layout.walk(
      nullptr,
      [&](const std::string& path, const Hash128&, const Fingerprint&) {
        removed += m.remove_file(path);
      },
      [](const std::string&, const std::string&) {});
  m.index.clear();
  return removed;
}

int64_t DiskTier::bytes_used() const {
  return impl_->usage.used();
}

int64_t DiskTier::entries() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->index.size());
}

int64_t DiskTier::capacity_bytes() const { return impl_->capacity; }

std::string DiskTier::quarantine_dir() const { return impl_->layout.quarantine(); }

}  // namespace kvbridge::detail
