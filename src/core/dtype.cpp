#include "kvbridge/dtype.h"

#include "kvbridge/error.h"

namespace kvbridge {

size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
  }
  return 0;
}

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

DType parse_dtype(const std::string& name) {
  std::string n = name.rfind("torch.", 0) == 0 ? name.substr(6) : name;
  if (n == "float32" || n == "fp32" || n == "float") return DType::kFloat32;
  if (n == "bfloat16" || n == "bf16") return DType::kBFloat16;
  if (n == "float16" || n == "fp16" || n == "half") return DType::kFloat16;
  KVB_CHECK(false, "dtype: unsupported '" << name << "' (expected float32, bfloat16 or float16)");
  return DType::kFloat32;
}

}  // namespace kvbridge
