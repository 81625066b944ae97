// Little-endian encoding of fixed-width integers and of Hash128 (low64 then high64): the byte
// order of every kvbridge format (chain-hash input, packed entries, safetensors length fields,
// fingerprint encodings), written once here. `p` points at 4, 8 or 16 writable / readable bytes.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvbridge/hash128.h"

namespace kvbridge::detail {

// On little-endian hosts a plain copy: GCC 12 does not always merge the byte loops below into
// one move, and the chain hash's 16-byte key then went through byte shifts and a stalled
// 16-byte reload on every step.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
inline constexpr bool kLittleEndianHost = true;
#else
inline constexpr bool kLittleEndianHost = false;
#endif

inline void store_le32(unsigned char* p, uint32_t v) noexcept {
  if constexpr (kLittleEndianHost) return static_cast<void>(std::memcpy(p, &v, 4));
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void store_le64(unsigned char* p, uint64_t v) noexcept {
  if constexpr (kLittleEndianHost) return static_cast<void>(std::memcpy(p, &v, 8));
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline uint32_t load_le32(const unsigned char* p) noexcept {
  uint32_t v = 0;
  if constexpr (kLittleEndianHost) {
    std::memcpy(&v, p, 4);
    return v;
  }
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline uint64_t load_le64(const unsigned char* p) noexcept {
  uint64_t v = 0;
  if constexpr (kLittleEndianHost) {
    std::memcpy(&v, p, 8);
    return v;
  }
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
