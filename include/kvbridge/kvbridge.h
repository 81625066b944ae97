// Umbrella header for the kvbridge C++ API.
#pragma once

#include "kvbridge/adapter.h"
#include "kvbridge/align.h"
#include "kvbridge/bridge.h"
#include "kvbridge/dtype.h"
#include "kvbridge/error.h"
#include "kvbridge/kv_store.h"
#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "kvbridge/prefix_hash.h"

namespace kvbridge {
/// Library version, "MAJOR.MINOR.PATCH".
const char* version() noexcept;
/// Number of CUDA devices visible to this process; 0 when built without CUDA or none present.
int cuda_device_count() noexcept;
}  // namespace kvbridge
