#include "kvbridge/version.h"

#ifndef KVBRIDGE_VERSION_STRING
#error "KVBRIDGE_VERSION_STRING is set by CMake"
#endif

namespace kvbridge {
const char* version() noexcept { return KVBRIDGE_VERSION_STRING; }
#ifndef KVBRIDGE_WITH_CUDA
int cuda_device_count() noexcept { return 0; }
#endif
}  // namespace kvbridge
