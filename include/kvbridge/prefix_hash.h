// The prefix-hash index key: a chained XXH3-128 over fixed-size token chunks.
//
//   salt  = "kvbridge.prefix.v1" | u32le(len ns) ns | u32le(len fp) fp | u32le(len dt) dt
//   h_0   = XXH3_128(salt)
//   h_i   = XXH3_128(bytes16(h_{i-1}) | u32le(t) for each token t of chunk i)    (i >= 1)
//
// where ns is the namespace (tenant), fp the 32 hex digits of ModelSpec::fingerprint(), dt the
// dtype name ("bfloat16"), bytes16(h) is h.low64 then h.high64, each little-endian, and XXH3_128
// is XXH3_128bits with seed 0. Hex renderings print high64 then low64 (xxHash's canonical form).
// Only whole chunks are hashed. docs/hashing.md has worked vectors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/model_spec.h"

namespace kvbridge {

struct Hash128 {
  uint64_t low = 0;
  uint64_t high = 0;
  bool operator==(const Hash128& o) const noexcept { return low == o.low && high == o.high; }
  bool operator!=(const Hash128& o) const noexcept { return !(*this == o); }
  /// 32 lowercase hex digits, high64 first.
  std::string hex() const;
};

/// Token ids as the caller holds them. Ids must lie in [0, 2^32); the view does not own them.
struct TokenSpan {
  const int64_t* data = nullptr;
  size_t size = 0;
  TokenSpan() = default;
  TokenSpan(const int64_t* d, size_t n) : data(d), size(n) {}
  TokenSpan(const std::vector<int64_t>& v) : data(v.data()), size(v.size()) {}  // NOLINT
};

/// Throws InvalidArgument naming the first id outside [0, 2^32), or if `tokens` is empty.
void check_tokens(TokenSpan tokens);

/// h_0 for (namespace, spec). The spec must be valid.
Hash128 prefix_salt(std::string_view ns, const ModelSpec& spec);

/// h_1 .. h_n for the n = tokens.size / chunk_tokens whole chunks of `tokens`.
/// chunk_tokens > 0; tokens are checked with check_tokens.
std::vector<Hash128> prefix_hashes(const Hash128& salt, TokenSpan tokens, int64_t chunk_tokens);

/// One chain step: h_i from h_{i-1} and chunk i's `count` token ids (already checked).
Hash128 chain_hash(const Hash128& previous, const int64_t* chunk, int64_t count);

}  // namespace kvbridge
