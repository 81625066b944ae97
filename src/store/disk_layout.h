// The disk tier's directory tree and its files (disk_tier.h has the layout):
//   <dir>/kvbridge-v1/<fingerprint>/<first two hex digits of the key>/<key hex>.kvb
// with the shared state beside the fingerprints (LOCK, USAGE, stores/, quarantine/); how a file
// records its age; the tree walk; file-level I/O helpers.
#pragma once

#include <sys/stat.h>
#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include "src/store/entry_codec.h"

namespace kvbridge::detail::disk {

constexpr char kRootName[] = "kvbridge-v1";
constexpr char kSuffix[] = ".kvb";
constexpr char kTmpMark[] = ".tmp.";  // AtomicFile's temporary names: <path>.tmp.<tag>.<n>
constexpr int64_t kBlock = 4096;      // files are accounted in blocks of this many bytes

inline int64_t round_to_block(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

std::string errno_text(int err);
/// Whether s is n lowercase hex digits.
bool is_hex(const std::string& s, size_t n);
bool parse_key_hex(const std::string& s, Hash128* out);
/// The names in dir, without "." and ".."; empty when it cannot be read.
std::vector<std::string> list_dir(const std::string& dir);
/// mkdir 0755; true when the directory exists afterwards.
bool make_dir(const std::string& path);
bool ends_with(const std::string& s, const std::string& suffix);
/// The lease id in a temporary file's name <key hex>.kvb.tmp.<id>.<n> ("" if none).
std::string temp_owner(const std::string& name);
int64_t steady_ms();

/// Reads exactly n bytes; false on EOF or error (errno set, 0 for EOF).
bool read_full(int fd, void* buf, size_t n);
/// Reads exactly the iovecs' bytes; false on EOF (errno 0) or error.
bool readv_full(int fd, iovec* iov, int count);

// An entry put under a TTL records its expiry in its file: the sticky bit (which Linux ignores
// on regular files) says that the mtime is the expiry time; without it the mtime is the
// creation time.
constexpr mode_t kFileMode = 0644;
constexpr mode_t kExpiringMode = 0644 | S_ISVTX;

/// What a file's metadata says about its age: -1 / 0 when unknown / none.
struct FileTimes {
  int64_t created_ms = -1;
  int64_t expires_ms = 0;
  int64_t order_ms() const { return created_ms >= 0 ? created_ms : expires_ms; }
};
FileTimes file_times(const struct stat& st);

/// The paths of one directory's tree.
struct Layout {
  std::string root;  // <dir>/kvbridge-v1

  std::string fp_dir(const Fingerprint& fp) const { return root + "/" + fingerprint_string(fp); }
  std::string path_of(const Hash128& key, const Fingerprint& fp) const {
    const std::string hex = key.hex();
    return fp_dir(fp) + "/" + hex.substr(0, 2) + "/" + hex + kSuffix;
  }
  std::string quarantine() const { return root + "/quarantine"; }
  std::string stores_dir() const { return root + "/stores"; }

  /// Calls entry(path, key, fp) for every entry file and temp(path, name) for every temporary
  /// file, under every fingerprint directory or only under `only`'s.
  template <class Entry, class Temp>
  void walk(const Fingerprint* only, Entry&& entry, Temp&& temp) const;
};

template <class Entry, class Temp>
void Layout::walk(const Fingerprint* only, Entry&& entry, Temp&& temp) const {
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

}  // namespace kvbridge::detail::disk
