#include "tensors.h"

#include <cstdint>
#include <string>

#include "kvbridge/dtype.h"
#include "kvbridge/error.h"

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
    PyObject* cpu_template;  // torch.empty(0, dtype=object, device="cpu"), for new_empty
  };
  std::vector<KnownDType> kv_dtypes;
  PyObject* int64 = nullptr;
  PyObject* int32 = nullptr;
  PyObject* empty_like = nullptr;  // torch.empty_like
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
  PyObject* new_empty = interned("new_empty");
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
                    const py::dict& dtypes, const py::handle& empty,
                    const py::handle& empty_like) {
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
      const py::object cpu_template = empty(0, py::arg("dtype") = item.first,
                                            py::arg("device") = "cpu");
      torch.kv_dtypes.push_back({object, parse_dtype(name), cpu_template.inc_ref().ptr()});
    }
  }
  torch.strided = strided.inc_ref().ptr();
  torch.tensor_type = tensor_type.inc_ref().ptr();
  torch.empty_like = empty_like.inc_ref().ptr();
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

py::tuple new_cpu_kv(const ModelSpec& spec, int64_t tokens, KVView* dst) {
  const TorchObjects& torch = torch_objects();
  PyObject* cpu_template = nullptr;
  for (const auto& d : torch.kv_dtypes) {
    if (d.dtype == spec.dtype) {
      cpu_template = d.cpu_template;
      break;
    }
  }
  KVB_CHECK_AS(Error, cpu_template && torch.empty_like,
               "no torch dtype registered for " << dtype_name(spec.dtype)
                                                << " (kvbridge._tensors registers torch)");
  const Names& n = names();
  const int64_t layers = spec.num_layers, heads = spec.num_kv_heads, head_dim = spec.head_dim;
  // The first tensor is cpu_template.new_empty(1, heads, tokens, head_dim): the template gives
  // the dtype and the CPU device (torch.empty would follow a `with torch.device(...)` block),
  // and sizes by position cost less than a size tuple or a dtype keyword. The others are
  // torch.empty_like(first), cheaper still.
  const py::int_ one(1), h(heads), t(tokens), d(head_dim);
  PyObject* args[] = {cpu_template, one.ptr(), h.ptr(), t.ptr(), d.ptr()};
  const py::object first = py::reinterpret_steal<py::object>(PyObject_VectorcallMethod(
      n.new_empty, args, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
  if (!first) throw py::error_already_set();
  std::vector<KVPlane> planes(static_cast<size_t>(2 * layers));
  py::tuple kv(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l) {
    py::tuple pair(2);
    for (int kind = 0; kind < 2; ++kind) {
      py::object tensor =
          l == 0 && kind == 0
              ? first
              : py::reinterpret_steal<py::object>(
                    PyObject_CallOneArg(torch.empty_like, first.ptr()));
      if (!tensor) throw py::error_already_set();
      // Written through its pointer below: only CPU memory will do (a torch mode could have
      // made something else).
      KVB_CHECK_AS(Error, attr_or_null(tensor.ptr(), n.is_cpu).ptr() == Py_True,
                   "torch made a tensor that is not on the CPU for the matched KV");
      const py::object ptr = py::reinterpret_steal<py::object>(
          PyObject_CallMethodNoArgs(tensor.ptr(), n.data_ptr));
      if (!ptr) throw py::error_already_set();
      void* data = PyLong_AsVoidPtr(ptr.ptr());
      if (!data && PyErr_Occurred()) throw py::error_already_set();
      KVB_CHECK_AS(Error, data, "torch made a tensor without data for the matched KV");
      // Contiguous [1, heads, tokens, head_dim]: element strides head_dim along tokens,
      // tokens * head_dim along heads.
      planes[static_cast<size_t>(2 * l + kind)] = KVPlane{data, head_dim, tokens * head_dim, 1};
      PyTuple_SET_ITEM(pair.ptr(), kind, tensor.release().ptr());
    }
    PyTuple_SET_ITEM(kv.ptr(), l, pair.release().ptr());
  }
  *dst = KVView::from_planes(std::move(planes), spec.dtype, Device{}, tokens, heads, head_dim);
  return kv;
}

}  // namespace kvbridge::python
