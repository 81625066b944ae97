// DiskTier's file I/O: reading and verifying an entry file, writing one (a temporary file
// published with a rename), and the directories and stats around them.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

#include "src/store/disk_tier_impl.h"

namespace kvbridge::detail {

using disk::FileTimes;
using disk::file_times;
using disk::kExpiringMode;
using disk::kFileMode;
using disk::make_dir;
using disk::read_full;
using disk::readv_full;
using disk::round_to_block;

bool DiskTier::Impl::ensure_dirs(const std::string& path, bool again) {
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

int DiskTier::Impl::open_temp(AtomicFile* file, const std::string& path) {
  AtomicFile::Options o;
  o.mode = kFileMode;
  o.fsync = fsync_files;
  o.fsync_dir = false;
  o.tag = usage.lease_id();
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

bool DiskTier::Impl::stat_file(const Hash128& key, const Fingerprint& fp, int64_t now) {
  const std::string path = layout.path_of(key, fp);
  struct stat st{};
  const bool exists = ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
  const FileTimes t = exists ? file_times(st) : FileTimes{};
  const bool young = exists && !expired(t, now);
  if (exists && !young && remove_file(path, "", st.st_ino))
    TierCounters::add(counters->expired);
  std::lock_guard<std::mutex> lock(mu);
  auto it = index.find(key);
  if (!young) {
    if (it != index.end()) index.drop(it);
  } else if (it == index.end()) {
    index.add(key, fp, round_to_block(st.st_size), t);
  }
  return young;
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
  const std::string path = m.layout.path_of(want.key, want.fingerprint);
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
      m.index.add(want.key, want.fingerprint, round_to_block(st.st_size), times);
    } else if (it->second.gen == gen) {
      m.index.touch(it, want.key);
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
  const std::string path = m.layout.path_of(key, fp);
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (bytes > m.capacity || !m.reserve_locked(bytes)) {
      TierCounters::add(c.write_failures);
      return false;
    }
  }
  // Reserved on the shared count and in this store's lease (which a recovery of this store,
  // should it die, takes back) until the file is published or abandoned.
  m.usage.lease_add(bytes);
  AtomicFile file;
  auto fail = [&] {
    file.abandon();
    m.usage.lease_sub(bytes);
    m.usage.release(bytes);
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
  m.usage.lease_sub(bytes);
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
    m.usage.release(bytes);
    if (err != EEXIST) {
      TierCounters::add(c.errors);
      TierCounters::add(c.write_failures);
      return false;
    }
    return contains(key, fp);  // the other store's file (unless removed meanwhile)
  }
  std::lock_guard<std::mutex> lock(m.mu);
  m.index.add(key, fp, bytes, times);
  TierCounters::add(c.writes);
  TierCounters::add(c.bytes_written, static_cast<int64_t>(total));
  return true;
}

}  // namespace kvbridge::detail
