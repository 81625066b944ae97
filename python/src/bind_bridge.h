// Registration of the Bridge bindings (bind_bridge.cpp) into the _core module.
#pragma once

#include <pybind11/pybind11.h>

namespace kvbridge::python {

/// Adds Bridge and BridgeLoad to `m`. KVStore, LinearAdapter and TensorView must be bound first.
void bind_bridge(pybind11::module_& m);

}  // namespace kvbridge::python
