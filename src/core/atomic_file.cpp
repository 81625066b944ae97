#include "src/core/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <random>
#include <sstream>
#include <system_error>
#include <utility>

#include "kvbridge/error.h"

namespace kvbridge::detail {
namespace {

std::atomic<uint64_t> temp_counter{0};

// The default tag: this process's id and a random word, drawn once per process (a pid alone
// repeats across hosts sharing a directory, and across pid namespaces).
std::string default_tag() {
  static const uint32_t word = [] {
    std::random_device rd;
    return static_cast<uint32_t>(rd());
  }();
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld-%08x", static_cast<long>(::getpid()), word);
  return buf;
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

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

std::string atomic_file_error(const char* what, const std::string& path, int err) {
  std::ostringstream s;
  s << "cannot " << what << " '" << path << "': "
    << std::error_code(err, std::generic_category()).message();
  return s.str();
}

AtomicFile::~AtomicFile() { abandon(); }

AtomicFile::AtomicFile(AtomicFile&& other) noexcept { *this = std::move(other); }

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    abandon();
    path_ = std::move(other.path_);
    temp_ = std::move(other.temp_);
    fd_ = other.fd_;
    fsync_ = other.fsync_;
    fsync_dir_ = other.fsync_dir_;
    open_ = other.open_;
    published_ = other.published_;
    other.reset();
  }
  return *this;
}

void AtomicFile::reset() noexcept {
  fd_ = -1;
  open_ = false;
  published_ = false;
}

int AtomicFile::open(const std::string& path, const Options& options) noexcept {
  abandon();
  try {
    path_ = path;
    const std::string base = path + ".tmp." + (options.tag.empty() ? default_tag() : options.tag);
    fsync_ = options.fsync;
    fsync_dir_ = options.fsync_dir;
    published_ = false;
    // O_EXCL: a name in use (a leftover of a writer that died) is skipped, never shared.
    for (int attempt = 0; attempt < 16; ++attempt) {
      temp_ = base + "." + std::to_string(temp_counter.fetch_add(1, std::memory_order_relaxed));
      int fd;
      do {
        fd = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, options.mode);
      } while (fd < 0 && errno == EINTR);
      if (fd >= 0) {
        fd_ = fd;
        open_ = true;
        return 0;
      }
      if (errno != EEXIST) return errno;
    }
    return EEXIST;
  } catch (...) {  // std::bad_alloc from the names
    return ENOMEM;
  }
}

int AtomicFile::write(const void* data, size_t size) noexcept {
  iovec iov{const_cast<void*>(data), size};
  return writev(&iov, 1);
}

int AtomicFile::writev(const iovec* iov_in, int count) noexcept {
  if (fd_ < 0) return EBADF;
  iovec local[16];
  if (count > 16) return EINVAL;
  for (int i = 0; i < count; ++i) local[i] = iov_in[i];
  iovec* iov = local;
  while (count > 0) {
    const ssize_t w = ::writev(fd_, iov, count);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    skip_done(iov, count, static_cast<size_t>(w));
  }
  return 0;
}

int AtomicFile::finish() noexcept {
  if (!open_) return EBADF;
  if (fd_ < 0) return 0;
  const int fd = fd_;
  fd_ = -1;
  if (fsync_ && ::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return err;
  }
  return ::close(fd) == 0 ? 0 : errno;
}

int AtomicFile::publish(Publish how) noexcept {
  if (published_) return 0;
  if (const int err = finish()) return err;
  if (how == Publish::kReplace) {
    if (::rename(temp_.c_str(), path_.c_str()) != 0) return errno;
  } else if (::renameat2(AT_FDCWD, temp_.c_str(), AT_FDCWD, path_.c_str(), RENAME_NOREPLACE) !=
             0) {
    const int err = errno;
    if (err != EINVAL && err != ENOSYS && err != ENOTSUP && err != EOPNOTSUPP) return err;
    // No RENAME_NOREPLACE here: a hard link fails with EEXIST just the same.
    if (::link(temp_.c_str(), path_.c_str()) != 0) return errno;
    ::unlink(temp_.c_str());
  }
  published_ = true;
  open_ = false;
  if (fsync_dir_) {
    try {
      const int dir = ::open(parent_dir(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (dir >= 0) {
        (void)::fsync(dir);
        ::close(dir);
      }
    } catch (...) {  // the name is published; only its durability is best effort
    }
  }
  return 0;
}

void AtomicFile::abandon() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (open_ && !published_) ::unlink(temp_.c_str());
  open_ = false;
}

AtomicFile AtomicFile::create(const std::string& path, const Options& options, const char* what) {
  AtomicFile f;
  const int err = f.open(path, options);
  KVB_CHECK_AS(Unavailable, err == 0,
               what << ": " << atomic_file_error("create a temporary file for", path, err));
  return f;
}

void AtomicFile::write_or_throw(const void* data, size_t size, const char* what) {
  const int err = write(data, size);
  if (err != 0) {
    const std::string temp = temp_;
    abandon();
    KVB_CHECK_AS(Unavailable, false, what << ": " << atomic_file_error("write", temp, err));
  }
}

void AtomicFile::commit(const char* what) {
  const int err = publish(Publish::kReplace);
  if (err != 0) {
    const std::string temp = temp_;
    abandon();
    KVB_CHECK_AS(Unavailable, false,
                 what << ": " << atomic_file_error("publish", temp, err) << " as '" << path_
                      << "'");
  }
}

}  // namespace kvbridge::detail
