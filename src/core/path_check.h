// The one check of a file system path taken from a caller: the system calls read it as a C
// string, so a NUL byte would silently cut it short ("a\0x" would open "a").
#pragma once

#include <string>
#include <string_view>

#include "kvbridge/error.h"

namespace kvbridge::detail {

/// Throws InvalidArgument naming `what` when `path` is empty or holds a NUL byte.
inline void check_path(std::string_view path, const char* what) {
  KVB_CHECK(!path.empty(), what << " must not be empty");
  KVB_CHECK(path.find('\0') == std::string_view::npos,
            what << " holds a NUL byte at offset " << path.find('\0')
                 << " (paths are C strings: it would be cut short there)");
}

}  // namespace kvbridge::detail
