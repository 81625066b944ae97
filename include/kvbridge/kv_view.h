// Non-owning views of KV tensors.
//
// The canonical layout of one sequence's KV cache is [layers, 2 (K, V), tokens, kv_heads,
// head_dim]. A KVView describes it as 2 * layers "planes" (one per layer and K/V), each a base
// pointer plus element strides for its [tokens, kv_heads, head_dim] axes. That one description
// covers a contiguous canonical buffer, Hugging Face's per-layer `[batch, kv_heads, tokens,
// head_dim]` tensors (batch index 0) and any strided slice of either, without copying.
//
// Ownership: a view never owns memory. The caller keeps the memory alive (and, for outputs,
// writable) for as long as the view is used.
#pragma once

#include <cstdint>
#include <vector>

#include "kvbridge/dtype.h"
#include "kvbridge/model_spec.h"

namespace kvbridge {

enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int32_t index = 0;  ///< CUDA ordinal; 0 for CPU
  bool operator==(const Device& o) const noexcept { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const noexcept { return !(*this == o); }
};

/// A strided n-d tensor somebody else owns. `strides` are in elements, may be any non-negative
/// value (0 for broadcast dimensions is allowed on inputs), one per dimension of `shape`.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

/// One layer's K or V: [tokens, kv_heads, head_dim] at `data` with element strides.
struct KVPlane {
  void* data = nullptr;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  int64_t dim_stride = 0;
};

class KVView {
 public:
  enum Kind : int { kKey = 0, kValue = 1 };

  KVView() = default;

  /// View of a dense canonical buffer [layers, 2, tokens, kv_heads, head_dim] (row-major).
  /// `data`: layers*2*tokens*kv_heads*head_dim elements of `dtype` on `device`.
  static KVView contiguous(void* data, DType dtype, Device device, int64_t layers,
                           int64_t tokens, int64_t kv_heads, int64_t head_dim);

  /// View of Hugging Face legacy per-layer tensors: keys[l] and values[l] are
  /// [batch, kv_heads, tokens, head_dim] with batch == 1, all of one dtype and device and of
  /// equal shape. Throws InvalidArgument naming the offending tensor ("kv[3][1]: ...").
  static KVView from_hf_layers(const std::vector<TensorView>& keys,
                               const std::vector<TensorView>& values);

  /// Builds a view from explicit planes (2 * layers of them, ordered layer-major, K then V).
  static KVView from_planes(std::vector<KVPlane> planes, DType dtype, Device device,
                            int64_t tokens, int64_t kv_heads, int64_t head_dim);

  int64_t num_layers() const noexcept { return static_cast<int64_t>(planes_.size() / 2); }
  int64_t tokens() const noexcept { return tokens_; }
  int64_t kv_heads() const noexcept { return kv_heads_; }
  int64_t head_dim() const noexcept { return head_dim_; }
  DType dtype() const noexcept { return dtype_; }
  Device device() const noexcept { return device_; }
  const KVPlane& plane(int64_t layer, Kind kind) const { return planes_[2 * layer + kind]; }
  /// Total bytes of the viewed elements (not of the underlying allocations).
  int64_t bytes() const noexcept;

  /// Tokens [begin, begin + count) of every plane. Throws InvalidArgument when out of range.
  KVView slice_tokens(int64_t begin, int64_t count) const;

  /// Throws InvalidArgument (prefixed with `what`) unless layers, kv_heads, head_dim and dtype
  /// equal the spec's.
  void check_matches(const ModelSpec& spec, const char* what) const;

 private:
  std::vector<KVPlane> planes_;
  DType dtype_ = DType::kFloat32;
  Device device_{};
  int64_t tokens_ = 0;
  int64_t kv_heads_ = 0;
  int64_t head_dim_ = 0;
};

/// Copies every element of `src` into `dst` (same geometry and dtype, both on the CPU; the two
/// must not overlap). Runs of contiguous elements are moved with memcpy, so a dense-to-dense copy
/// runs at memcpy speed whatever the planes' strides are.
void copy_kv(const KVView& src, const KVView& dst);

}  // namespace kvbridge
