// Token ids as the library works on them: u32, checked once per call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvbridge/prefix_hash.h"

namespace kvbridge::detail {

/// The ids of a TokenSpan as u32: uint32 spans are read in place, int64 spans are checked and
/// narrowed once (one vectorizable pass). Throws what check_tokens throws. The span's memory
/// must outlive this object.
class TokenIds {
 public:
  explicit TokenIds(TokenSpan tokens);
  TokenIds(const TokenIds&) = delete;
  TokenIds& operator=(const TokenIds&) = delete;

  const uint32_t* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }

 private:
  const uint32_t* data_ = nullptr;
  size_t size_ = 0;
  std::unique_ptr<uint32_t[]> narrowed_;  // new[] without value-init: written once, not zeroed first
};

}  // namespace kvbridge::detail
