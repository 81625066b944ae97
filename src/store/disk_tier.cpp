#include "src/store/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <system_error>
#include <unordered_map>
#include <vector>

#include "kvbridge/error.h"
#include "src/core/xxh3.h"
#include "src/store/eviction_order.h"

namespace kvbridge::detail {
namespace {

constexpr char kRootName[] = "kvbridge-v1";
constexpr char kSuffix[] = ".kvb";
constexpr int64_t kBlock = 4096;
constexpr size_t kReadBlock = size_t{256} << 10;  // hashed while still in cache
constexpr int kMaxQuarantined = 64;

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

// Moves past the first `done` bytes of the iovecs after a short readv / writev.
void skip_done(iovec*& iov, int& count, size_t done) {
  while (count > 0 && done >= iov->iov_len) {
    done -= iov->iov_len;
    ++iov;
    --count;
  }
  if (count > 0) {
    iov->iov_base = static_cast<char*>(iov->iov_base) + done;
    iov->iov_len -= done;
  }
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

bool write_full(int fd, iovec* iov, int count) {
  while (count > 0) {
    const ssize_t w = ::writev(fd, iov, count);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return false;
    skip_done(iov, count, static_cast<size_t>(w));
  }
  return true;
}

struct Item {
  Fingerprint fp{};
  int64_t bytes = 0;  // accounted (rounded to 4 KiB)
  int64_t created_ms = 0;
  uint64_t gen = 0;   // changes whenever the file at this key is replaced
  EvictionOrder::Handle order;
};

}  // namespace

struct DiskTier::Impl {
  Impl(const StoreOptions& o, std::function<int64_t()> clk, TierCounters* c)
      : capacity(o.disk_capacity_bytes), fsync_files(o.disk_fsync),
        ttl_ms(o.ttl_seconds * 1000), clock(std::move(clk)), counters(c), order(o.eviction) {}

  const int64_t capacity;
  const bool fsync_files;
  const int64_t ttl_ms;
  std::function<int64_t()> clock;
  TierCounters* counters;
  std::string root;
  int lock_fd = -1;

  mutable std::mutex mu;
  std::unordered_map<Hash128, Item, HashOf> index;
  EvictionOrder order;
  int64_t used = 0;  // indexed files + reservations of writes in flight
  uint64_t next_gen = 0;
  uint64_t tmp_seq = 0;
  std::set<std::string> made_dirs;
  int quarantined = 0;

  std::string fp_dir(const Fingerprint& fp) const { return root + "/" + fingerprint_string(fp); }
  std::string path_of(const Hash128& key, const Fingerprint& fp) const {
    const std::string hex = key.hex();
    return fp_dir(fp) + "/" + hex.substr(0, 2) + "/" + hex + kSuffix;
  }
  std::string quarantine() const { return root + "/quarantine"; }

  // Removes an indexed item and its file. Caller holds mu.
  void drop_locked(std::unordered_map<Hash128, Item, HashOf>::iterator it) {
    ::unlink(path_of(it->first, it->second.fp).c_str());
    used -= it->second.bytes;
    order.erase(it->second.order);
    index.erase(it);
  }

  // Evicts until `bytes` more fit. Caller holds mu.
  bool make_room_locked(int64_t bytes) {
    while (used + bytes > capacity) {
      Hash128 victim;
      if (!order.find_coldest([&](const Hash128& k) {
            victim = k;
            return true;
          }))
        return false;
      drop_locked(index.find(victim));
      TierCounters::add(counters->evictions);
    }
    return true;
  }

  // Drops key's item if it is still generation `gen` (another write may have replaced it).
  void forget(const Hash128& key, uint64_t gen, bool quarantine_file) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = index.find(key);
    if (it == index.end() || it->second.gen != gen) return;
    if (quarantine_file) {
      const std::string to = quarantine() + "/" + key.hex() + "." + std::to_string(clock()) +
                             "." + std::to_string(++tmp_seq) + kSuffix;
      if (::rename(path_of(key, it->second.fp).c_str(), to.c_str()) != 0) {
        ::unlink(path_of(key, it->second.fp).c_str());
      } else if (++quarantined > kMaxQuarantined) {
        trim_quarantine_locked();
      }
      used -= it->second.bytes;
      order.erase(it->second.order);
      index.erase(it);
    } else {
      drop_locked(it);
    }
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

