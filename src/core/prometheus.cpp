#include "src/core/prometheus.h"

#include <cmath>
#include <cstdio>

namespace kvbridge::detail {

void PrometheusText::family(std::string_view name, std::string_view type, std::string_view help) {
  text_.append("# HELP ").append(prefix_).append(name).append(" ").append(help).append("\n");
  text_.append("# TYPE ").append(prefix_).append(name).append(" ").append(type).append("\n");
}

void PrometheusText::sample(std::string_view name, std::string_view labels, double value) {
  char number[64];
  if (std::isnan(value)) {
    std::snprintf(number, sizeof number, "NaN");  // the exposition format's spellings
  } else if (std::isinf(value)) {
    std::snprintf(number, sizeof number, value > 0 ? "+Inf" : "-Inf");
  } else {
    std::snprintf(number, sizeof number, "%.17g", value);
  }
  text_.append(prefix_).append(name);
  if (!labels.empty()) text_.append("{").append(labels).append("}");
  text_.append(" ").append(number).append("\n");
}

std::string label_value(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace kvbridge::detail
