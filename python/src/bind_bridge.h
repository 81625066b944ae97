// Registration of the Bridge bindings (bind_bridge.cpp) into the _core module.
#pragma once

#include <pybind11/pybind11.h>

#include "kvbridge/kv_store.h"

namespace kvbridge::python {

/// Runs an invalidation (a callable returning InvalidateResult) without the GIL and returns
/// {"memory", "disk", "redis", "redis_complete"}.
template <typename F>
pybind11::dict invalidation(F&& invalidate) {
  InvalidateResult r;
  {
    pybind11::gil_scoped_release release;
    r = invalidate();
  }
  pybind11::dict d;
  d["memory"] = r.memory;
  d["disk"] = r.disk;
  d["redis"] = r.redis;
  d["redis_complete"] = r.redis_complete;
  return d;
}

/// Adds Bridge and BridgeLoad to `m`. KVStore, LinearAdapter and TensorView must be bound first.
void bind_bridge(pybind11::module_& m);

}  // namespace kvbridge::python
