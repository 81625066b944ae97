#include "tensors.h"

#include <cstdint>
#include <string>

#include "kvbridge/dtype.h"

namespace py = pybind11;

namespace kvbridge::python {

namespace {

// torch's objects, registered once by kvbridge._tensors. Borrowed for the life of the process
// (never released: module teardown order at exit would make a release unsafe).
struct TorchObjects {
  PyObject* tensor_type = nullptr;
  PyObject* strided = nullptr;
  struct KnownDType {
    PyObject* object;
    DType dtype;
  };
  std::vector<KnownDType> kv_dtypes;
  PyObject* int64 = nullptr;
  PyObject* int32 = nullptr;
};

TorchObjects& torch_objects() {
  static TorchObjects* objects = new TorchObjects();  // never destroyed (see above)
  return *objects;
}

// Attribute names, interned once.
PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (!s) throw py::error_already_set();
  return s;
}

struct Names {
  PyObject* data_ptr = interned("data_ptr");
  PyObject* shape = interned("shape");
  PyObject* stride = interned("stride");
  PyObject* dtype = interned("dtype");
  PyObject* layout = interned("layout");
  PyObject* is_cpu = interned("is_cpu");
};

const Names& names() {
  static const Names* n = new Names();
  return *n;
}

// A new reference to obj.name, or nullptr with no Python error left set.
py::object attr_or_null(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (!v) PyErr_Clear();
  return py::reinterpret_steal<py::object>(v);
}

py::object call_or_null(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_CallMethodNoArgs(obj, name);
  if (!v) PyErr_Clear();
  return py::reinterpret_steal<py::object>(v);
}

// The ints of a tuple (torch.Size is a tuple subclass); false if it is not one of ints.
bool int_tuple(PyObject* t, std::vector<int64_t>* out) {
  if (!t || !PyTuple_Check(t)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  out->resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    (*out)[static_cast<size_t>(i)] = static_cast<int64_t>(v);
  }
  return true;
}

// Whether obj is a dense CPU torch tensor; *dtype gets its dtype object (a new reference).
bool dense_cpu_tensor(PyObject* obj, py::object* dtype) {
  const TorchObjects& torch = torch_objects();
  if (!torch.tensor_type ||
      !PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(torch.tensor_type)))
    return false;
  const Names& n = names();
  if (attr_or_null(obj, n.is_cpu).ptr() != Py_True) return false;  // also refuses meta tensors
  if (attr_or_null(obj, n.layout).ptr() != torch.strided) return false;
  *dtype = attr_or_null(obj, n.dtype);
  return bool(*dtype);
}

// The data pointer, shape and strides of a tensor already known to be dense and on the CPU.
bool read_geometry(PyObject* obj, void** data, std::vector<int64_t>* shape,
                   std::vector<int64_t>* strides) {
  const Names& n = names();
  const py::object ptr = call_or_null(obj, n.data_ptr);
  if (!ptr) return false;
  const unsigned long long address = PyLong_AsUnsignedLongLong(ptr.ptr());
  if (address == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *data = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
  return int_tuple(attr_or_null(obj, n.shape).ptr(), shape) &&
         int_tuple(call_or_null(obj, n.stride).ptr(), strides);
}

}  // namespace

void register_torch(const py::handle& tensor_type, const py::handle& strided,
                    const py::dict& dtypes) {
  TorchObjects& torch = torch_objects();
  torch.kv_dtypes.clear();
  for (const auto& item : dtypes) {
    const std::string name = py::str(item.second);
    PyObject* object = item.first.inc_ref().ptr();  // kept for the life of the process
    if (name == "int64") {
      torch.int64 = object;
    } else if (name == "int32") {
      torch.int32 = object;
    } else {
      torch.kv_dtypes.push_back({object, parse_dtype(name)});
    }
  }
  torch.strided = strided.inc_ref().ptr();
  torch.tensor_type = tensor_type.inc_ref().ptr();
}

bool cpu_tensor_view(const py::handle& tensor, TensorView* view) {
  py::object dtype;
  if (!dense_cpu_tensor(tensor.ptr(), &dtype)) return false;
  bool known = false;
  for (const auto& d : torch_objects().kv_dtypes) {
    if (d.object == dtype.ptr()) {
      view->dtype = d.dtype;
      known = true;
      break;
    }
  }
  if (!known) return false;
  view->device = Device{};
  return read_geometry(tensor.ptr(), &view->data, &view->shape, &view->strides);
}

bool cpu_pair_views(const py::handle& kv, std::vector<TensorView>* keys,
                    std::vector<TensorView>* values) {
  PyObject* obj = kv.ptr();
  if (!PyTuple_Check(obj) && !PyList_Check(obj)) return false;
  const Py_ssize_t layers = PySequence_Fast_GET_SIZE(obj);
  if (layers == 0) return false;
  PyObject** items = PySequence_Fast_ITEMS(obj);
  keys->resize(static_cast<size_t>(layers));
  values->resize(static_cast<size_t>(layers));
  for (Py_ssize_t l = 0; l < layers; ++l) {
    PyObject* pair = items[l];
    if ((!PyTuple_Check(pair) && !PyList_Check(pair)) || PySequence_Fast_GET_SIZE(pair) != 2)
      return false;
    PyObject** kv_pair = PySequence_Fast_ITEMS(pair);
    if (!cpu_tensor_view(kv_pair[0], &(*keys)[static_cast<size_t>(l)]) ||
        !cpu_tensor_view(kv_pair[1], &(*values)[static_cast<size_t>(l)]))
      return false;
  }
  return true;
}

bool cpu_int_vector(const py::handle& tensor, const void** data, size_t* size, int64_t* stride,
                    int* element_size) {
  py::object dtype;
  if (!dense_cpu_tensor(tensor.ptr(), &dtype)) return false;
  const TorchObjects& torch = torch_objects();
  if (dtype.ptr() == torch.int64 && torch.int64) {
    *element_size = 8;
  } else if (dtype.ptr() == torch.int32 && torch.int32) {
    *element_size = 4;
  } else {
    return false;
  }
  void* ptr = nullptr;
  std::vector<int64_t> shape, strides;
  if (!read_geometry(tensor.ptr(), &ptr, &shape, &strides) || shape.size() != 1) return false;
  *data = ptr;
  *size = static_cast<size_t>(shape[0]);
  *stride = strides[0];
  return true;
}

}  // namespace kvbridge::python
