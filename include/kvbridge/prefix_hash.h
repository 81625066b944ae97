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

#include "kvbridge/hash128.h"
#include "kvbridge/model_spec.h"

namespace kvbridge {

/// Token ids as the caller holds them, either int64 (`data`; each id must lie in [0, 2^32), which
/// the library checks) or uint32 (`data32`; every value is a valid id). Exactly one of the two
/// pointers is set when size > 0. The view does not own the ids.
struct TokenSpan {
  const int64_t* data = nullptr;
  const uint32_t* data32 = nullptr;
  size_t size = 0;
  TokenSpan() = default;
  TokenSpan(const int64_t* d, size_t n) : data(d), size(n) {}
  TokenSpan(const uint32_t* d, size_t n) : data32(d), size(n) {}
  TokenSpan(const std::vector<int64_t>& v) : data(v.data()), size(v.size()) {}    // NOLINT
  TokenSpan(const std::vector<uint32_t>& v) : data32(v.data()), size(v.size()) {}  // NOLINT
  /// The first n ids (n <= size).
  TokenSpan first(size_t n) const {
    TokenSpan s = *this;
    s.size = n < size ? n : size;
    return s;
  }
};

/// Throws InvalidArgument naming the first id outside [0, 2^32), or if `tokens` is empty.
void check_tokens(TokenSpan tokens);

/// Throws InvalidArgument "tokens[index] = value is outside the token id range [0, 2^32)": the
/// one wording of a bad id, for converters of ids held in other forms (`value` as text, since it
/// may not fit in 64 bits).
[[noreturn]] void throw_token_out_of_range(size_t index, std::string_view value);

/// h_0 for (namespace, spec). The spec must be valid.
Hash128 prefix_salt(std::string_view ns, const ModelSpec& spec);

/// h_1 .. h_n for the n = tokens.size / chunk_tokens whole chunks of `tokens`.
/// chunk_tokens > 0; tokens are checked with check_tokens.
std::vector<Hash128> prefix_hashes(const Hash128& salt, TokenSpan tokens, int64_t chunk_tokens);

/// One chain step: h_i from h_{i-1} and chunk i's `count` token ids (already checked).
Hash128 chain_hash(const Hash128& previous, const uint32_t* chunk, int64_t count);
Hash128 chain_hash(const Hash128& previous, const int64_t* chunk, int64_t count);

}  // namespace kvbridge
