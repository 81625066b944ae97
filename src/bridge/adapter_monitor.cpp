#include "src/bridge/adapter_monitor.h"

#include <cmath>
#include <limits>

#include "kvbridge/error.h"

namespace kvbridge::detail {

namespace {

// Pooled figures of a check window.
struct Pooled {
  int64_t positions = 0, agreed = 0, loss_positions = 0;
  double kl_sum = 0, loss_gap_sum = 0;
  explicit Pooled(const std::deque<QualityCheck>& window) {
    for (const QualityCheck& c : window) {
      positions += c.positions;
      agreed += c.agreed;
      kl_sum += c.kl_sum;
      loss_positions += c.loss_positions;
      loss_gap_sum += c.loss_gap_sum;
    }
  }
  static double ratio(double num, int64_t den) {
    return den > 0 ? num / static_cast<double>(den) : std::numeric_limits<double>::quiet_NaN();
  }
  double agreement() const { return ratio(static_cast<double>(agreed), positions); }
};

}  // namespace

void AdapterMonitor::validate(const QualityCheck& check) {
  KVB_CHECK(check.positions > 0, "record_check: positions must be > 0, got " << check.positions);
  KVB_CHECK(check.agreed >= 0 && check.agreed <= check.positions,
            "record_check: agreed must lie in [0, positions = " << check.positions << "], got "
                                                                << check.agreed);
  KVB_CHECK(check.loss_positions >= 0 && check.loss_positions <= check.positions,
            "record_check: loss_positions must lie in [0, positions = "
                << check.positions << "], got " << check.loss_positions);
  KVB_CHECK(std::isfinite(check.kl_sum) && check.kl_sum >= 0,
            "record_check: kl_sum must be finite and >= 0, got " << check.kl_sum);
  KVB_CHECK(std::isfinite(check.loss_gap_sum),
            "record_check: loss_gap_sum must be finite, got " << check.loss_gap_sum);
}

bool AdapterMonitor::record(const QualityCheck& check, const BridgeOptions& options) {
  ++checks_;
  if (!enabled_) return false;
  window_.push_back(check);
  while (static_cast<int64_t>(window_.size()) > options.check_window) window_.pop_front();
  if (static_cast<int64_t>(window_.size()) < options.min_checks ||
      !(Pooled(window_).agreement() < options.min_agreement))
    return false;
  enabled_ = false;
  ++disables_;
  return true;
}

bool AdapterMonitor::disable() noexcept {
  const bool was = enabled_;
  enabled_ = false;
  return was;
}

void AdapterMonitor::enable() noexcept {
  enabled_ = true;
  window_.clear();
}

AdapterHealth AdapterMonitor::figures() const {
  const Pooled pooled(window_);
  AdapterHealth a;
  a.enabled = enabled_;
  a.checks = checks_;
  a.window_checks = static_cast<int64_t>(window_.size());
  a.window_positions = pooled.positions;
  a.agreement = pooled.agreement();
  a.kl = Pooled::ratio(pooled.kl_sum, pooled.positions);
  a.loss_gap = Pooled::ratio(pooled.loss_gap_sum, pooled.loss_positions);
  a.disables = disables_;
  return a;
}

}  // namespace kvbridge::detail
