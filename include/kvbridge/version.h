// The library's version and the CUDA devices it can use.
#pragma once

namespace kvbridge {
/// Library version, "MAJOR.MINOR.PATCH".
const char* version() noexcept;
/// Number of CUDA devices visible to this process; 0 when built without CUDA or none present.
int cuda_device_count() noexcept;
}  // namespace kvbridge
