// libFuzzer target: the packed store entry (src/store/entry_codec.cpp) as the Redis tier reads
// it (load_value: header, geometry, checksum, TTL, tokens). The lookup is built from the decoded
// header itself, so inputs with a valid header reach the payload copy and checksum; those
// with a valid checksum reach the token comparison. Must never crash, overread or throw.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvbridge/error.h"
#include "src/store/entry_codec.h"
#include "src/store/redis_tier.h"

using namespace kvbridge;
using namespace kvbridge::detail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The header decoder alone: Corrupt or a header that describes exactly `size` bytes.
  EntryHeader h;
  bool valid = false;
  if (size >= kEntryHeaderBytes) {
    try {
      h = decode_entry_header(data, size);
      valid = true;
      if (entry_encoded_bytes(h.geometry.chunk, h.geometry.payload_bytes) != size)
        __builtin_trap();
    } catch (const Corrupt&) {
    }
  }
  ExpectedEntry want;
  std::vector<uint32_t> tokens;
  if (valid) {
    want.key = h.key;
    want.parent = h.parent;
    want.salt = h.salt;
    want.fingerprint = h.fingerprint;
    want.geometry = h.geometry;
    tokens.resize(static_cast<size_t>(h.geometry.chunk));
    for (size_t i = 0; i < tokens.size(); ++i) {
      uint32_t t;
      std::memcpy(&t, data + kEntryHeaderBytes + 4 * i, 4);
      tokens[i] = (i % 7 == 3) ? t ^ 1u : t;  // some lookups collide
    }
    want.tokens = tokens.data();
    want.now_ms = h.created_ms + 5;
    want.ttl_ms = (size % 3 == 0) ? 4 : 0;
  } else {
    // A lookup the input cannot match: every path must still be a counted miss.
    ChunkGeometry& g = want.geometry;
    g.layers = g.chunk = g.kv_heads = g.head_dim = 1;
    g.payload_bytes = 8;
    static const uint32_t one = 1;
    want.tokens = &one;
  }
  std::vector<char> payload(static_cast<size_t>(want.geometry.payload_bytes));
  TierCounters counters;
  LoadedMeta meta;
  bool drop = false;
  const LoadResult r = load_value(data, size, want, payload.data(), &meta, &counters, &drop);
  if (r == LoadResult::kHit &&
      (!valid || meta.created_ms != h.created_ms || !(meta.provenance == h.provenance)))
    __builtin_trap();
  if (r != LoadResult::kHit && counters.misses.load() == 0) __builtin_trap();  // counted
  return 0;
}
