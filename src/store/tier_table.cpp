#include "src/store/tier_table.h"

#include "kvbridge/error.h"
#include "src/core/path_check.h"
#include "src/store/disk_tier.h"
#include "src/store/redis_tier.h"

namespace kvbridge {
namespace detail {

const std::vector<TierKind>& tier_kinds() {
  static const std::vector<TierKind> kinds = {
      {{"memory", kMemoryTier, &StoreStats::memory}, nullptr, nullptr},
      {{"disk", kDiskTier, &StoreStats::disk},
       [](const StoreOptions& o) { return o.disk.enabled(); },
       [](const StoreOptions& o, const std::function<int64_t()>& clock) {
         KVB_CHECK(o.disk.capacity_bytes > 0,
                   "disk_capacity_bytes must be > 0, got " << o.disk.capacity_bytes);
         check_path(o.disk.dir, "disk_dir");
         return std::unique_ptr<LowerTier>(std::make_unique<DiskTier>(o, clock));
       }},
      {{"redis", kRedisTier, &StoreStats::redis},
       [](const StoreOptions& o) { return o.redis.enabled(); },
       [](const StoreOptions& o, const std::function<int64_t()>&) {
         return std::unique_ptr<LowerTier>(std::make_unique<RedisTier>(o));
       }},
  };
  return kinds;
}

}  // namespace detail

const std::vector<StoreTierInfo>& store_tiers() {
  static const std::vector<StoreTierInfo> infos = [] {
    std::vector<StoreTierInfo> v;
    for (const detail::TierKind& k : detail::tier_kinds()) v.push_back(k.info);
    return v;
  }();
  return infos;
}

}  // namespace kvbridge