  bool ensure_dirs(const std::string& path) {
    // path = root/fp/xx/name: make root/fp and root/fp/xx.
    const size_t last = path.rfind('/');
    const std::string leaf_dir = path.substr(0, last);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (made_dirs.count(leaf_dir)) return true;
    }
    const std::string fp = leaf_dir.substr(0, leaf_dir.rfind('/'));
    if (!make_dir(fp) || !make_dir(leaf_dir)) return false;
    std::lock_guard<std::mutex> lock(mu);
    made_dirs.insert(leaf_dir);
    return true;
  }

  void open_root(const std::string& dir) {
    KVB_CHECK_AS(Unavailable, make_dir(dir),
                 "disk_dir '" << dir << "': cannot create: " << errno_text(errno));
    root = dir + "/" + kRootName;
    KVB_CHECK_AS(Unavailable, make_dir(root) && make_dir(quarantine()),
                 "disk_dir '" << dir << "': cannot create '" << root
                              << "': " << errno_text(errno));
    const std::string lock_path = root + "/LOCK";
    lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    KVB_CHECK_AS(Unavailable, lock_fd >= 0,
                 "disk_dir: cannot open '" << lock_path << "': " << errno_text(errno));
    if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(lock_fd);
      lock_fd = -1;
      KVB_CHECK_AS(Unavailable, false,
                   "disk_dir '" << dir << "' is in use by another live store ("
                                << errno_text(err) << ")");
    }
  }

  // One pass over the tree: indexes entry files, deletes temporary files left by writers that
  // died, then applies the TTL and the budget. Costs one readdir per directory and one stat
  // per file; no file is opened.
  void scan() {
    struct Found {
      int64_t mtime_ms;
      Hash128 key;
      Fingerprint fp;
      int64_t bytes;
    };
    std::vector<Found> found;
    for (const std::string& fp_name : list_dir(root)) {
      if (!is_hex(fp_name, 32)) continue;
      const Fingerprint fp = to_fingerprint(fp_name);
      for (const std::string& sub : list_dir(root + "/" + fp_name)) {
        if (!is_hex(sub, 2)) continue;
        const std::string dir = root + "/" + fp_name + "/" + sub;
        made_dirs.insert(dir);
        for (const std::string& name : list_dir(dir)) {
          const std::string path = dir + "/" + name;
          if (name.find(".tmp.") != std::string::npos) {
            ::unlink(path.c_str());  // a writer that died before its rename
            continue;
          }
          Hash128 key;
          if (name.size() != 32 + 4 || name.compare(32, 4, kSuffix) != 0 ||
              !parse_key_hex(name.substr(0, 32), &key) || name.compare(0, 2, sub) != 0)
            continue;
          struct stat st{};
          if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
          const int64_t mtime_ms = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 +
                                   st.st_mtim.tv_nsec / 1000000;
          found.push_back({mtime_ms, key, fp, round_to_block(st.st_size)});
        }
      }
    }
    quarantined = static_cast<int>(list_dir(quarantine()).size());
    // Oldest first, so the LRU order ends with the newest file most recent.
    std::sort(found.begin(), found.end(),
              [](const Found& a, const Found& b) { return a.mtime_ms < b.mtime_ms; });
    const int64_t now = clock();
    for (const Found& f : found) {
      if (ttl_ms > 0 && now - f.mtime_ms >= ttl_ms) {
        ::unlink(path_of(f.key, f.fp).c_str());
        TierCounters::add(counters->expired);
        continue;
      }
      Item item;
      item.fp = f.fp;
      item.bytes = f.bytes;
      item.created_ms = f.mtime_ms;
      item.gen = ++next_gen;
      item.order = order.insert(f.key, f.mtime_ms);
      used += f.bytes;
      index.emplace(f.key, item);
    }
    make_room_locked(0);  // a smaller budget than the last run's
  }
};

DiskTier::DiskTier(const StoreOptions& options, std::function<int64_t()> clock,
                   TierCounters* counters)
    : impl_(std::make_unique<Impl>(options, std::move(clock), counters)) {
  impl_->open_root(options.disk_dir);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->scan();
}

DiskTier::~DiskTier() {
  if (impl_->lock_fd >= 0) ::close(impl_->lock_fd);  // releases the flock
}

