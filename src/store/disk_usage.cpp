#include "src/store/disk_usage.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "kvbridge/error.h"
#include "src/store/disk_layout.h"

namespace kvbridge::detail::disk {
namespace {

constexpr char kUsageMagic[8] = {'K', 'V', 'B', 'U', 'S', 'A', 'G', 'E'};
constexpr char kLeaseMagic[8] = {'K', 'V', 'B', 'L', 'E', 'A', 'S', 'E'};
constexpr size_t kStateFileBytes = 4096;
constexpr char kLeaseSuffix[] = ".lease";

static_assert(std::atomic<int64_t>::is_always_lock_free,
              "the shared count needs a lock-free int64");

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

}  // namespace

// The count, at the start of USAGE. Lock-free atomics are address-free, so the processes'
// mappings of the same page agree.
struct SharedUsage::Count {
  char magic[8];
  uint32_t version;
  uint32_t unused;
  std::atomic<int64_t> used;
};
// One store's reservations of writes in flight, at the start of its lease file.
struct SharedUsage::Lease {
  char magic[8];
  std::atomic<int64_t> reserved;
};

SharedUsage::~SharedUsage() {
  if (lease_) {
    // Not in a forked child that inherited the store: the lease is its parent's.
    if (::getpid() == owner_pid_) ::unlink(lease_path_.c_str());
    ::munmap(lease_, kStateFileBytes);
  }
  if (lease_fd_ >= 0) ::close(lease_fd_);  // releases the lease's flock
  if (count_) ::munmap(count_, kStateFileBytes);
}

bool SharedUsage::map_count(const std::string& root) {
  const std::string usage_path = root + "/USAGE";
  const int usage_fd = ::open(usage_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  KVB_CHECK_AS(Unavailable, usage_fd >= 0,
               "disk_dir: cannot open '" << usage_path << "': " << errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } usage_closer{usage_fd};  // the mapping stays
  count_ = static_cast<Count*>(map_state(usage_fd, usage_path));
  const bool fresh = std::memcmp(count_->magic, kUsageMagic, 8) != 0;
  if (fresh) {
    count_->used.store(0);
    count_->version = 1;
    std::memcpy(count_->magic, kUsageMagic, 8);
  }
  return fresh;
}

void SharedUsage::take_lease(const std::string& stores_dir) {
  // The lease is made under a temporary name and renamed once locked, so a sweep never sees
  // an unlocked lease of a living store.
  stores_dir_ = stores_dir;
  lease_id_ = random_id();
  lease_path_ = stores_dir + "/" + lease_id_ + kLeaseSuffix;
  const std::string lease_tmp = stores_dir + "/" + lease_id_ + ".new";
  lease_fd_ = ::open(lease_tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  KVB_CHECK_AS(Unavailable, lease_fd_ >= 0,
               "disk_dir: cannot create '" << lease_tmp << "': " << errno_text(errno));
  KVB_CHECK_AS(Unavailable, ::flock(lease_fd_, LOCK_EX | LOCK_NB) == 0,
               "disk_dir: cannot lock '" << lease_tmp << "': " << errno_text(errno));
  lease_ = static_cast<Lease*>(map_state(lease_fd_, lease_tmp));
  lease_->reserved.store(0);
  std::memcpy(lease_->magic, kLeaseMagic, 8);
  KVB_CHECK_AS(Unavailable, ::rename(lease_tmp.c_str(), lease_path_.c_str()) == 0,
               "disk_dir: cannot create '" << lease_path_ << "': " << errno_text(errno));
}

bool SharedUsage::try_reserve(int64_t n, int64_t capacity) {
  int64_t cur = count_->used.load(std::memory_order_relaxed);
  do {
    if (cur + n > capacity) return false;
  } while (!count_->used.compare_exchange_weak(cur, cur + n, std::memory_order_acq_rel));
  return true;
}

void SharedUsage::release(int64_t n) { count_->used.fetch_sub(n, std::memory_order_acq_rel); }

int64_t SharedUsage::used() const { return count_->used.load(std::memory_order_acquire); }

void SharedUsage::set_used(int64_t n) { count_->used.store(n, std::memory_order_release); }

void SharedUsage::lease_add(int64_t n) {
  lease_->reserved.fetch_add(n, std::memory_order_acq_rel);
}

void SharedUsage::lease_sub(int64_t n) {
  lease_->reserved.fetch_sub(n, std::memory_order_acq_rel);
}

int SharedUsage::sweep(
    std::set<std::string>* live,
    const std::function<void(const std::set<std::string>& dead)>& remove_temps) {
  std::vector<std::pair<std::string, int>> dead;  // (id, fd holding its lock)
  for (const std::string& name : list_dir(stores_dir_)) {
    if (!ends_with(name, kLeaseSuffix)) continue;
    const std::string id = name.substr(0, name.size() - (sizeof kLeaseSuffix - 1));
    if (id == lease_id_) {
      if (live) live->insert(id);
      continue;
    }
    const int fd = ::open((stores_dir_ + "/" + name).c_str(), O_RDWR | O_CLOEXEC);
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
    remove_temps(ids);
  }
  for (const auto& [id, fd] : dead) {
    ::unlink((stores_dir_ + "/" + id + kLeaseSuffix).c_str());
    ::close(fd);
  }
  return static_cast<int>(dead.size());
}

}  // namespace kvbridge::detail::disk
