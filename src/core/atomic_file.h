// A file written so that a reader of its path sees the old file (or none) or the whole new one,
// never a part: the bytes go to a temporary file beside the path, which is renamed onto it once
// complete. Used by the disk tier (one file per entry, published without replacing) and the
// safetensors writer (adapter files, replaced).
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <string>

namespace kvbridge::detail {

class AtomicFile {
 public:
  struct Options {
    mode_t mode = 0644;
    /// fsync the file before it is published (its contents survive a power loss).
    bool fsync = true;
    /// fsync the directory after the publish (the new name survives a power loss); best effort:
    /// some file systems cannot fsync a directory.
    bool fsync_dir = true;
    /// The temporary file is `<path>.tmp.<tag>.<n>`, n counted per process, so that a tool
    /// cleaning up after a dead writer can tell whose it is. Empty: the process id and a random
    /// word. Must not contain '/'.
    std::string tag;
  };

  enum class Publish {
    kReplace,    // rename over whatever file is at the path
    kNoReplace,  // fail with EEXIST when a file is at the path (renameat2 RENAME_NOREPLACE,
                 // or link() + unlink() where the file system lacks it)
  };

  AtomicFile() = default;
  /// Abandons the temporary file unless it was published.
  ~AtomicFile();
  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // --- Without exceptions: each returns 0 or the errno of the call that failed. -------------

  /// Creates a new, unique temporary file for `path` (O_EXCL: never one another writer uses).
  /// The directory must exist (ENOENT otherwise). On failure the object stays closed.
  int open(const std::string& path, const Options& options) noexcept;
  /// Writes all the bytes (retrying short writes and EINTR).
  int write(const void* data, size_t size) noexcept;
  int writev(const iovec* iov, int count) noexcept;
  /// fsyncs (when Options::fsync) and closes the temporary file; publish() does it when not
  /// done yet. Separate for callers that need the file closed before deciding to publish.
  int finish() noexcept;
  /// Publishes the temporary file at the path. On failure (EEXIST: a file exists, under
  /// kNoReplace) the temporary file is kept for another publish() until abandon().
  int publish(Publish how) noexcept;
  /// Closes and removes the temporary file (nothing once published).
  void abandon() noexcept;

  // --- With exceptions: Unavailable naming `what` (the caller's operation) and the path. ----

  /// open(), throwing.
  static AtomicFile create(const std::string& path, const Options& options, const char* what);
  void write_or_throw(const void* data, size_t size, const char* what);
  /// publish(kReplace), throwing.
  void commit(const char* what);

  /// The temporary file's descriptor while open (-1 after finish()), e.g. for futimens.
  int fd() const noexcept { return fd_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& temp_path() const noexcept { return temp_; }
  bool published() const noexcept { return published_; }

 private:
  void reset() noexcept;

  std::string path_, temp_;
  int fd_ = -1;
  bool fsync_ = true, fsync_dir_ = true;
  bool open_ = false;  // a temporary file exists (possibly closed)
  bool published_ = false;
};

/// "Cannot <what> '<path>': <errno text>", for the throwing forms and callers' own messages.
std::string atomic_file_error(const char* what, const std::string& path, int err);

/// Moves `iov` / `count` past the first `done` bytes after a short readv or writev (the disk
/// tier's reads use it too).
void skip_done(iovec*& iov, int& count, size_t done);

}  // namespace kvbridge::detail
