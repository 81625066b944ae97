// The one Prometheus text writer (exposition format 0.0.4) of the store's and the bridge's
// metrics: a family header (# HELP, # TYPE) and its samples, every name under one prefix,
// numbers as %.17g (integers below 2^53 print exactly; NaN and infinities as NaN, +Inf, -Inf).
#pragma once

#include <string>
#include <utility>
#include <string_view>

namespace kvbridge::detail {

class PrometheusText {
 public:
  /// `prefix` starts every metric name, e.g. "kvbridge_store_".
  explicit PrometheusText(std::string prefix) : prefix_(std::move(prefix)) {}

  /// # HELP and # TYPE lines of the family `name`; `type` is counter, gauge or histogram.
  void family(std::string_view name, std::string_view type, std::string_view help);
  /// One sample line: name, {labels} when not empty (e.g. tier="disk"), value.
  void sample(std::string_view name, std::string_view labels, double value);
  /// A family with one unlabelled sample.
  void single(std::string_view name, std::string_view type, std::string_view help, double value) {
    family(name, type, help);
    sample(name, "", value);
  }

  const std::string& text() const noexcept { return text_; }

 private:
  std::string prefix_;
  std::string text_;
};

/// `v` escaped for use inside a label value's double quotes (backslash, quote, newline).
std::string label_value(std::string_view v);

/// One row of a stats field table (store_stats.h, bridge.h: X(type, member, metric, kind, help)) as
/// an unlabelled family; rows without a metric name or of kind none are not exported.
inline void emit_row(PrometheusText& out, const char* metric, const char* kind, const char* help,
                     double value) {
  if (metric[0] == '\0' || std::string_view(kind) == "none") return;
  out.single(metric, kind, help, value);
}

}  // namespace kvbridge::detail
