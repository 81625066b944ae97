#include "src/store/disk_layout.h"

#include <dirent.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <system_error>

#include "src/core/atomic_file.h"

namespace kvbridge::detail::disk {

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

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string temp_owner(const std::string& name) {
  const size_t at = name.find(kTmpMark);
  if (at == std::string::npos) return "";
  const size_t begin = at + sizeof kTmpMark - 1;
  const size_t end = name.find('.', begin);
  return end == std::string::npos ? "" : name.substr(begin, end - begin);
}

int64_t steady_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

namespace {

int64_t mtime_ms(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000;
}

}  // namespace

FileTimes file_times(const struct stat& st) {
  FileTimes t;
  if (st.st_mode & S_ISVTX) {
    t.expires_ms = mtime_ms(st);
  } else {
    t.created_ms = mtime_ms(st);
  }
  return t;
}

}  // namespace kvbridge::detail::disk
