#include "tokens.h"

#include <pybind11/numpy.h>

#include <cstring>
#include <string>
#include <type_traits>

#include "kvbridge/error.h"
#include "tensors.h"

namespace py = pybind11;

namespace kvbridge::python {

namespace {

constexpr uint64_t kIdLimit = uint64_t{1} << 32;

[[noreturn]] void not_an_id(size_t i, PyObject* item) {
  throw py::type_error("tokens[" + std::to_string(i) + "]: expected an integer token id, got " +
                       Py_TYPE(item)->tp_name);
}

// Items other than small exact ints: int subclasses and __index__ types, with exact messages
// for any size (a Python int may not fit in 64 bits).
uint32_t slow_item_id(PyObject* item, size_t i) {
  if (PyBool_Check(item) || PyFloat_Check(item) || !PyIndex_Check(item)) not_an_id(i, item);
  const py::object value = py::reinterpret_steal<py::object>(PyNumber_Index(item));
  if (!value) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0 || v < 0 || static_cast<uint64_t>(v) >= kIdLimit)
    throw_token_out_of_range(i, py::str(value).cast<std::string>());
  return static_cast<uint32_t>(v);
}

// The id of one list item. Exact ints below 2^32 are read from their digits (no call), which
// makes a list about as fast to read as an array.
inline uint32_t item_id(PyObject* item, size_t i) {
  if (PyLong_CheckExact(item)) {
#if PY_VERSION_HEX >= 0x030C0000
    auto* n = reinterpret_cast<PyLongObject*>(item);
    if (PyUnstable_Long_IsCompact(n)) {
      const Py_ssize_t v = PyUnstable_Long_CompactValue(n);
      if (v >= 0 && static_cast<uint64_t>(v) < kIdLimit) return static_cast<uint32_t>(v);
    }
#else
    const Py_ssize_t size = Py_SIZE(item);
    const digit* d = reinterpret_cast<PyLongObject*>(item)->ob_digit;
    if (size == 1) return static_cast<uint32_t>(d[0]);
    if (size == 0) return 0;
    if (size == 2) {
      const uint64_t v = static_cast<uint64_t>(d[0]) | static_cast<uint64_t>(d[1]) << PyLong_SHIFT;
      if (v < kIdLimit) return static_cast<uint32_t>(v);
    }
#endif
  }
  return slow_item_id(item, i);
}

template <typename T>
void narrow(const char* base, py::ssize_t stride, size_t n, uint32_t* out) {
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, base + static_cast<py::ssize_t>(i) * stride, sizeof v);
    if constexpr (std::is_signed_v<T>) {
      if (v < 0) throw_token_out_of_range(i, std::to_string(v));
    }
    if (static_cast<uint64_t>(v) >= kIdLimit) throw_token_out_of_range(i, std::to_string(v));
    out[i] = static_cast<uint32_t>(v);
  }
}

}  // namespace

PyTokens::PyTokens(const py::handle& tokens) {
  if (PyList_Check(tokens.ptr()) || PyTuple_Check(tokens.ptr())) {
    const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(tokens.ptr()));
    PyObject** items = PySequence_Fast_ITEMS(tokens.ptr());
    uint32_t* out = allocate(n);
    for (size_t i = 0; i < n; ++i) out[i] = item_id(items[i], i);
    span_ = TokenSpan(out, n);
    return;
  }
  const void* tensor_data = nullptr;
  size_t tensor_size = 0;
  int64_t tensor_stride = 0;
  int element_size = 0;
  if (cpu_int_vector(tokens, &tensor_data, &tensor_size, &tensor_stride, &element_size)) {
    // A torch int64 / int32 CPU tensor, read in place (kvbridge._tensors.as_tokens passes
    // these through; other tensors arrive as numpy arrays).
    const auto* base = static_cast<const char*>(tensor_data);
    if (tensor_size == 0) {
      span_ = TokenSpan(ids_.get(), 0);
    } else if (element_size == 8 && tensor_stride == 1) {
      span_ = TokenSpan(static_cast<const int64_t*>(tensor_data), tensor_size);
    } else {
      uint32_t* out = allocate(tensor_size);
      const py::ssize_t byte_stride = static_cast<py::ssize_t>(tensor_stride) * element_size;
      if (element_size == 8) {
        narrow<int64_t>(base, byte_stride, tensor_size, out);
      } else {
        narrow<int32_t>(base, byte_stride, tensor_size, out);
      }
      span_ = TokenSpan(out, tensor_size);
    }
    return;
  }
  if (!py::isinstance<py::array>(tokens))
    throw py::type_error(std::string("tokens: expected a list, tuple, numpy array or torch "
                                     "tensor of integer token ids, got ") +
                         Py_TYPE(tokens.ptr())->tp_name);
  const auto array = py::reinterpret_borrow<py::array>(tokens);
  const py::dtype dt = array.dtype();
  const char kind = dt.kind();
  if (kind != 'i' && kind != 'u') {
    if (!(kind == 'f' && array.size() == 0))  // [] as an array comes out as float64
      throw py::type_error("tokens: expected integer token ids, got dtype " +
                           py::str(dt).cast<std::string>());
  }
  if (array.ndim() != 1) {
    std::string shape = "(";
    for (py::ssize_t d = 0; d < array.ndim(); ++d)
      shape += (d ? ", " : "") + std::to_string(array.shape(d));
    KVB_CHECK(false, "tokens: expected a 1-D sequence, got shape "
                         << shape << (array.ndim() == 1 ? ",)" : ")"));
  }
  const char order = dt.byteorder();
  if (order == (PY_BIG_ENDIAN ? '<' : '>'))
    throw py::type_error("tokens: expected native byte order, got dtype " +
                         py::str(dt).cast<std::string>());
  const size_t n = static_cast<size_t>(array.shape(0));
  const py::ssize_t stride = array.strides(0);
  const auto* base = static_cast<const char*>(array.data());
  const bool dense = stride == dt.itemsize();
  if (n == 0) {
    span_ = TokenSpan(ids_.get(), 0);
  } else if (dense && kind == 'i' && dt.itemsize() == 8) {
    span_ = TokenSpan(reinterpret_cast<const int64_t*>(base), n);  // checked by the library
  } else if (dense && kind == 'u' && dt.itemsize() == 4) {
    span_ = TokenSpan(reinterpret_cast<const uint32_t*>(base), n);
  } else {
    uint32_t* out = allocate(n);
    switch (kind == 'i' ? -dt.itemsize() : dt.itemsize()) {
      case -1: narrow<int8_t>(base, stride, n, out); break;
      case -2: narrow<int16_t>(base, stride, n, out); break;
      case -4: narrow<int32_t>(base, stride, n, out); break;
      case -8: narrow<int64_t>(base, stride, n, out); break;
      case 1: narrow<uint8_t>(base, stride, n, out); break;
      case 2: narrow<uint16_t>(base, stride, n, out); break;
      case 4: narrow<uint32_t>(base, stride, n, out); break;
      case 8: narrow<uint64_t>(base, stride, n, out); break;
      default:
        throw py::type_error("tokens: unsupported integer dtype " + py::str(dt).cast<std::string>());
    }
    span_ = TokenSpan(out, n);
  }
}

uint32_t* PyTokens::allocate(size_t n) {
  ids_.reset(new uint32_t[n]);  // not zero-filled: every id is written
  return ids_.get();
}

}  // namespace kvbridge::python
