// Device memory, current-device handles and pointer checks shared by the CUDA paths (convert,
// fitter).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "kernels/cuda_check.cuh"
#include "kvbridge/error.h"
#include "kvbridge/kv_view.h"

namespace kvbridge::cuda {

/// Bytes cuBLAS operands and vector loads are aligned to inside one allocation.
inline constexpr int64_t kOperandAlignBytes = 256;

inline int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

struct CudaFree {
  void operator()(void* p) const noexcept { (void)cudaFree(p); }
};
/// Owns a cudaMalloc'ed block on the device current at allocation.
using DevicePtr = std::unique_ptr<void, CudaFree>;

/// cudaMalloc of max(bytes, 1); throws (KVB_CUDA_CHECK) when the device is out of memory.
inline DevicePtr device_alloc(int64_t bytes) {
  void* p = nullptr;
  KVB_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))));
  return DevicePtr(p);
}

/// Makes `device` current for the calling thread and restores the previous one on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    KVB_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) KVB_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (previous_ != device_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

/// The same for teardown, where errors cannot be reported: failures are ignored (and cleared).
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int device) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
  }
  ~QuietDeviceGuard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

/// A sanity check that each plane's base address is device (or managed) memory of `device`;
/// it cannot check the extent of the viewed elements. Throws InvalidArgument naming
/// `what`[layer][kind].
inline void check_device_pointers(const KVView& v, int device, const char* what) {
  for (int64_t l = 0; l < v.num_layers(); ++l)
    for (int kind = 0; kind < 2; ++kind) {
      const void* p = v.plane(l, static_cast<KVView::Kind>(kind)).data;
      cudaPointerAttributes attr{};
      const bool known = cudaPointerGetAttributes(&attr, p) == cudaSuccess;
      if (!known) (void)cudaGetLastError();  // clear the non-sticky error
      KVB_CHECK(known && (attr.type == cudaMemoryTypeManaged ||
                          (attr.type == cudaMemoryTypeDevice && attr.device == device)),
                what << "[" << l << "][" << kind << "]: " << p
                     << " is not device memory of cuda:" << device);
    }
}

}  // namespace kvbridge::cuda
