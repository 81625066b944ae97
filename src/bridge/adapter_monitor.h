// One registered adapter's quality monitoring (bridge_health.h): whether it is enabled, its
// rolling window of quality checks, and the agreement floor that disables it.
#pragma once

#include <cstdint>
#include <deque>

#include "kvbridge/bridge_health.h"
#include "kvbridge/bridge_options.h"

namespace kvbridge::detail {

/// Not synchronised: the Bridge guards each monitor with its registry mutex.
class AdapterMonitor {
 public:
  /// Throws InvalidArgument for a check out of range (Bridge::record_check's contract).
  static void validate(const QualityCheck& check);

  bool enabled() const noexcept { return enabled_; }

  /// Counts `check`. While enabled, adds it to the window (the last options.check_window
  /// checks) and returns true when the window now holds at least options.min_checks checks
  /// whose pooled agreement is below options.min_agreement: the monitor is then disabled and
  /// the disable counted. A disabled monitor only counts the check.
  bool record(const QualityCheck& check, const BridgeOptions& options);

  /// Disables; true when it was enabled.
  bool disable() noexcept;
  /// Re-enables with an empty window.
  void enable() noexcept;

  /// The figures of AdapterHealth (its names, adapter/source/target, left empty).
  AdapterHealth figures() const;

 private:
  bool enabled_ = true;
  std::deque<QualityCheck> window_;
  int64_t checks_ = 0, disables_ = 0;
};

}  // namespace kvbridge::detail
