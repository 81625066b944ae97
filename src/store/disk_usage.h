// The disk tier's byte count, shared by every store that has the directory open (any process),
// and each store's lease (docs/storage.md, "One directory, many processes"):
//   kvbridge-v1/USAGE                the count of the whole directory's file blocks, mapped
//   kvbridge-v1/stores/<id>.lease    one store's reservations of writes in flight, flock()ed
//                                    while the store lives
// A store that dies leaves its lease unlocked; a sweep takes its reservations off the count.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <set>
#include <string>

namespace kvbridge::detail::disk {

class SharedUsage {
 public:
  SharedUsage() = default;
  ~SharedUsage();
  SharedUsage(const SharedUsage&) = delete;
  SharedUsage& operator=(const SharedUsage&) = delete;

  /// Maps <root>/USAGE (creating it); true when it was new (its count starts at 0). Throws
  /// Unavailable.
  bool map_count(const std::string& root);
  /// Creates, locks and maps this store's lease in `stores_dir`. Throws Unavailable.
  void take_lease(const std::string& stores_dir);
  const std::string& lease_id() const { return lease_id_; }

  /// Adds n to the count unless that passes `capacity`; false then.
  bool try_reserve(int64_t n, int64_t capacity);
  void release(int64_t n);
  int64_t used() const;
  /// Sets the count (a store that has the directory alone recounts it from the files).
  void set_used(int64_t n);
  /// This store's reservations in flight (what a sweep takes back should it die).
  void lease_add(int64_t n);
  void lease_sub(int64_t n);

  /// Recovers every store that died with the directory open (its lease is not flock()ed): its
  /// reservations leave the count, `remove_temps` (when set) gets the dead stores' ids to delete
  /// their temporary files, its lease file is removed. Fills `live` with the ids of living
  /// stores (this one included). Returns how many dead stores it recovered.
  int sweep(std::set<std::string>* live,
            const std::function<void(const std::set<std::string>& dead)>& remove_temps);

 private:
  struct Count;
  struct Lease;
  std::string stores_dir_;
  Count* count_ = nullptr;
  Lease* lease_ = nullptr;
  int lease_fd_ = -1;
  std::string lease_id_, lease_path_;
  const pid_t owner_pid_ = ::getpid();
};

}  // namespace kvbridge::detail::disk
