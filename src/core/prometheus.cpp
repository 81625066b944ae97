#include "src/core/prometheus.h"

#include <cstdio>

namespace kvbridge::detail {

void PrometheusText::family(std::string_view name, std::string_view type, std::string_view help) {
  text_.append("# HELP ").append(prefix_).append(name).append(" ").append(help).append("\n");
  text_.append("# TYPE ").append(prefix_).append(name).append(" ").append(type).append("\n");
}

void PrometheusText::sample(std::string_view name, std::string_view labels, double value) {
  char number[64];
  std::snprintf(number, sizeof number, "%.17g", value);
  text_.append(prefix_).append(name);
  if (!labels.empty()) text_.append("{").append(labels).append("}");
  text_.append(" ").append(number).append("\n");
}

}  // namespace kvbridge::detail
