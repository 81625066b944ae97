// Hash128: the 128-bit XXH3 digest every kvbridge key and checksum is made of (prefix-hash
// chain keys, entry and adapter checksums). A value type; no ownership.
#pragma once

#include <cstdint>
#include <string>

namespace kvbridge {

struct Hash128 {
  uint64_t low = 0;
  uint64_t high = 0;
  bool operator==(const Hash128& o) const noexcept { return low == o.low && high == o.high; }
  bool operator!=(const Hash128& o) const noexcept { return !(*this == o); }
  /// 32 lowercase hex digits, high64 first.
  std::string hex() const;
};

}  // namespace kvbridge
