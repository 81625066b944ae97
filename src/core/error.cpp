#include "kvbridge/error.h"

#include <cstring>

namespace kvbridge {
namespace {
const char* basename_of(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
std::string with_location(const std::string& message, const char* file, int line) {
  return message + " [" + basename_of(file) + ":" + std::to_string(line) + "]";
}
}  // namespace

Error::Error(const std::string& message, const char* file, int line)
    : std::runtime_error(with_location(message, file, line)),
      message_(message),
      file_(file),
      line_(line) {}

}  // namespace kvbridge
