// The token ids of one stored chunk. Up to kInline ids (the common chunk of 16) live inside the
// entry itself: no allocation per chunk on put, and the ids a match compares sit next to the
// entry's other fields instead of behind another pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace kvbridge::detail {

class ChunkTokens {
 public:
  static constexpr size_t kInline = 16;

  ChunkTokens() = default;
  ChunkTokens(const ChunkTokens&) = delete;
  ChunkTokens& operator=(const ChunkTokens&) = delete;

  /// Copies ids[0, n).
  void assign(const uint32_t* ids, size_t n) {
    if (n > kInline) {
      if (n != size_ || !heap_) heap_.reset(new uint32_t[n]);  // no zero-fill: overwritten next
    } else {
      heap_.reset();
    }
    size_ = n;
    if (n) std::memcpy(data(), ids, 4 * n);
  }

  const uint32_t* data() const noexcept { return heap_ ? heap_.get() : inline_; }
  uint32_t* data() noexcept { return heap_ ? heap_.get() : inline_; }
  size_t size() const noexcept { return size_; }

  /// Whether these are exactly ids[0, size()).
  bool equals(const uint32_t* ids) const noexcept {
    if (size_ == kInline) return std::memcmp(inline_, ids, 4 * kInline) == 0;  // inlined compare
    return std::memcmp(data(), ids, 4 * size_) == 0;
  }
  bool operator==(const ChunkTokens& o) const noexcept {
    return size_ == o.size_ && equals(o.data());
  }
  bool operator!=(const ChunkTokens& o) const noexcept { return !(*this == o); }

 private:
  uint32_t inline_[kInline];
  size_t size_ = 0;
  std::unique_ptr<uint32_t[]> heap_;
};

}  // namespace kvbridge::detail
