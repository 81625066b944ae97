// Python names of the C++ field types that option and spec tables hold, for the field lists the
// bindings publish (Bridge.OPTIONS, ModelSpec.FIELDS) and the check of the .pyi stub against them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvbridge/dtype.h"
#include "kvbridge/model_spec.h"

namespace kvbridge::python {

template <class T>
struct PythonType;
template <>
struct PythonType<bool> { static constexpr const char* name = "bool"; };
template <>
struct PythonType<int64_t> { static constexpr const char* name = "int"; };
template <>
struct PythonType<double> { static constexpr const char* name = "float"; };
template <>
struct PythonType<std::string> { static constexpr const char* name = "str"; };
template <>
struct PythonType<DType> { static constexpr const char* name = "str"; };  // by name
template <>
struct PythonType<RopeStyle> { static constexpr const char* name = "str"; };  // by name
template <>
struct PythonType<RopeScaling::Type> { static constexpr const char* name = "str"; };  // by name
template <>
struct PythonType<RopeScaling> { static constexpr const char* name = "RopeScaling"; };
template <>
struct PythonType<LayerAttention> { static constexpr const char* name = "LayerAttention"; };
template <>
struct PythonType<std::vector<LayerAttention>> {
  static constexpr const char* name = "List[LayerAttention]";
};

/// The annotation a field of C++ type T has in Python (and in _core.pyi).
template <class T>
const char* python_type_name() {
  return PythonType<T>::name;
}

}  // namespace kvbridge::python
