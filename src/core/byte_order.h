// Little-endian encoding of fixed-width integers and of Hash128 (low64 then high64): the byte
// order of every kvbridge format (chain-hash input, packed entries, safetensors length fields,
// fingerprint encodings), written once here. `p` points at 4, 8 or 16 writable / readable bytes.
#pragma once

#include <cstdint>

#include "kvbridge/hash128.h"

namespace kvbridge::detail {

inline void store_le32(unsigned char* p, uint32_t v) noexcept {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void store_le64(unsigned char* p, uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline uint32_t load_le32(const unsigned char* p) noexcept {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline uint64_t load_le64(const unsigned char* p) noexcept {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
/// 16 bytes: low64 then high64, each little-endian.
inline void store_hash(unsigned char* p, const Hash128& h) noexcept {
  store_le64(p, h.low);
  store_le64(p + 8, h.high);
}
inline Hash128 load_hash(const unsigned char* p) noexcept {
  return Hash128{load_le64(p), load_le64(p + 8)};
}

}  // namespace kvbridge::detail
