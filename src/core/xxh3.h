// The one place that includes xxHash (inlined, so neither the library nor its users link it).
#pragma once

#include <cstddef>

#include "kvbridge/prefix_hash.h"

namespace kvbridge::detail {
Hash128 xxh3_128(const void* data, size_t size) noexcept;
}  // namespace kvbridge::detail
