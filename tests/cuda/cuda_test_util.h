// Helpers shared by the CUDA test files: a throwing runtime check and a ModelSpec builder.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kvbridge/kvbridge.h"

namespace kvbridge::testing {

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CUDA_OK(expr) ::kvbridge::testing::cuda_ok((expr), #expr)

inline ModelSpec spec(const char* name, int64_t layers, int64_t heads, int64_t dim, DType dtype,
                      double base, RopeStyle style, RopeScaling scaling = {}) {
  ModelSpec s;
  s.name = name;
  s.num_layers = layers;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.dtype = dtype;
  s.rope_base = base;
  s.rope_style = style;
  s.rope_scaling = scaling;
  return s;
}

}  // namespace kvbridge::testing