bool DiskTier::contains(const Hash128& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->index.count(key) != 0;
}

LoadResult DiskTier::load(const ExpectedEntry& want, char* payload, LoadedMeta* meta) {
  Impl& m = *impl_;
  TierCounters& c = *m.counters;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.index.find(want.key);
    if (it == m.index.end() || it->second.fp != want.fingerprint) {
      TierCounters::add(c.misses);
      return LoadResult::kMiss;
    }
    gen = it->second.gen;
  }
  const std::string path = m.path_of(want.key, want.fingerprint);
  auto miss = [&](std::atomic<int64_t>* reason, bool drop, bool quarantine) {
    if (reason) TierCounters::add(*reason);
    TierCounters::add(c.misses);
    if (drop) m.forget(want.key, gen, quarantine);
    return LoadResult::kMiss;
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    // ENOENT: removed behind the index's back (by hand); anything else is an I/O error. Either
    // way the index forgets the entry, so the next put of the chunk writes it again.
    return errno == ENOENT ? miss(nullptr, true, false) : miss(&c.errors, true, false);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0) return miss(&c.errors, true, false);
  const size_t total = static_cast<size_t>(st.st_size);
  // Few system calls: header and token ids in one read, then the payload in blocks (each
  // hashed while it is still in cache), the last one together with the trailer.
  const size_t prefix_bytes = entry_prefix_bytes(want.chunk);
  std::vector<unsigned char> prefix(prefix_bytes);
  if (total < prefix_bytes || !read_full(fd, prefix.data(), prefix_bytes))
    return total < prefix_bytes || !errno ? miss(&c.corrupt, true, true)
                                          : miss(&c.errors, true, false);
  EntryHeader h;
  try {
    h = decode_entry_header(prefix.data(), total);
  } catch (const Corrupt&) {
    return miss(&c.corrupt, true, true);
  }
  if (!header_fits(h, want)) return miss(&c.corrupt, true, true);

  Xxh3Stream hash;
  hash.update(prefix.data(), prefix_bytes);
  unsigned char trailer[kEntryTrailerBytes];
  const size_t n = static_cast<size_t>(h.payload_bytes);
  bool ok = true;
  for (size_t off = 0; ok && off < n; off += kReadBlock) {
    const size_t len = std::min(kReadBlock, n - off);
    if (off + len < n) {
      ok = read_full(fd, payload + off, len);
    } else {
      iovec iov[2] = {{payload + off, len}, {trailer, sizeof trailer}};
      ok = readv_full(fd, iov, 2);
    }
    if (ok) hash.update(payload + off, len);
  }
  if (!ok) return errno ? miss(&c.errors, true, false) : miss(&c.corrupt, true, true);
  if (hash.digest() != decode_trailer(trailer)) return miss(&c.corrupt, true, true);
  std::vector<uint32_t> tokens(static_cast<size_t>(h.chunk));
  std::memcpy(tokens.data(), prefix.data() + kEntryHeaderBytes, 4 * tokens.size());
  // Token ids were read as raw little-endian bytes.
  if constexpr (__BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__) {
    for (auto& t : tokens) t = __builtin_bswap32(t);
  }
  if (is_expired(h.created_ms, want)) return miss(&c.expired, true, false);
  TierCounters::add(c.bytes_read, static_cast<int64_t>(total));
  if (!same_chunk(h, tokens.data(), want)) {
    TierCounters::add(c.misses);
    return LoadResult::kCollision;
  }
  {
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.index.find(want.key);
    if (it != m.index.end() && it->second.gen == gen) m.order.touch(it->second.order, want.key);
  }
  *meta = LoadedMeta::of(h);
  return LoadResult::kHit;
}

