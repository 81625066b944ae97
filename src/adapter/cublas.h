// cuBLAS, loaded at run time: the few entry points the CUDA paths use (convert's mixed-precision
// GEMMs, the fitter's float64 normal-equation products).
//
// Why dlopen rather than linking CUDA::cublas: libkvbridge and the Python extension must load and
// run their CPU path on machines with no GPU, no driver and no cuBLAS; the CPU path should not pay
// for loading cuBLAS (hundreds of MB) at all; and in a Python process libcublas is normally
// already loaded by torch, so dlopen of the soname finds that copy, with no rpath into a pip
// package. cudart stays statically linked (it needs only the driver, which it loads itself).
#pragma once

#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstddef>
#include <string>

#include "kernels/cuda_check.cuh"

namespace kvbridge::cuda {

// The values of cuBLAS' C enums (cublas_api.h); the ABI passes them as int.
enum CublasOperation : int { kCublasOpN = 0, kCublasOpT = 1 };
enum CublasFillMode : int { kCublasFillLower = 0, kCublasFillUpper = 1 };
enum CublasComputeType : int { kCublasCompute32F = 68 };  ///< float32 accumulation, no TF32
enum CublasGemmAlgo : int { kCublasGemmDefault = -1 };
struct CublasContext;  // opaque
using CublasHandle = CublasContext*;

/// Soname loaded by cublas(); the environment variable KVBRIDGE_CUBLAS (a path) overrides it.
inline constexpr const char* kCublasSoname = "libcublas.so.13";

struct Cublas {
  CublasStatus (*create)(CublasHandle* handle);
  CublasStatus (*destroy)(CublasHandle handle);
  CublasStatus (*set_stream)(CublasHandle handle, cudaStream_t stream);
  CublasStatus (*set_workspace)(CublasHandle handle, void* workspace, size_t bytes);
  CublasStatus (*gemm_ex)(CublasHandle handle, CublasOperation transa, CublasOperation transb,
                          int m, int n, int k, const void* alpha, const void* a,
                          cudaDataType a_type, int lda, const void* b, cudaDataType b_type,
                          int ldb, const void* beta, void* c, cudaDataType c_type, int ldc,
                          CublasComputeType compute, CublasGemmAlgo algo);
  /// Column-major float64 GEMM, C = alpha op(A) op(B) + beta C; scalars in host memory.
  CublasStatus (*dgemm)(CublasHandle handle, CublasOperation transa, CublasOperation transb,
                        int m, int n, int k, const double* alpha, const double* a, int lda,
                        const double* b, int ldb, const double* beta, double* c, int ldc);
  /// Column-major float64 rank-k update of one triangle: C = alpha op(A) op(A)^T + beta C.
  CublasStatus (*dsyrk)(CublasHandle handle, CublasFillMode uplo, CublasOperation trans, int n,
                        int k, const double* alpha, const double* a, int lda, const double* beta,
                        double* c, int ldc);
  const char* (*status_string)(CublasStatus status);
  std::string path;  ///< what was loaded
};

/// The loaded library; the first call loads it (thread-safe; kept loaded for the process's life).
/// Tries $KVBRIDGE_CUBLAS when set (and only it), else the soname through the dynamic loader's
/// search (LD_LIBRARY_PATH, ld.so.cache, a copy already loaded by torch), then the CUDA toolkit's
/// library directory found at build time and /usr/local/cuda/lib64. Throws Unavailable naming
/// what it tried when none loads or an entry point is missing; a later call tries again.
const Cublas& cublas();

/// The library if cublas() has loaded it, else nullptr; never throws (for destructors).
const Cublas* cublas_if_loaded() noexcept;

}  // namespace kvbridge::cuda
