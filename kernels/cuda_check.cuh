// KVB_CUDA_CHECK: the one way CUDA runtime and cuBLAS calls are checked. Included by the device
// code in kernels/ and by the host code of the CUDA path in src/adapter/ (plain C++: this header
// uses only the runtime API's host declarations).
//
// Every failure becomes kvbridge::Unavailable (the device or library cannot be used now; Python:
// kvbridge.UnavailableError) whose message names the failed call, the error name and string, and
// whose location is the call site. Bad arguments are rejected before any CUDA call, with
// InvalidArgument, so they never reach here.
#pragma once

#include <cuda_runtime_api.h>

#include <sstream>

#include "kvbridge/error.h"

namespace kvbridge::cuda {

/// cublasStatus_t as libcublas returns it (a C enum, passed as int). cuBLAS is loaded at run time
/// (src/adapter/cublas.h), so its headers are not needed to build.
enum CublasStatus : int { kCublasSuccess = 0 };

inline void check(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  std::ostringstream msg;
  msg << "CUDA error " << cudaGetErrorName(status) << " (" << cudaGetErrorString(status)
      << ") from " << call;
  throw Unavailable(msg.str(), file, line);
}

/// Defined with the cuBLAS loader: it asks libcublas for the status string.
void check(CublasStatus status, const char* call, const char* file, int line);

}  // namespace kvbridge::cuda

/// Throws kvbridge::Unavailable unless the CUDA runtime or cuBLAS call `expr` succeeded.
#define KVB_CUDA_CHECK(expr) ::kvbridge::cuda::check((expr), #expr, __FILE__, __LINE__)
/// After every kernel launch: a bad launch configuration or an earlier asynchronous failure.
#define KVB_CUDA_CHECK_LAUNCH() KVB_CUDA_CHECK(cudaGetLastError())