bool DiskTier::store(const Hash128& key, const Fingerprint& fp, const unsigned char* prefix,
                     size_t prefix_bytes, const void* payload, size_t payload_bytes,
                     const Hash128& checksum, int64_t created_ms) {
  Impl& m = *impl_;
  TierCounters& c = *m.counters;
  const size_t total = prefix_bytes + payload_bytes + kEntryTrailerBytes;
  const int64_t bytes = round_to_block(static_cast<int64_t>(total));
  std::string tmp;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (bytes > m.capacity || !m.make_room_locked(bytes)) {
      TierCounters::add(c.write_failures);
      return false;
    }
    m.used += bytes;  // reserved until the file is indexed or abandoned
    tmp = m.path_of(key, fp) + ".tmp." + std::to_string(::getpid()) + "." +
          std::to_string(++m.tmp_seq);
  }
  const std::string path = m.path_of(key, fp);
  auto fail = [&](int fd) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    std::lock_guard<std::mutex> lock(m.mu);
    m.used -= bytes;
    TierCounters::add(c.errors);
    TierCounters::add(c.write_failures);
    return false;
  };
  if (!m.ensure_dirs(path)) return fail(-1);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return fail(-1);
  unsigned char trailer[kEntryTrailerBytes];
  encode_trailer(checksum, trailer);
  iovec iov[3] = {{const_cast<unsigned char*>(prefix), prefix_bytes},
                  {const_cast<void*>(payload), payload_bytes},
                  {trailer, sizeof trailer}};
  if (!write_full(fd, iov, 3)) return fail(fd);
  // mtime = creation time, so a later scan knows the entry's age without opening it.
  timespec times[2];
  times[0].tv_sec = 0;
  times[0].tv_nsec = UTIME_OMIT;
  times[1].tv_sec = created_ms / 1000;
  times[1].tv_nsec = (created_ms % 1000) * 1000000;
  if (::futimens(fd, times) != 0) return fail(fd);
  if (m.fsync_files && ::fsync(fd) != 0) return fail(fd);
  if (::close(fd) != 0) return fail(-1);
  std::lock_guard<std::mutex> lock(m.mu);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    m.used -= bytes;
    TierCounters::add(c.errors);
    TierCounters::add(c.write_failures);
    return false;
  }
  auto it = m.index.find(key);
  if (it != m.index.end()) {  // replaced an older file of the same key
    m.used -= it->second.bytes;
    m.order.erase(it->second.order);
    m.index.erase(it);
  }
  Item item;
  item.fp = fp;
  item.bytes = bytes;
  item.created_ms = created_ms;
  item.gen = ++m.next_gen;
  item.order = m.order.insert(key, created_ms);
  m.index.emplace(key, item);
  TierCounters::add(c.writes);
  TierCounters::add(c.bytes_written, static_cast<int64_t>(total));
  return true;
}

bool DiskTier::erase(const Hash128& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->index.find(key);
  if (it == impl_->index.end()) return false;
  impl_->drop_locked(it);
  return true;
}

int64_t DiskTier::invalidate(const Fingerprint& fp) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  int64_t removed = 0;
  for (auto it = m.index.begin(); it != m.index.end();) {
    auto next = std::next(it);
    if (it->second.fp == fp) {
      m.drop_locked(it);
      ++removed;
    }
    it = next;
  }
  // Best effort: the now empty directories.
  const std::string dir = m.fp_dir(fp);
  for (const std::string& sub : list_dir(dir)) {
    const std::string d = dir + "/" + sub;
    m.made_dirs.erase(d);
    ::rmdir(d.c_str());
  }
  ::rmdir(dir.c_str());
  return removed;
}

int64_t DiskTier::invalidate_adapter(const Fingerprint& fp, const Fingerprint& adapter) {
  Impl& m = *impl_;
  std::vector<Hash128> keys;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    for (const auto& [key, e] : m.index)
      if (e.fp == fp) keys.push_back(key);
  }
  int64_t removed = 0;
  for (const Hash128& key : keys) {
    Fingerprint field{};
    const int fd = ::open(m.path_of(key, fp).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    const ssize_t n = ::pread(fd, field.data(), field.size(), kEntryAdapterOffset);
    ::close(fd);
    if (n != static_cast<ssize_t>(field.size()) || field != adapter) continue;
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.index.find(key);
    if (it != m.index.end() && it->second.fp == fp) {
      m.drop_locked(it);
      ++removed;
    }
  }
  return removed;
}

int64_t DiskTier::clear() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const int64_t removed = static_cast<int64_t>(m.index.size());
  while (!m.index.empty()) m.drop_locked(m.index.begin());
  return removed;
}

int64_t DiskTier::bytes_used() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->used;
}

int64_t DiskTier::entries() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->index.size());
}

int64_t DiskTier::capacity_bytes() const { return impl_->capacity; }

std::string DiskTier::quarantine_dir() const { return impl_->quarantine(); }

}  // namespace kvbridge::detail
