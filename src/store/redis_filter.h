// The Redis tier's Bloom filter (docs/storage.md, "Redis filter"): the layout of the shared
// value <prefix>:v1:filter, the server-side script that adds a put's bits, and the local copy
// lookups are answered from. Thread-safe: a copy's bits are atomics (local puts add to it).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvbridge/hash128.h"

namespace kvbridge::detail {

// The shared filter's value: an 8-byte header, then 2^log2_bits bits (Redis bit order: bit 0 is
// the most significant bit of the first byte). Header: "KVBF", version 1, probes k, log2 of the
// bit count, ready flag (1 once every key present when it was created has been added).
constexpr char kFilterMagic[4] = {'K', 'V', 'B', 'F'};
constexpr size_t kFilterHeader = 8;
constexpr int kFilterMinLog2 = 10;
constexpr int kFilterMaxLog2 = 31;  // Redis bit offsets stay below 2^32
constexpr double kFilterMaxFill = 0.5;  // above this the filter is rebuilt from the keys

// Adds the bits of each (h1, h2) pair in ARGV when the filter exists (never creates it, so a
// missing filter stays missing until a rebuild that scans every key).
inline constexpr char kAddScript[] =
    "local h = redis.call('GETRANGE', KEYS[1], 0, 7)\n"
    "if #h < 8 or string.sub(h, 1, 4) ~= 'KVBF' then return 0 end\n"
    "local k = string.byte(h, 6)\n"
    "local m = 2 ^ string.byte(h, 7)\n"
    "for i = 1, #ARGV, 2 do\n"
    "  local h1 = tonumber(ARGV[i])\n"
    "  local h2 = tonumber(ARGV[i + 1])\n"
    "  for j = 0, k - 1 do\n"
    "    redis.call('SETBIT', KEYS[1], 64 + (h1 + j * h2) % m, 1)\n"
    "  end\n"
    "end\n"
    "return 1\n";

inline uint64_t probe_h1(const Hash128& key) { return key.low & 0xffffffffu; }
inline uint64_t probe_h2(const Hash128& key) { return key.high & 0xffffffffu; }

struct FilterCopy {
  int probes = 0;
  int log2_bits = 0;
  std::unique_ptr<std::atomic<uint8_t>[]> bytes;  // header + bits; atomics: local puts add
  size_t size = 0;
  double fill = 0;

  uint64_t offset(uint64_t h1, uint64_t h2, int j) const {
    const uint64_t mask = (uint64_t{1} << log2_bits) - 1;
    return 64 + ((h1 + static_cast<uint64_t>(j) * h2) & mask);
  }
  bool test(const Hash128& key) const {
    for (int j = 0; j < probes; ++j) {
      const uint64_t off = offset(probe_h1(key), probe_h2(key), j);
      if (!(bytes[off >> 3].load(std::memory_order_relaxed) & (0x80u >> (off & 7)))) return false;
    }
    return true;
  }
  void add(const Hash128& key) {
    for (int j = 0; j < probes; ++j) {
      const uint64_t off = offset(probe_h1(key), probe_h2(key), j);
      bytes[off >> 3].fetch_or(static_cast<uint8_t>(0x80u >> (off & 7)),
                               std::memory_order_relaxed);
    }
  }
};

/// What a fetched filter value is.
enum class FilterState { kReady, kMissing, kBuilding, kInvalid };

/// Parses a fetched filter value (`data` null: the key is missing); on kReady sets *out.
FilterState parse_filter(const char* data, size_t size, std::shared_ptr<FilterCopy>* out);

/// The 8 header bytes of a filter of 2^log2_bits bits and `probes` probes.
std::string filter_header(int probes, int log2_bits, bool ready);

/// log2 of the bit count of a filter created for `requested_bits` (the next power of two,
/// within [kFilterMinLog2, kFilterMaxLog2]).
int filter_log2_bits(int64_t requested_bits);

}  // namespace kvbridge::detail
