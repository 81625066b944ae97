// Device discovery for the CUDA path.
#include <cuda_runtime.h>

#include "kvbridge/kvbridge.h"

namespace kvbridge {
int cuda_device_count() noexcept {
  int count = 0;
  // No driver or no device is not an error here: the CPU path serves.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}
}  // namespace kvbridge
