#include "src/store/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvbridge/error.h"
#include "src/core/atomic_file.h"
#include "src/core/xxh3.h"
#include "src/store/eviction_order.h"
#include "src/store/memory_tier.h"

namespace kvbridge::detail {
namespace {

constexpr char kRootName[] = "kvbridge-v1";
constexpr char kSuffix[] = ".kvb";
constexpr int64_t kBlock = 4096;
constexpr int kMaxQuarantined = 64;
constexpr int64_t kRescanMinMs = 100;
constexpr int64_t kOpenLockWaitMs = 60000;

int64_t round_to_block(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

bool is_hex(const std::string& s, size_t n) {
  if (s.size() != n) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

bool parse_key_hex(const std::string& s, Hash128* out) {
  if (!is_hex(s, 32)) return false;
  auto part = [&](size_t begin) {
    uint64_t v = 0;
    for (size_t i = begin; i < begin + 16; ++i)
      v = (v << 4) | static_cast<uint64_t>(s[i] <= '9' ? s[i] - '0' : s[i] - 'a' + 10);
    return v;
  };
  out->high = part(0);
  out->low = part(16);
  return true;
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return names;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

bool make_dir(const std::string& path) {
  return ::mkdir(path.c_str(), 0755) == 0 || errno == EEXIST;
}

// Reads exactly n bytes; false on EOF or error (errno set, 0 for EOF).
bool read_full(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = 0;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Reads exactly the iovecs' bytes; false on EOF (errno 0) or error.
bool readv_full(int fd, iovec* iov, int count) {
  while (count > 0) {
    const ssize_t r = ::readv(fd, iov, count);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = 0;
      return false;
    }
    skip_done(iov, count, static_cast<size_t>(r));
  }
  return true;
}

int64_t mtime_ms(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000;
}

// An entry put under a TTL records its expiry in its file: the sticky bit (which Linux ignores
// on regular files) says that the mtime is the expiry time; without it the mtime is the
// creation time.
constexpr mode_t kFileMode = 0644;
constexpr mode_t kExpiringMode = 0644 | S_ISVTX;

// What a file's metadata says about its age: -1 / 0 when unknown / none.
struct FileTimes {
  int64_t created_ms = -1;
  int64_t expires_ms = 0;
  int64_t order_ms() const { return created_ms >= 0 ? created_ms : expires_ms; }
};

FileTimes file_times(const struct stat& st) {
  FileTimes t;
  if (st.st_mode & S_ISVTX) {
    t.expires_ms = mtime_ms(st);
  } else {
    t.created_ms = mtime_ms(st);
  }
  return t;
}

// The byte count of the whole directory, at the start of kvbridge-v1/USAGE, mapped shared by
// every store that has the directory open (any process). Lock-free atomics are address-free, so
// the processes' mappings of the same page agree.
struct SharedUsage {
  char magic[8];
  uint32_t version;
  uint32_t unused;
  std::atomic<int64_t> used;
};
// One store's reservations of writes in flight, at the start of its lease file
// kvbridge-v1/stores/<id>.lease, which the store holds flock()ed while it lives.
struct LeaseRecord {
  char magic[8];
  std::atomic<int64_t> reserved;
};
static_assert(std::atomic<int64_t>::is_always_lock_free,
              "the shared count needs a lock-free int64");
constexpr char kUsageMagic[8] = {'K', 'V', 'B', 'U', 'S', 'A', 'G', 'E'};
constexpr char kLeaseMagic[8] = {'K', 'V', 'B', 'L', 'E', 'A', 'S', 'E'};
constexpr size_t kStateFileBytes = 4096;
constexpr char kLeaseSuffix[] = ".lease";
constexpr char kTmpMark[] = ".tmp.";  // AtomicFile's temporary names: <path>.tmp.<tag>.<n>

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The lease id in a temporary file's name <key hex>.kvb.tmp.<id>.<n> ("" if none).
std::string temp_owner(const std::string& name) {
  const size_t at = name.find(kTmpMark);
  if (at == std::string::npos) return "";
  const size_t begin = at + sizeof kTmpMark - 1;
  const size_t end = name.find('.', begin);
  return end == std::string::npos ? "" : name.substr(begin, end - begin);
}

std::string random_id() {
  std::random_device rd;
  const uint64_t now = static_cast<uint64_t>(
      std::chrono::steady_clock::now().time_since_epoch().count());
  const uint64_t v =
      (uint64_t{rd()} << 32) ^ rd() ^ (static_cast<uint64_t>(::getpid()) << 16) ^ now;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

int64_t steady_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Item {
  Fingerprint fp{};
  int64_t bytes = 0;  // accounted (rounded to 4 KiB)
  FileTimes times;
  uint64_t gen = 0;  // changes whenever this store indexes a file at this key
  EvictionOrder::Handle order;
};

}  // namespace

struct DiskTier::Impl {
  Impl(const StoreOptions& o, std::function<int64_t()> clk, TierCounters* c)
      : capacity(o.disk.capacity_bytes), fsync_files(o.disk.fsync),
        ttl_ms(o.ttl_seconds * 1000), clock(std::move(clk)), counters(c), order(o.eviction) {}

  ~Impl() {
    if (lease) {
      // Not in a forked child that inherited the store: the lease is its parent's.
      if (::getpid() == owner_pid) ::unlink(lease_path.c_str());
      ::munmap(lease, kStateFileBytes);
    }
    if (lease_fd >= 0) ::close(lease_fd);  // releases the lease's flock
    if (usage) ::munmap(usage, kStateFileBytes);
  }

  const int64_t capacity;
  const bool fsync_files;
  const int64_t ttl_ms;
  std::function<int64_t()> clock;
  TierCounters* counters;
  std::string root;
  SharedUsage* usage = nullptr;
  LeaseRecord* lease = nullptr;
  int lease_fd = -1;
  std::string lease_id, lease_path;
  const pid_t owner_pid = ::getpid();

  mutable std::mutex mu;
  std::unordered_map<Hash128, Item, HashOf> index;  // the files this store knows of
  EvictionOrder order;
  uint64_t next_gen = 0;
  uint64_t tmp_seq = 0;
  std::set<std::string> made_dirs;
  int quarantined = 0;
  int64_t next_rescan_ms = 0;  // steady clock

  std::string fp_dir(const Fingerprint& fp) const { return root + "/" + fingerprint_string(fp); }
  std::string path_of(const Hash128& key, const Fingerprint& fp) const {
    const std::string hex = key.hex();
    return fp_dir(fp) + "/" + hex.substr(0, 2) + "/" + hex + kSuffix;
  }
  std::string quarantine() const { return root + "/quarantine"; }
  std::string stores_dir() const { return root + "/stores"; }

  // --- the shared byte count ------------------------------------------------------------------

  bool try_reserve(int64_t n) {
    int64_t cur = usage->used.load(std::memory_order_relaxed);
    do {
      if (cur + n > capacity) return false;
    } while (!usage->used.compare_exchange_weak(cur, cur + n, std::memory_order_acq_rel));
    return true;
  }
  void release(int64_t n) { usage->used.fetch_sub(n, std::memory_order_acq_rel); }

  bool expired(const FileTimes& t, int64_t now) const {
    return (t.expires_ms > 0 && now >= t.expires_ms) ||
           (ttl_ms > 0 && t.created_ms >= 0 && now - t.created_ms >= ttl_ms);
  }

  // Deletes the entry file at `path` (or moves it to `to`) and takes its blocks off the shared
  // count. Only the one call (of any store) whose unlink or rename succeeds releases them, so
  // the count stays exact however many stores remove the same file. `ino` != 0: only that file
  // (not one published since under the same name). True when this call removed it.
  bool remove_file(const std::string& path, const std::string& to = "", ino_t ino = 0) {
    struct stat st{};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
    if (ino != 0 && st.st_ino != ino) return false;
    if ((to.empty() ? ::unlink(path.c_str()) : ::rename(path.c_str(), to.c_str())) != 0)
      return false;
    release(round_to_block(st.st_size));
    return true;
  }

  // --- the index ------------------------------------------------------------------------------

  void index_locked(const Hash128& key, const Fingerprint& fp, int64_t bytes,
                    const FileTimes& t) {
    auto it = index.find(key);
    if (it != index.end()) drop_locked(it);
    Item item;
    item.fp = fp;
    item.bytes = bytes;
    item.times = t;
    item.gen = ++next_gen;
    item.order = order.insert(key, t.order_ms());
    index.emplace(key, item);
  }
  void drop_locked(std::unordered_map<Hash128, Item, HashOf>::iterator it) {
    order.erase(it->second.order);
    index.erase(it);
  }

  // Drops the coldest file this store knows of. Caller holds mu. False: it knows none.
  bool evict_one_locked() {
    Hash128 victim;
    if (!order.find_coldest([&](const Hash128& k) {
          victim = k;
          return true;
        }))
      return false;
    auto it = index.find(victim);
    if (remove_file(path_of(victim, it->second.fp))) TierCounters::add(counters->evictions);
    drop_locked(it);  // removed by another store already if remove_file said no
    return true;
  }

  // Reserves `bytes` on the shared count, evicting the coldest files this store knows of; when
  // it knows none, rescans the directory for other stores' files (at most every
  // kRescanMinMs, or ten times the last rescan's duration), then recovers the reservations of
  // stores that died. Caller holds mu.
  bool reserve_locked(int64_t bytes) {
    bool rescanned = false, swept = false;
    while (!try_reserve(bytes)) {
      if (evict_one_locked()) continue;
      if (!rescanned && steady_ms() >= next_rescan_ms) {
        rescanned = true;
        rescan_locked();
        continue;
      }
      if (!swept) {
        swept = true;
        if (sweep_leases(nullptr, true) > 0) continue;
      }
      return false;
    }
    return true;
  }

  // Evicts until the shared count is within this store's budget (a smaller budget than the
  // last run's). Caller holds mu.
  void shrink_locked() {
    while (usage->used.load(std::memory_order_acquire) > capacity && evict_one_locked()) {
    }
  }

  // Moves key's file to quarantine (or deletes it) and forgets it, if the index still holds
  // generation `gen` (0: not indexed) and the file is still inode `ino` (0: any).
  enum class Drop { kForget, kDelete, kQuarantine };
  void forget(const Hash128& key, const Fingerprint& fp, uint64_t gen, Drop how, ino_t ino) {
    const std::string path = path_of(key, fp);
    bool moved = false;
    if (how == Drop::kQuarantine) {
      uint64_t seq;
      {
        std::lock_guard<std::mutex> lock(mu);
        seq = ++tmp_seq;
      }
      const std::string to = quarantine() + "/" + key.hex() + "." + std::to_string(clock()) +
                             "." + lease_id + "-" + std::to_string(seq) + kSuffix;
      moved = remove_file(path, to, ino);
      if (!moved) remove_file(path, "", ino);
    } else if (how == Drop::kDelete) {
      remove_file(path, "", ino);
    }
    std::lock_guard<std::mutex> lock(mu);
    if (moved && ++quarantined > kMaxQuarantined) trim_quarantine_locked();
    auto it = index.find(key);
    if (it != index.end() && it->second.gen == gen) drop_locked(it);
  }

  // Keeps the newest kMaxQuarantined files (names sort by key, so use mtimes).
  void trim_quarantine_locked() {
    std::vector<std::pair<int64_t, std::string>> files;
    for (const std::string& name : list_dir(quarantine())) {
      struct stat st{};
      const std::string p = quarantine() + "/" + name;
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

  // Makes root/fp and root/fp/xx for `path` = root/fp/xx/name. `again`: even if this store made
  // them before (another store's invalidate may have removed them since).
  bool ensure_dirs(const std::string& path, bool again) {
    const size_t last = path.rfind('/');
    const std::string leaf_dir = path.substr(0, last);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (again) {
        made_dirs.erase(leaf_dir);
      } else if (made_dirs.count(leaf_dir)) {
        return true;
      }
    }
    const std::string fp = leaf_dir.substr(0, leaf_dir.rfind('/'));
    if (!make_dir(fp) || !make_dir(leaf_dir)) return false;
    std::lock_guard<std::mutex> lock(mu);
    made_dirs.insert(leaf_dir);
    return true;
  }

  // Creates the entry's temporary file (named after this store's lease, so a sweep after its
  // death finds it): 0 or the errno. An empty directory removed by an invalidate (of this or
  // any store) between making it and the open is made again, so that race costs no write.
  int open_temp(AtomicFile* file, const std::string& path) {
    AtomicFile::Options o;
    o.mode = kFileMode;
    o.fsync = fsync_files;
    o.fsync_dir = false;
    o.tag = lease_id;
    int err = ENOENT;
    for (int attempt = 0; attempt < 8 && err == ENOENT; ++attempt) {
      if (!ensure_dirs(path, attempt > 0)) {
        err = errno;
        continue;
      }
      err = file->open(path, o);
    }
    return err;
  }

  // Whether fp's file of key exists and has not expired, by one stat: indexes it if it does,
  // removes it if it expired, forgets it if it is gone.
  bool stat_file(const Hash128& key, const Fingerprint& fp, int64_t now) {
    const std::string path = path_of(key, fp);
    struct stat st{};
    const bool exists = ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
    const FileTimes t = exists ? file_times(st) : FileTimes{};
    const bool young = exists && !expired(t, now);
    if (exists && !young && remove_file(path, "", st.st_ino))
      TierCounters::add(counters->expired);
    std::lock_guard<std::mutex> lock(mu);
    auto it = index.find(key);
    if (!young) {
      if (it != index.end()) drop_locked(it);
    } else if (it == index.end()) {
      index_locked(key, fp, round_to_block(st.st_size), t);
    }
    return young;
  }

  // --- the tree ---------------------------------------------------------------------------------

  // Calls entry(path, name, key, fp) for every entry file and temp(path, name) for every
  // temporary file, under every fingerprint directory or only under `only`'s.
  template <class Entry, class Temp>
  void walk(const Fingerprint* only, Entry&& entry, Temp&& temp) {
    const std::vector<std::string> fps =
        only ? std::vector<std::string>{fingerprint_string(*only)} : list_dir(root);
    for (const std::string& fp_name : fps) {
      if (!is_hex(fp_name, 32)) continue;
      const Fingerprint fp = to_fingerprint(fp_name);
      for (const std::string& sub : list_dir(root + "/" + fp_name)) {
        if (!is_hex(sub, 2)) continue;
        const std::string dir = root + "/" + fp_name + "/" + sub;
        for (const std::string& name : list_dir(dir)) {
          const std::string path = dir + "/" + name;
          if (name.find(kTmpMark) != std::string::npos) {
            temp(path, name);
            continue;
          }
          Hash128 key;
          if (name.size() != 32 + 4 || name.compare(32, 4, kSuffix) != 0 ||
              !parse_key_hex(name.substr(0, 32), &key) || name.compare(0, 2, sub) != 0)
            continue;
          entry(path, key, fp);
        }
      }
    }
  }

  struct Found {
    Hash128 key;
    Fingerprint fp;
    int64_t bytes;
    FileTimes times;
  };

  // Stats the entry files (all, or those this store does not index yet), deleting the expired
  // ones. Costs one readdir per directory and one stat per file; no file is opened.
  std::vector<Found> find_files(bool only_unknown, std::function<void(const std::string&,
                                                                      const std::string&)> temp) {
    std::vector<Found> found;
    const int64_t now = clock();
    walk(
        nullptr,
        [&](const std::string& path, const Hash128& key, const Fingerprint& fp) {
          if (only_unknown && index.count(key)) return;
          struct stat st{};
          if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
          const FileTimes t = file_times(st);
          if (expired(t, now)) {
            if (remove_file(path, "", st.st_ino)) TierCounters::add(counters->expired);
            return;
          }
          found.push_back({key, fp, round_to_block(st.st_size), t});
        },
        temp);
    // Oldest first, so the LRU order ends with the newest file most recent.
    std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
      return a.times.order_ms() < b.times.order_ms();
    });
    return found;
  }

  // Learns the files other stores wrote since this one opened (caller holds mu; the index
  // knows none when this runs, see reserve_locked).
  void rescan_locked() {
    const int64_t start = steady_ms();
    for (const Found& f : find_files(true, [](const std::string&, const std::string&) {}))
      index_locked(f.key, f.fp, f.bytes, f.times);
    const int64_t took = steady_ms() - start;
    next_rescan_ms = steady_ms() + std::max<int64_t>(kRescanMinMs, 10 * took);
  }

  // Recovers every store that died with the directory open (its lease file is not flock()ed):
  // its reservations leave the shared count, its temporary files are deleted (with
  // `remove_temps`), its lease file is removed. Fills `live` with the ids of living stores
  // (this one included). Returns how many dead stores it recovered.
  int sweep_leases(std::set<std::string>* live, bool remove_temps) {
    std::vector<std::pair<std::string, int>> dead;  // (id, fd holding its lock)
    for (const std::string& name : list_dir(stores_dir())) {
      if (!ends_with(name, kLeaseSuffix)) continue;
      const std::string id = name.substr(0, name.size() - (sizeof kLeaseSuffix - 1));
      if (id == lease_id) {
        if (live) live->insert(id);
        continue;
      }
      const int fd = ::open((stores_dir() + "/" + name).c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) {
        if (errno != ENOENT && live) live->insert(id);  // cannot tell: assume it lives
        continue;
      }
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
        ::close(fd);
        if (live) live->insert(id);
        continue;
      }
      // Dead (or recovered by another sweep right now, which zeroed it first): zero its
      // reservation before releasing it, so that dying here can only leave bytes counted.
      char rec[16] = {};
      int64_t reserved = 0;
      if (::pread(fd, rec, sizeof rec, 0) == static_cast<ssize_t>(sizeof rec) &&
          std::memcmp(rec, kLeaseMagic, 8) == 0)
        std::memcpy(&reserved, rec + 8, 8);
      const int64_t zero = 0;
      if (reserved != 0 && ::pwrite(fd, &zero, 8, 8) == 8) release(reserved);
      dead.emplace_back(id, fd);
    }
    if (remove_temps && !dead.empty()) {
      std::set<std::string> ids;
      for (const auto& d : dead) ids.insert(d.first);
      walk(
          nullptr, [](const std::string&, const Hash128&, const Fingerprint&) {},
          [&](const std::string& path, const std::string& name) {
            if (ids.count(temp_owner(name))) ::unlink(path.c_str());
          });
    }
    for (const auto& [id, fd] : dead) {
      ::unlink((stores_dir() + "/" + id + kLeaseSuffix).c_str());
      ::close(fd);
    }
    return static_cast<int>(dead.size());
  }

  // --- open -----------------------------------------------------------------------------------

  // Maps the first kStateFileBytes of fd (growing the file to that size).
  void* map_state(int fd, const std::string& what) {
    struct stat st{};
    KVB_CHECK_AS(Unavailable, ::fstat(fd, &st) == 0,
                 "disk_dir: cannot stat '" << what << "': " << errno_text(errno));
    if (st.st_size < static_cast<off_t>(kStateFileBytes))
      KVB_CHECK_AS(Unavailable, ::ftruncate(fd, kStateFileBytes) == 0,
                   "disk_dir: cannot size '" << what << "': " << errno_text(errno));
    void* p = ::mmap(nullptr, kStateFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    KVB_CHECK_AS(Unavailable, p != MAP_FAILED,
                 "disk_dir: cannot map '" << what << "': " << errno_text(errno));
    return p;
  }

  // Opens the directory under its LOCK (which only serializes opens): maps the shared count,
  // takes a lease, recovers dead stores, scans the tree. With no other store alive the count is
  // recomputed from the files, exactly.
  void open(const std::string& dir) {
    KVB_CHECK_AS(Unavailable, make_dir(dir),
                 "disk_dir '" << dir << "': cannot create: " << errno_text(errno));
    root = dir + "/" + kRootName;
    KVB_CHECK_AS(Unavailable, make_dir(root) && make_dir(quarantine()) && make_dir(stores_dir()),
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

    const std::string usage_path = root + "/USAGE";
    const int usage_fd = ::open(usage_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    KVB_CHECK_AS(Unavailable, usage_fd >= 0,
                 "disk_dir: cannot open '" << usage_path << "': " << errno_text(errno));
    Closer usage_closer{usage_fd};  // the mapping stays
    usage = static_cast<SharedUsage*>(map_state(usage_fd, usage_path));
    const bool fresh = std::memcmp(usage->magic, kUsageMagic, 8) != 0;
    if (fresh) {
      usage->used.store(0);
      usage->version = 1;
      std::memcpy(usage->magic, kUsageMagic, 8);
    }

    // The lease is made under a temporary name and renamed once locked, so a sweep never sees
    // an unlocked lease of a living store.
    lease_id = random_id();
    lease_path = stores_dir() + "/" + lease_id + kLeaseSuffix;
    const std::string lease_tmp = stores_dir() + "/" + lease_id + ".new";
    lease_fd = ::open(lease_tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    KVB_CHECK_AS(Unavailable, lease_fd >= 0,
                 "disk_dir: cannot create '" << lease_tmp << "': " << errno_text(errno));
    KVB_CHECK_AS(Unavailable, ::flock(lease_fd, LOCK_EX | LOCK_NB) == 0,
                 "disk_dir: cannot lock '" << lease_tmp << "': " << errno_text(errno));
    lease = static_cast<LeaseRecord*>(map_state(lease_fd, lease_tmp));
    lease->reserved.store(0);
    std::memcpy(lease->magic, kLeaseMagic, 8);
    KVB_CHECK_AS(Unavailable, ::rename(lease_tmp.c_str(), lease_path.c_str()) == 0,
                 "disk_dir: cannot create '" << lease_path << "': " << errno_text(errno));

    std::set<std::string> live;
    sweep_leases(&live, false);  // the scan below removes the dead stores' temporary files
    const bool alone = live.size() == 1;
    for (const std::string& name : list_dir(stores_dir()))
      if (ends_with(name, ".new") && alone) ::unlink((stores_dir() + "/" + name).c_str());

    std::lock_guard<std::mutex> lock(mu);
    const std::vector<Found> found =
        find_files(false, [&](const std::string& path, const std::string& name) {
          if (!live.count(temp_owner(name))) ::unlink(path.c_str());  // its writer died
        });
    int64_t total = 0;
    std::set<std::string> full;  // leaf directories holding entries
    for (const Found& f : found) {
      index_locked(f.key, f.fp, f.bytes, f.times);
      total += f.bytes;
      const std::string path = path_of(f.key, f.fp);
      full.insert(path.substr(0, path.rfind('/')));
    }
    if (alone || fresh) usage->used.store(total, std::memory_order_release);
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
    quarantined = static_cast<int>(list_dir(quarantine()).size());
    shrink_locked();
  }
};

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
      if (m.remove_file(m.path_of(key, it->second.fp))) TierCounters::add(m.counters->expired);
      m.drop_locked(it);
      return false;
    }
  }
  return m.stat_file(key, fp, now);  // not known here: another store may have written it
}

bool DiskTier::has_file(const Hash128& key, const Fingerprint& fp) {
  return impl_->stat_file(key, fp, impl_->clock());
}

void DiskTier::fill(StoreStats* s) const {
  counters_.fill(&s->disk);
  s->disk.enabled = true;
  s->disk.capacity_bytes = capacity_bytes();
  s->disk.bytes_used = bytes_used();
  s->disk.entries = entries();
}

LoadResult DiskTier::load(ChainLookup& chain, size_t c, std::unique_ptr<LookupState>&,
                          LoadedMeta* meta) {
  if (!contains(chain.key(c), chain.fingerprint())) {
    TierCounters::add(counters_.misses);
    return LoadResult::kMiss;
  }
  char* payload = chain.payload(c);
  if (!payload) return LoadResult::kNoRoom;
  return read_entry(chain.expected(c), payload, meta);
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

LoadResult DiskTier::read_entry(const ExpectedEntry& want, char* payload, LoadedMeta* meta) {
  Impl& m = *impl_;
  TierCounters& c = *m.counters;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.index.find(want.key);
    if (it != m.index.end()) {
      if (it->second.fp != want.fingerprint) {
        TierCounters::add(c.misses);
        return LoadResult::kMiss;
      }
      gen = it->second.gen;
    }
  }
  const std::string path = m.path_of(want.key, want.fingerprint);
  ino_t ino = 0;
  // A miss verify_entry counted, and the index's and the file's fate.
  auto forget = [&](Impl::Drop how) {
    m.forget(want.key, want.fingerprint, gen, how, ino);
    return LoadResult::kMiss;
  };
  auto miss = [&](std::atomic<int64_t>* reason, Impl::Drop how) {
    if (reason) TierCounters::add(*reason);
    TierCounters::add(c.misses);
    return forget(how);
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    // ENOENT: removed by another store (or by hand); anything else is an I/O error. Either way
    // the index forgets the entry, so the next put of the chunk writes it again.
    return errno == ENOENT ? miss(nullptr, Impl::Drop::kForget)
                           : miss(&c.errors, Impl::Drop::kDelete);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0) return miss(&c.errors, Impl::Drop::kDelete);
  ino = st.st_ino;
  const FileTimes times = file_times(st);
  if (times.expires_ms > 0 && want.now_ms >= times.expires_ms)
    return miss(&c.expired, Impl::Drop::kDelete);
  const size_t total = static_cast<size_t>(st.st_size);
  // Few system calls: the payload is read in verify_entry's blocks (each hashed while it is
  // still in cache), the last one together with the trailer. A file of the expected size (the
  // usual case) has its header, token ids and first block (with the trailer, when that block is
  // the last) read in one call; the header is checked after it.
  const size_t prefix_bytes = entry_prefix_bytes(want.geometry.chunk);
  std::vector<unsigned char> prefix(prefix_bytes);
  if (total < prefix_bytes) return miss(&c.corrupt, Impl::Drop::kQuarantine);
  const size_t payload_bytes = static_cast<size_t>(want.geometry.payload_bytes);
  const size_t first = std::min(kEntryVerifyBlock, payload_bytes);
  const bool expected_size =
      total == entry_encoded_bytes(want.geometry.chunk, want.geometry.payload_bytes);
  unsigned char first_trailer[kEntryTrailerBytes];
  errno = 0;
  bool read_ok;
  if (expected_size) {
    iovec iov[3] = {{prefix.data(), prefix_bytes},
                    {payload, first},
                    {first_trailer, kEntryTrailerBytes}};
    read_ok = readv_full(fd, iov, first == payload_bytes ? 3 : 2);
  } else {
    read_ok = read_full(fd, prefix.data(), prefix_bytes);
  }
  if (!read_ok)
    return !errno ? miss(&c.corrupt, Impl::Drop::kQuarantine)
                  : miss(&c.errors, Impl::Drop::kDelete);
  auto read_block = [&](char* dst, size_t offset, size_t len, unsigned char* trailer) {
    if (expected_size && offset == 0 && len == first) {  // read with the prefix
      if (trailer) std::memcpy(trailer, first_trailer, kEntryTrailerBytes);
      return true;
    }
    if (!trailer) return read_full(fd, dst, len);
    iovec iov[2] = {{dst, len}, {trailer, kEntryTrailerBytes}};
    return readv_full(fd, iov, 2);
  };
  errno = 0;
  EntryHeader h;
  const EntryCheck r = verify_entry(prefix.data(), total, want, read_block, payload, &h);
  if (r == EntryCheck::kUnreadable)
    return errno ? miss(&c.errors, Impl::Drop::kDelete) : miss(&c.corrupt, Impl::Drop::kQuarantine);
  const LoadResult result = count_check(r, total, c);
  if (r == EntryCheck::kCorrupt) return forget(Impl::Drop::kQuarantine);
  if (r == EntryCheck::kExpired) return forget(Impl::Drop::kDelete);
  if (result == LoadResult::kCollision) return result;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.index.find(want.key);
    if (it == m.index.end()) {
      m.index_locked(want.key, want.fingerprint, round_to_block(st.st_size), times);
    } else if (it->second.gen == gen) {
      m.order.touch(it->second.order, want.key);
    }
  }
  *meta = LoadedMeta::of(h);
  return LoadResult::kHit;
}

bool DiskTier::write_entry(const Hash128& key, const Fingerprint& fp,
                           const unsigned char* prefix, size_t prefix_bytes, const void* payload,
                           size_t payload_bytes, const Hash128& checksum, int64_t created_ms) {
  Impl& m = *impl_;
  TierCounters& c = *m.counters;
  const size_t total = prefix_bytes + payload_bytes + kEntryTrailerBytes;
  const int64_t bytes = round_to_block(static_cast<int64_t>(total));
  const std::string path = m.path_of(key, fp);
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (bytes > m.capacity || !m.reserve_locked(bytes)) {
      TierCounters::add(c.write_failures);
      return false;
    }
  }
  // Reserved on the shared count and in this store's lease (which a recovery of this store,
  // should it die, takes back) until the file is published or abandoned.
  m.lease->reserved.fetch_add(bytes, std::memory_order_acq_rel);
  AtomicFile file;
  auto fail = [&] {
    file.abandon();
    m.lease->reserved.fetch_sub(bytes, std::memory_order_acq_rel);
    m.release(bytes);
    TierCounters::add(c.errors);
    TierCounters::add(c.write_failures);
    return false;
  };
  if (m.open_temp(&file, path) != 0) return fail();
  unsigned char trailer[kEntryTrailerBytes];
  encode_trailer(checksum, trailer);
  const iovec iov[3] = {{const_cast<unsigned char*>(prefix), prefix_bytes},
                        {const_cast<void*>(payload), payload_bytes},
                        {trailer, sizeof trailer}};
  if (file.writev(iov, 3) != 0) return fail();
  // mtime = creation time, or the expiry under a TTL (marked by the sticky bit), so a scan
  // knows the entry's age without opening it.
  FileTimes times;
  if (m.ttl_ms > 0) {
    times.expires_ms = created_ms + m.ttl_ms;
  } else {
    times.created_ms = created_ms;
  }
  const int64_t stamp = m.ttl_ms > 0 ? times.expires_ms : created_ms;
  timespec ts[2];
  ts[0].tv_sec = 0;
  ts[0].tv_nsec = UTIME_OMIT;
  ts[1].tv_sec = stamp / 1000;
  ts[1].tv_nsec = (stamp % 1000) * 1000000;
  if (m.ttl_ms > 0 && ::fchmod(file.fd(), kExpiringMode) != 0) return fail();
  if (::futimens(file.fd(), ts) != 0) return fail();
  if (file.finish() != 0) return fail();  // fsynced (disk_fsync) and closed
  // From here the shared count holds the bytes for the published file: were this process to
  // die before the publish, they would stay counted (never the reverse).
  m.lease->reserved.fetch_sub(bytes, std::memory_order_acq_rel);
  int err = file.publish(AtomicFile::Publish::kNoReplace);
  if (err == EEXIST) {
    // Another store wrote the chunk first; an expired file is replaced.
    struct stat st{};
    if (::stat(path.c_str(), &st) == 0 && m.expired(file_times(st), m.clock()) &&
        m.remove_file(path, "", st.st_ino)) {
      TierCounters::add(c.expired);
      err = file.publish(AtomicFile::Publish::kNoReplace);
    }
  }
  if (err != 0) {
    file.abandon();
    m.release(bytes);
    if (err != EEXIST) {
      TierCounters::add(c.errors);
      TierCounters::add(c.write_failures);
      return false;
    }
    return contains(key, fp);  // the other store's file (unless removed meanwhile)
  }
  std::lock_guard<std::mutex> lock(m.mu);
  m.index_locked(key, fp, bytes, times);
  TierCounters::add(c.writes);
  TierCounters::add(c.bytes_written, static_cast<int64_t>(total));
  return true;
}

bool DiskTier::erase_file(const Hash128& key, const Fingerprint& fp) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const bool removed = m.remove_file(m.path_of(key, fp));
  auto it = m.index.find(key);
  if (it != m.index.end()) m.drop_locked(it);
  return removed;
}

void DiskTier::invalidate(const Fingerprint& fp, InvalidateResult* r) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  int64_t removed = 0;
  m.walk(
      &fp, [&](const std::string& path, const Hash128&, const Fingerprint&) {
        removed += m.remove_file(path);
      },
      [](const std::string&, const std::string&) {});  // writes in flight publish later
  for (auto it = m.index.begin(); it != m.index.end();) {
    auto next = std::next(it);
    if (it->second.fp == fp) m.drop_locked(it);
    it = next;
  }
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
  m.walk(
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
        auto it = m.index.find(key);
        if (it != m.index.end()) m.drop_locked(it);
      },
      [](const std::string&, const std::string&) {});
  r->disk = removed;
}

int64_t DiskTier::clear() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  int64_t removed = 0;
  m.walk(
      nullptr,
      [&](const std::string& path, const Hash128&, const Fingerprint&) {
        removed += m.remove_file(path);
      },
      [](const std::string&, const std::string&) {});
  m.index.clear();
  m.order.clear();
  return removed;
}

int64_t DiskTier::bytes_used() const {
  return impl_->usage->used.load(std::memory_order_acquire);
}

int64_t DiskTier::entries() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->index.size());
}

int64_t DiskTier::capacity_bytes() const { return impl_->capacity; }

std::string DiskTier::quarantine_dir() const { return impl_->quarantine(); }

}  // namespace kvbridge::detail
