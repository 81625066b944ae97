// Element types of KV tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvbridge {

/// Element type of a KV tensor. Names match torch ("float32", "bfloat16", "float16").
enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

/// Bytes per element.
size_t dtype_size(DType dtype) noexcept;
/// Canonical name: "float32", "bfloat16" or "float16".
const char* dtype_name(DType dtype) noexcept;
/// Parses a canonical name (also accepts torch's "torch.float32" form and "fp32"/"bf16"/"fp16").
/// Throws InvalidArgument naming `name` otherwise.
DType parse_dtype(const std::string& name);

}  // namespace kvbridge
