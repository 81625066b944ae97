// Consecutive chain steps (prefix_hash.h's h_i) for the store's lookups.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvbridge/hash128.h"

namespace kvbridge::detail {

/// out[i] = chain_hash(out[i - 1], ids + i * chunk, chunk) for i in [0, n), with out[-1] =
/// previous. The running hash stays in registers: reloading it from where the last step stored
/// it stalled every step on store forwarding.
void chain_hashes(Hash128 previous, const uint32_t* ids, int64_t chunk, size_t n, Hash128* out);

}  // namespace kvbridge::detail
