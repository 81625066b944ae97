// The int8 storage format of a chunk entry (StorageFormat::kInt8, docs/storage.md).
//
// Payload of one chunk of T tokens, L layers, H KV heads, head dim D, in this order:
//   key scales    float32 [L, H, D]     one per channel: max over the chunk's tokens of |K| / 127
//   value scales  float32 [L, H, T]     one per token: max over the head's channels of |V| / 127
//   codes         int8    [L, 2, T, H, D]  round(x / scale), in [-127, 127]
// Bytes: 4*L*H*(D + T) + 2*L*T*H*D. Against the 4*L*T*H*D bytes of bfloat16 that is a ratio of
// 1/2 + 1/T + 1/D (float32 entries: half of that).
// Decoding gives q * scale, so every element is within scale / 2 of the stored value (plus the
// rounding of the float32 arithmetic and of the cast back to the entry's dtype).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvbridge/kv_view.h"

namespace kvbridge::detail {

/// Payload bytes of an int8 entry; 0 when the geometry overflows int64.
int64_t int8_payload_bytes(int64_t layers, int64_t tokens, int64_t kv_heads, int64_t head_dim);

/// Quantizes `src` (a CPU view of any dtype and strides, src.tokens() tokens) into `payload`
/// (int8_payload_bytes(...) bytes, 4-byte aligned, caller-owned). Throws InvalidArgument when
/// `src` holds a NaN or an infinity (there is no scale for them).
void quantize_int8(const KVView& src, char* payload);

/// Decodes tokens [begin, begin + dst.tokens()) of a payload that holds `tokens` tokens into
/// `dst` (a CPU view of the entry's geometry, any dtype and strides), rounding to dst's dtype.
void dequantize_int8(const char* payload, int64_t tokens, int64_t begin, const KVView& dst);

}  // namespace kvbridge::detail
