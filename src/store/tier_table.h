// The store's one table of tiers: each row names a tier (StoreTierInfo: name, mask bit, stats
// section), says whether StoreOptions turns it on and makes it. KVStore's constructor, stats(),
// metrics_text(), erase() and clear(), and the Python bindings (through store_tiers()) iterate
// it; a new tier is its LowerTier class and one row here (docs/architecture.md).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "kvbridge/kv_store.h"
#include "src/store/tier.h"

namespace kvbridge::detail {

struct TierKind {
  StoreTierInfo info;
  /// Whether `options` turn the tier on (its settings' location is set); null for memory,
  /// which is always on.
  bool (*enabled)(const StoreOptions& options);
  /// Checks the tier's settings and opens it (throws as KVStore's constructor documents);
  /// `clock` is the store's. Null for memory, which is not a LowerTier.
  std::unique_ptr<LowerTier> (*make)(const StoreOptions& options,
                                     const std::function<int64_t()>& clock);
};

/// Memory first, then the lower tiers in the order match() walks them (each one's slot() is its
/// place among those a store has on).
const std::vector<TierKind>& tier_kinds();

}  // namespace kvbridge::detail
