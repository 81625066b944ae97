#include "src/store/redis_filter.h"

#include <cstring>
#include <utility>

namespace kvbridge::detail {

FilterState parse_filter(const char* data, size_t size, std::shared_ptr<FilterCopy>* out) {
  if (!data) return FilterState::kMissing;
  if (size < kFilterHeader || std::memcmp(data, kFilterMagic, 4) != 0 || data[4] != 1)
    return FilterState::kInvalid;
  const int k = static_cast<unsigned char>(data[5]);
  const int b = static_cast<unsigned char>(data[6]);
  if (k < 1 || k > 16 || b < kFilterMinLog2 || b > kFilterMaxLog2) return FilterState::kInvalid;
  // SETBIT beyond the current length grows a string, so a filter created at full size has it.
  if (size != kFilterHeader + (size_t{1} << b) / 8) return FilterState::kInvalid;
  if (data[7] != 1) return FilterState::kBuilding;
  auto f = std::make_shared<FilterCopy>();
  f->probes = k;
  f->log2_bits = b;
  f->size = size;
  f->bytes.reset(new std::atomic<uint8_t>[size]);
  size_t ones = 0;
  for (size_t i = 0; i < size; ++i) {
    const auto v = static_cast<uint8_t>(data[i]);
    f->bytes[i].store(v, std::memory_order_relaxed);
    if (i >= kFilterHeader) ones += static_cast<size_t>(__builtin_popcount(v));
  }
  f->fill = static_cast<double>(ones) / static_cast<double>(size_t{1} << b);
  *out = std::move(f);
  return FilterState::kReady;
}

std::string filter_header(int probes, int log2_bits, bool ready) {
  std::string h(kFilterMagic, 4);
  h.push_back(1);
  h.push_back(static_cast<char>(probes));
  h.push_back(static_cast<char>(log2_bits));
  h.push_back(ready ? 1 : 0);
  return h;
}

int filter_log2_bits(int64_t requested_bits) {
  int log2_bits = kFilterMinLog2;
  while (log2_bits < kFilterMaxLog2 && (int64_t{1} << log2_bits) < requested_bits) ++log2_bits;
  return log2_bits;
}

}  // namespace kvbridge::detail
