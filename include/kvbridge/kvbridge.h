// Umbrella header for the kvbridge C++ API.
#pragma once

#include "kvbridge/adapter.h"
#include "kvbridge/align.h"
#include "kvbridge/bridge.h"
#include "kvbridge/bridge_health.h"
#include "kvbridge/bridge_options.h"
#include "kvbridge/bridge_stats.h"
#include "kvbridge/dtype.h"
#include "kvbridge/error.h"
#include "kvbridge/hash128.h"
#include "kvbridge/kv_store.h"
#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "kvbridge/prefix_hash.h"
#include "kvbridge/version.h"
