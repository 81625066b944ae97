// pybind11 bindings: type conversions only. Argument checking lives in the C++ library (so C++
// and Python callers get the same errors); Python-side type handling lives in python/kvbridge.
#include <array>
#include <optional>
#include <tuple>

#include <pybind11/numpy.h>
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "bind_bridge.h"
#include "field_types.h"
#include "tensors.h"
#include "tokens.h"
#include "kvbridge/kvbridge.h"

namespace py = pybind11;
using namespace kvbridge;
using kvbridge::python::PyTokens;

namespace {

// Conversions of Python numbers for constructors that take them as objects, so a wrong type or
// an int outside int64 is a clear TypeError / InvalidArgumentError naming the argument instead
// of pybind11's "incompatible constructor arguments" (ranges are checked by ModelSpec::validate).
int64_t int_arg(const py::handle& v, const char* name) {
  if (py::isinstance<py::bool_>(v) || !py::isinstance<py::int_>(v))
    throw py::type_error(std::string(name) + ": expected an int, got " +
                         std::string(py::str(py::type::of(v).attr("__name__"))) + " " +
                         std::string(py::repr(v)));
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  KVB_CHECK(overflow == 0, name << ": " << std::string(py::repr(v)) << " is outside int64");
  return static_cast<int64_t>(x);
}

double real_arg(const py::handle& v, const char* name) {
  if (py::isinstance<py::bool_>(v) ||
      !(py::isinstance<py::float_>(v) || py::isinstance<py::int_>(v)))
    throw py::type_error(std::string(name) + ": expected a number, got " +
                         std::string(py::str(py::type::of(v).attr("__name__"))) + " " +
                         std::string(py::repr(v)));
  return v.cast<double>();
}

TensorView make_view(uintptr_t data, const std::string& dtype, std::vector<int64_t> shape,
                     std::vector<int64_t> strides, const std::string& device, int device_index) {
  TensorView v;
  v.data = reinterpret_cast<void*>(data);
  v.dtype = parse_dtype(dtype);
  KVB_CHECK(device == "cpu" || device == "cuda", "device: unsupported '" << device << "'");
  v.device = Device{device == "cpu" ? DeviceType::kCPU : DeviceType::kCUDA, device_index};
  v.shape = std::move(shape);
  v.strides = std::move(strides);
  return v;
}

// Stats dicts: one key per row of the field tables in store_stats.h.
#define KVBRIDGE_DICT_ITEM_(type, member, metric, kind, help) d[#member] = from.member;

py::dict tier_dict(const TierStats& from) {
  py::dict d;
  KVBRIDGE_TIER_GAUGES(KVBRIDGE_DICT_ITEM_)
  KVBRIDGE_TIER_COUNTERS(KVBRIDGE_DICT_ITEM_)
  return d;
}

py::dict remote_dict(const RemoteStats& from) {
  py::dict d;
  KVBRIDGE_REMOTE_COUNTERS(KVBRIDGE_DICT_ITEM_)
  KVBRIDGE_REMOTE_GAUGES(KVBRIDGE_DICT_ITEM_)
  py::list bounds, buckets;
  for (double b : RemoteStats::kLatencyBounds) bounds.append(b);
  for (int64_t b : from.latency_buckets) buckets.append(b);
  d["latency_bounds_seconds"] = bounds;
  d["latency_buckets"] = buckets;
  return d;
}

// A field of one of StoreOptions' nested groups (disk, redis) as a flat Python attribute.
template <typename Group, typename T>
void flat_option(py::class_<StoreOptions>& cls, const char* name, Group StoreOptions::*group,
                 T Group::*field) {
  cls.def_property(
      name, [group, field](const StoreOptions& o) { return (o.*group).*field; },
      [group, field](StoreOptions& o, const T& value) { (o.*group).*field = value; });
}

py::dict stats_dict(const StoreStats& from) {
  py::dict d;
  KVBRIDGE_STORE_GAUGES(KVBRIDGE_DICT_ITEM_)
  KVBRIDGE_STORE_COUNTERS(KVBRIDGE_DICT_ITEM_)
  for (const StoreTierInfo& tier : store_tiers()) d[tier.name] = tier_dict(from.*tier.stats);
  d["remote"] = remote_dict(from.remote);
  return d;
}

// Pickle states: every field in its field list's order, enums by name, struct fields
// (rope_scaling, a layer's) flattened in place, and layer_attention as one list of its entries'
// flattened tuples. ModelSpec's state before layer_attention existed was the same tuple without
// that last element, and still loads.
py::object field_py(const std::string& v) { return py::str(v); }
py::object field_py(int64_t v) { return py::int_(v); }
py::object field_py(double v) { return py::float_(v); }
py::object field_py(DType v) { return py::str(dtype_name(v)); }
py::object field_py(RopeStyle v) { return py::str(rope_style_name(v)); }
py::object field_py(RopeScaling::Type v) { return py::str(rope_scaling_type_name(v)); }
void field_from(const py::handle& o, std::string* v) { *v = o.cast<std::string>(); }
void field_from(const py::handle& o, int64_t* v) { *v = o.cast<int64_t>(); }
void field_from(const py::handle& o, double* v) { *v = o.cast<double>(); }
void field_from(const py::handle& o, DType* v) { *v = parse_dtype(o.cast<std::string>()); }
void field_from(const py::handle& o, RopeStyle* v) {
  *v = parse_rope_style(o.cast<std::string>());
}
void field_from(const py::handle& o, RopeScaling::Type* v) {
  *v = parse_rope_scaling_type(o.cast<std::string>());
}

// Calls f(field) for every leaf field of `s` (a struct field's fields in place of it; a
// layer_attention list is one leaf).
template <class S, class F>
void for_each_leaf(S& s, F&& f) {
  using T = std::remove_const_t<S>;
  auto leaf = [&](const char*, auto& value) {
    using V = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<V, RopeScaling> || std::is_same_v<V, LayerAttention>) {
      for_each_leaf(value, f);
    } else {
      f(value);
    }
  };
  if constexpr (std::is_same_v<T, ModelSpec>) {
    for_each_spec_field(leaf, s);
  } else if constexpr (std::is_same_v<T, LayerAttention>) {
    for_each_layer_attention_field(leaf, s);
  } else {
    for_each_rope_scaling_field(leaf, s);
  }
}

template <class T>
py::tuple state_of(const T& s);
template <class T>
T from_state(const py::tuple& t, bool check_count = true);

py::object state_leaf(const std::vector<LayerAttention>& v) {
  py::list out;
  for (const LayerAttention& a : v) out.append(state_of(a));
  return std::move(out);
}
template <class V>
py::object state_leaf(const V& v) {
  return field_py(v);
}
void leaf_from(const py::handle& o, std::vector<LayerAttention>* v) {
  v->clear();
  for (const py::handle& entry : o.cast<py::list>())
    v->push_back(from_state<LayerAttention>(entry.cast<py::tuple>()));
}
template <class V>
void leaf_from(const py::handle& o, V* v) {
  field_from(o, v);
}

template <class T>
size_t leaf_count() {
  T s{};
  size_t n = 0;
  for_each_leaf(s, [&](auto&) { ++n; });
  return n;
}

template <class T>
py::tuple state_of(const T& s) {
  py::list state;
  for_each_leaf(s, [&](const auto& v) { state.append(state_leaf(v)); });
  return py::tuple(state);
}

template <class T>
T from_state(const py::tuple& t, bool check_count) {
  const size_t n = leaf_count<T>();
  if (check_count)
    KVB_CHECK(t.size() == n, "pickle: expected " << n << " fields, got " << t.size());
  T s{};
  size_t i = 0;
  for_each_leaf(s, [&](auto& v) {
    if (i < t.size()) leaf_from(t[i++], &v);
  });
  return s;
}

py::tuple spec_state(const ModelSpec& s) { return state_of(s); }

ModelSpec spec_from_state(const py::tuple& t) {
  const size_t n = leaf_count<ModelSpec>();
  // n - 1: a state written before layer_attention (its last field) existed.
  KVB_CHECK(t.size() == n || t.size() == n - 1,
            "ModelSpec pickle: expected " << n << " fields, got " << t.size());
  ModelSpec s = from_state<ModelSpec>(t, /*check_count=*/false);
  s.validate();
  return s;
}

// Structs whose Python constructor, properties and FIELDS come from their field list:
// Fields<T>::each(s, f) calls f(name, field) for every field of `s`; Fields<T>::args are the
// constructor's argument names in order, each a field (the first `required` of them have no
// default, the others T{}'s); check(s) runs on the constructed value.
template <class T>
struct Fields;

// RopeScaling takes its arguments in the field list's order: the names, at compile time.
constexpr size_t kScalingFields = [] {
  size_t n = 0;
  RopeScaling s{};
  for_each_rope_scaling_field([&](const char*, auto&) { ++n; }, s);
  return n;
}();
constexpr std::array<const char*, kScalingFields> kScalingArgs = [] {
  std::array<const char*, kScalingFields> names{};
  size_t i = 0;
  RopeScaling s{};
  for_each_rope_scaling_field([&](const char* name, auto&) { names[i++] = name; }, s);
  return names;
}();

template <>
struct Fields<RopeScaling> {
  template <class S, class F>
  static void each(S& s, F&& f) {
    for_each_rope_scaling_field(f, s);
  }
  static constexpr std::array<const char*, kScalingFields> args = kScalingArgs;
  static constexpr size_t required = 0;
  static void check(const RopeScaling&) {}  // ModelSpec::validate checks it in its spec
};

// LayerAttention, likewise.
constexpr size_t kLayerAttentionFields = [] {
  size_t n = 0;
  LayerAttention s{};
  for_each_layer_attention_field([&](const char*, auto&) { ++n; }, s);
  return n;
}();
constexpr std::array<const char*, kLayerAttentionFields> kLayerAttentionArgs = [] {
  std::array<const char*, kLayerAttentionFields> names{};
  size_t i = 0;
  LayerAttention s{};
  for_each_layer_attention_field([&](const char* name, auto&) { names[i++] = name; }, s);
  return names;
}();

template <>
struct Fields<LayerAttention> {
  template <class S, class F>
  static void each(S& s, F&& f) {
    for_each_layer_attention_field(f, s);
  }
  static constexpr std::array<const char*, kLayerAttentionFields> args = kLayerAttentionArgs;
  static constexpr size_t required = 0;
  static void check(const LayerAttention&) {}  // ModelSpec::validate checks it in its spec
};

template <>
struct Fields<ModelSpec> {
  template <class S, class F>
  static void each(S& s, F&& f) {
    for_each_spec_field(f, s);
  }
  // The order callers pass the arguments by position in: the four required fields, then the
  // others. It is not the fingerprint order of for_each_spec_field; check_args() checks at
  // import that it names every field of that list once, so a new field fails the import until
  // it has a place here.
  static constexpr std::array args{"name",         "num_layers", "num_kv_heads",
                                   "head_dim",     "dtype",      "version",
                                   "tokenizer",    "rope_base",  "rope_style",
                                   "rope_scaling", "layer_attention"};
  static constexpr size_t required = 4;
  static void check(const ModelSpec& s) { s.validate(); }
};

template <class T>
void check_args() {
  const T defaults{};
  size_t fields = 0;
  Fields<T>::each(defaults, [&](const char* name, const auto&) {
    ++fields;
    size_t found = 0;
    for (const char* arg : Fields<T>::args) found += std::strcmp(arg, name) == 0;
    if (found != 1)
      throw std::logic_error(std::string("field '") + name + "' must be one argument, once");
  });
  if (fields != Fields<T>::args.size())
    throw std::logic_error("an argument names no field");
}

// Calls f(field) for the field of `s` named `name`.
template <class T, class S, class F>
void with_field(S& s, const char* name, F&& f) {
  Fields<T>::each(s, [&](const char* field, auto& value) {
    if (std::strcmp(field, name) == 0) f(value);
  });
}

// A constructor argument into a field: a wrong type is a TypeError naming it.
std::string text_arg(const py::handle& v, const char* name) {
  py::detail::make_caster<std::string> text;
  if (!text.load(v, true))
    throw py::type_error(std::string(name) + ": expected a str, got " +
                         std::string(py::str(py::type::of(v).attr("__name__"))) + " " +
                         std::string(py::repr(v)));
  return py::detail::cast_op<std::string>(std::move(text));
}
void field_arg(const py::handle& o, const char* name, std::string* v) { *v = text_arg(o, name); }
void field_arg(const py::handle& o, const char* name, int64_t* v) { *v = int_arg(o, name); }
void field_arg(const py::handle& o, const char* name, double* v) { *v = real_arg(o, name); }
void field_arg(const py::handle& o, const char* name, DType* v) {
  *v = parse_dtype(text_arg(o, name));
}
void field_arg(const py::handle& o, const char* name, RopeStyle* v) {
  *v = parse_rope_style(text_arg(o, name));
}
void field_arg(const py::handle& o, const char* name, RopeScaling::Type* v) {
  *v = parse_rope_scaling_type(text_arg(o, name));
}
// None: RopeScaling() (no scaling).
void field_arg(const py::handle& o, const char* name, RopeScaling* v) {
  if (o.is_none()) {
    *v = RopeScaling{};
    return;
  }
  if (!py::isinstance<RopeScaling>(o))
    throw py::type_error(std::string(name) + ": expected a kvbridge.RopeScaling or None, got " +
                         std::string(py::str(py::type::of(o).attr("__name__"))));
  *v = o.cast<RopeScaling>();
}
py::object field_py(const RopeScaling& v) { return py::cast(v); }
// A list or tuple of kvbridge.LayerAttention.
void field_arg(const py::handle& o, const char* name, std::vector<LayerAttention>* v) {
  if (!py::isinstance<py::list>(o) && !py::isinstance<py::tuple>(o))
    throw py::type_error(std::string(name) + ": expected a list of kvbridge.LayerAttention, got " +
                         std::string(py::str(py::type::of(o).attr("__name__"))));
  v->clear();
  size_t i = 0;
  for (const py::handle& entry : o) {
    if (!py::isinstance<LayerAttention>(entry))
      throw py::type_error(std::string(name) + "[" + std::to_string(i) +
                           "]: expected a kvbridge.LayerAttention, got " +
                           std::string(py::str(py::type::of(entry).attr("__name__"))));
    v->push_back(entry.cast<LayerAttention>());
    ++i;
  }
}
py::object field_py(const std::vector<LayerAttention>& v) {
  py::list out;
  for (const LayerAttention& a : v) out.append(py::cast(a));
  return std::move(out);
}

template <class T, size_t I>
auto arg_decl() {
  const char* name = Fields<T>::args[I];
  if constexpr (I < Fields<T>::required) {
    return py::arg(name);
  } else {
    const T defaults{};
    py::object value;
    with_field<T>(defaults, name, [&](const auto& v) { value = field_py(v); });
    return py::arg_v(name, value);
  }
}

template <size_t>
using PyObjectArg = const py::object&;

// T(...): one argument per name of Fields<T>::args, each converted into its field (in argument
// order), then Fields<T>::check.
template <class T, size_t... I>
void def_init(py::class_<T>& cls, std::index_sequence<I...>) {
  cls.def(py::init([](PyObjectArg<I>... arg) {
            const py::handle args[] = {arg...};
            T s{};
            for (size_t i = 0; i < sizeof...(I); ++i) {
              const char* name = Fields<T>::args[i];
              with_field<T>(s, name, [&](auto& field) { field_arg(args[i], name, &field); });
            }
            Fields<T>::check(s);
            return s;
          }),
          arg_decl<T, I>()...);
}

// The constructor, a read-only property per field, and T.FIELDS: ((name, type, default), ...)
// in argument order (default None for the required ones), which the stub check reads.
template <class T>
void def_fields(py::class_<T>& cls) {
  check_args<T>();
  constexpr size_t n = Fields<T>::args.size();
  def_init(cls, std::make_index_sequence<n>());
  const T defaults{};
  py::list fields;
  for (size_t i = 0; i < n; ++i) {
    const char* name = Fields<T>::args[i];
    with_field<T>(defaults, name, [&](const auto& v) {
      using V = std::decay_t<decltype(v)>;
      fields.append(py::make_tuple(name, kvbridge::python::python_type_name<V>(),
                                   i < Fields<T>::required ? py::none() : field_py(v)));
      cls.def_property_readonly(name, [name](const T& s) {
        py::object out;
        with_field<T>(s, name, [&](const auto& f) { out = field_py(f); });
        return out;
      });
    });
  }
  cls.attr("FIELDS") = py::tuple(fields);
}

// "Name(field=value, ...)" in constructor argument order, each value by its Python repr.
template <class T>
std::string fields_repr(const T& s, const char* type_name) {
  std::string out = std::string(type_name) + "(";
  for (size_t i = 0; i < Fields<T>::args.size(); ++i) {
    const char* name = Fields<T>::args[i];
    with_field<T>(s, name, [&](const auto& v) {
      out += std::string(i ? ", " : "") + name + "=" + std::string(py::repr(field_py(v)));
    });
  }
  return out + ")";
}

// ==, !=, __hash__ (of the pickle state), __repr__ and pickle for a small value struct.
template <class T>
void def_value(py::class_<T>& cls, const char* type_name) {
  cls.def(py::self == py::self)
      .def(py::self != py::self)
      .def("__hash__", [](const T& s) { return py::hash(state_of(s)); })
      .def("__repr__", [type_name](const T& s) { return fields_repr(s, type_name); })
      .def(py::pickle([](const T& s) { return state_of(s); },
                      [](const py::tuple& t) { return from_state<T>(t); }));
}

py::dict report_dict(const FitReport& r) {
  py::list layers;
  for (const LayerFit& lf : r.layers) {
    py::dict d;
    d["source_layers"] = lf.source_layers;
    d["r2_key"] = lf.r2_key;
    d["r2_value"] = lf.r2_value;
    d["ridge_key"] = lf.ridge_key;
    d["ridge_value"] = lf.ridge_value;
    // NaN (no token codes' term) as None.
    const auto ridge = [](double v) { return std::isnan(v) ? py::object(py::none()) : py::float_(v); };
    d["token_ridge_key"] = ridge(lf.token_ridge_key);
    d["token_ridge_value"] = ridge(lf.token_ridge_value);
    py::list steps;
    for (const SelectionStep& st : lf.selection) {
      py::dict e;
      e["source_layer"] = st.source_layer;
      e["r2_key"] = st.r2_key;
      e["r2_value"] = st.r2_value;
      e["screen"] = st.screen;
      e["accepted"] = st.accepted;
      steps.append(e);
    }
    d["selection"] = steps;
    layers.append(d);
  }
  py::dict d;
  d["layers"] = layers;
  d["train_tokens"] = r.train_tokens;
  d["holdout_tokens"] = r.holdout_tokens;
  d["rope_aware"] = r.rope_aware;
  d["alignment_policy"] = r.alignment_policy;
  return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "kvbridge native core (use the kvbridge package, not this module)";

  // Exception types. Bases are tuples so each is both a kvbridge.Error and the builtin users
  // expect (ValueError, KeyError, ...).
  static py::exception<Error> error_type(m, "Error", PyExc_RuntimeError);
  auto make = [&](const char* name, PyObject* builtin) {
    py::tuple bases = py::make_tuple(error_type, py::handle(builtin));
    return py::reinterpret_steal<py::object>(
        PyErr_NewException((std::string("kvbridge.") + name).c_str(), bases.ptr(), nullptr));
  };
  static py::object invalid_type = make("InvalidArgumentError", PyExc_ValueError);
  static py::object not_found_type = make("NotFoundError", PyExc_KeyError);
  static py::object corrupt_type = make("CorruptError", PyExc_ValueError);
  static py::object unavailable_type = make("UnavailableError", PyExc_OSError);
  m.attr("InvalidArgumentError") = invalid_type;
  m.attr("NotFoundError") = not_found_type;
  m.attr("CorruptError") = corrupt_type;
  m.attr("UnavailableError") = unavailable_type;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(invalid_type.ptr(), e.what());
    } catch (const NotFound& e) {
      PyErr_SetString(not_found_type.ptr(), e.what());
    } catch (const Corrupt& e) {
      PyErr_SetString(corrupt_type.ptr(), e.what());
    } catch (const Unavailable& e) {
      PyErr_SetString(unavailable_type.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(error_type.ptr(), e.what());
    }
  });

  m.def("version", &version);
  m.def("cuda_device_count", &cuda_device_count);
  m.def(
      "cpu_convert_kernel",
      [](const std::string& dtype) { return cpu_convert_kernel(parse_dtype(dtype)); },
      py::arg("dtype"));

  py::class_<RopeScaling> scaling(m, "RopeScaling");
  def_fields(scaling);
  def_value(scaling, "RopeScaling");

  py::class_<LayerAttention> layer_attention(m, "LayerAttention");
  def_fields(layer_attention);
  def_value(layer_attention, "LayerAttention");

  py::class_<ModelSpec> spec(m, "ModelSpec");
  def_fields(spec);
  spec
      .def_property_readonly("fingerprint", &ModelSpec::fingerprint)
      .def("kv_bytes_per_token", &ModelSpec::kv_bytes_per_token)
      .def("layer", &ModelSpec::layer, py::arg("layer"))
      .def("uniform_attention", &ModelSpec::uniform_attention)
      .def(py::self == py::self)
      .def(py::self != py::self)
      .def("__hash__", [](const ModelSpec& s) { return py::hash(py::str(s.fingerprint())); })
      .def("__repr__", [](const ModelSpec& s) {
        return "ModelSpec(name=" + py::repr(py::str(s.name)).cast<std::string>() +
               ", num_layers=" + std::to_string(s.num_layers) +
               ", num_kv_heads=" + std::to_string(s.num_kv_heads) +
               ", head_dim=" + std::to_string(s.head_dim) + ", dtype='" + dtype_name(s.dtype) +
               "', version=" + py::repr(py::str(s.version)).cast<std::string>() +
               ", fingerprint='" + s.fingerprint() + "')";
      })
      .def(py::pickle(&spec_state, &spec_from_state));

  m.def("_register_torch", &python::register_torch, py::arg("tensor_type"), py::arg("strided"),
        py::arg("dtypes"), py::arg("empty"), py::arg("empty_like"),
        "Hands the core torch.Tensor, torch.strided and {torch dtype: name} for reading tensors "
        "in place, and torch.empty and torch.empty_like for creating them (called once by "
        "kvbridge._tensors).");

  py::class_<TensorView>(m, "TensorView")
      .def(py::init(&make_view), py::arg("data"), py::arg("dtype"), py::arg("shape"),
           py::arg("strides"), py::arg("device") = "cpu", py::arg("device_index") = 0);

  py::class_<Match>(m, "Match")
      .def_property_readonly("tokens", &Match::tokens)
      .def(
          "converted_provenance",
          [](const Match& match) {
            const Provenance p = match.converted_provenance();
            return py::make_tuple(p.source_fingerprint, p.adapter_fingerprint);
          },
          "(source fingerprint, adapter fingerprint) of the first chunk that is not the "
          "model's own prefill; (\"\", \"\") when every chunk is.")
      .def(
          "copy_to",
          [](const Match& match, const std::vector<TensorView>& keys,
             const std::vector<TensorView>& values) {
            const KVView dst = KVView::from_hf_layers(keys, values);
            py::gil_scoped_release release;
            match.copy_to(dst);
          },
          py::arg("keys"), py::arg("values"))
      .def(
          "copy_into",
          [](const Match& match, const py::handle& kv) {
            std::vector<TensorView> keys, values;
            if (!python::cpu_pair_views(kv, &keys, &values)) return false;
            const KVView dst = KVView::from_hf_layers(keys, values);
            python::copy_releasing_gil_if_large(dst.bytes(), [&] { match.copy_to(dst); });
            return true;
          },
          py::arg("kv"),
          "copy_to() into a legacy tuple of dense CPU tensors read in place; False (nothing "
          "done) for any other kv.");

  py::class_<StoreOptions> options(m, "StoreOptions");
  options.def(py::init<>())
      .def_readwrite("capacity_bytes", &StoreOptions::capacity_bytes)
      .def_readwrite("chunk_tokens", &StoreOptions::chunk_tokens)
      .def_readwrite("num_shards", &StoreOptions::num_shards)
      .def_property(
          "eviction", [](const StoreOptions& o) { return eviction_policy_name(o.eviction); },
          [](StoreOptions& o, const std::string& name) {
            o.eviction = parse_eviction_policy(name);
          })
      .def_readwrite("ttl_seconds", &StoreOptions::ttl_seconds)
      .def_property(
          "storage", [](const StoreOptions& o) { return storage_format_name(o.storage); },
          [](StoreOptions& o, const std::string& name) {
            o.storage = parse_storage_format(name);
          });
  // The disk and Redis settings stay flat in Python (disk_dir, redis_url, ...), each one a field
  // of StoreOptions::disk or StoreOptions::redis.
  flat_option(options, "disk_dir", &StoreOptions::disk, &DiskOptions::dir);
  flat_option(options, "disk_capacity_bytes", &StoreOptions::disk, &DiskOptions::capacity_bytes);
  flat_option(options, "disk_fsync", &StoreOptions::disk, &DiskOptions::fsync);
  flat_option(options, "redis_url", &StoreOptions::redis, &RedisOptions::url);
  flat_option(options, "redis_key_prefix", &StoreOptions::redis, &RedisOptions::key_prefix);
  flat_option(options, "redis_connect_timeout_ms", &StoreOptions::redis,
              &RedisOptions::connect_timeout_ms);
  flat_option(options, "redis_command_timeout_ms", &StoreOptions::redis,
              &RedisOptions::command_timeout_ms);
  flat_option(options, "redis_pool_size", &StoreOptions::redis, &RedisOptions::pool_size);
  flat_option(options, "redis_retry_min_ms", &StoreOptions::redis, &RedisOptions::retry_min_ms);
  flat_option(options, "redis_retry_max_ms", &StoreOptions::redis, &RedisOptions::retry_max_ms);
  flat_option(options, "redis_batch_bytes", &StoreOptions::redis, &RedisOptions::batch_bytes);
  flat_option(options, "redis_filter", &StoreOptions::redis, &RedisOptions::filter);
  flat_option(options, "redis_filter_bits", &StoreOptions::redis, &RedisOptions::filter_bits);
  flat_option(options, "redis_filter_hashes", &StoreOptions::redis, &RedisOptions::filter_hashes);
  flat_option(options, "redis_filter_refresh_ms", &StoreOptions::redis,
              &RedisOptions::filter_refresh_ms);

  // The tiers' names and mask bits, from the store's table: TIERS in walk order, and
  // <NAME>_TIER each.
  py::list tiers;
  for (const StoreTierInfo& tier : store_tiers()) {
    const unsigned bit = static_cast<unsigned>(tier.bit);
    tiers.append(py::make_tuple(tier.name, bit));
    std::string upper = tier.name;
    for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    m.attr((upper + "_TIER").c_str()) = bit;
  }
  m.attr("TIERS") = tiers;

  py::class_<KVStore>(m, "KVStore")
      .def(py::init([](const StoreOptions& o) {
             py::gil_scoped_release release;  // opening may scan a directory or connect
             return std::make_unique<KVStore>(o);
           }),
           py::arg("options"))
      .def(py::init([](int64_t capacity_bytes, int64_t chunk_tokens, int num_shards) {
             StoreOptions o;
             o.capacity_bytes = capacity_bytes;
             o.chunk_tokens = chunk_tokens;
             o.num_shards = num_shards;
             return std::make_unique<KVStore>(o);
           }),
           py::arg("capacity_bytes"), py::arg("chunk_tokens") = 256, py::arg("num_shards") = 16)
      .def_property_readonly("capacity_bytes",
                             [](const KVStore& s) { return s.options().capacity_bytes; })
      .def_property_readonly("chunk_tokens",
                             [](const KVStore& s) { return s.options().chunk_tokens; })
      .def_property_readonly(
          "storage", [](const KVStore& s) { return storage_format_name(s.options().storage); })
      .def(
          "put",
          [](KVStore& store, const ModelSpec& spec, const py::handle& tokens,
             const std::vector<TensorView>& keys, const std::vector<TensorView>& values,
             const std::string& ns, const std::string& converted_from,
             const std::string& adapter) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            const KVView kv = KVView::from_hf_layers(keys, values);
            const Provenance provenance{converted_from, adapter};
            py::gil_scoped_release release;
            return store.put(spec, span, kv, ns, provenance);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("keys"), py::arg("values"),
          py::arg("namespace"), py::kw_only(), py::arg("converted_from") = "",
          py::arg("adapter") = "")
      .def(
          "put_kv",
          [](KVStore& store, const ModelSpec& spec, const py::handle& tokens,
             const py::handle& kv, const std::string& ns, const std::string& converted_from,
             const std::string& adapter) -> std::optional<int64_t> {
            // kv is read first, as the general path checks it before the tokens.
            std::vector<TensorView> keys, values;
            if (!python::cpu_pair_views(kv, &keys, &values)) return std::nullopt;
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            const KVView view = KVView::from_hf_layers(keys, values);
            const Provenance provenance{converted_from, adapter};
            py::gil_scoped_release release;
            return store.put(spec, span, view, ns, provenance);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("kv"), py::arg("namespace"), py::kw_only(),
          py::arg("converted_from") = "", py::arg("adapter") = "",
          "put() of a legacy tuple of dense CPU tensors read in place; None (nothing done) for "
          "any other kv, which takes put(spec, tokens, keys, values, namespace) instead.")
      .def(
          "match",
          [](KVStore& store, const ModelSpec& spec, const py::handle& tokens,
             const std::string& ns) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            py::gil_scoped_release release;
            return store.match(spec, span, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("namespace"))
      .def(
          "match_kv",
          [](KVStore& store, const ModelSpec& spec, const py::handle& tokens,
             const std::string& ns) -> py::tuple {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            Match found;
            {
              py::gil_scoped_release release;
              found = store.match(spec, span, ns);
            }
            if (!found) return py::make_tuple(0, py::none(), "", "");
            KVView dst;
            py::tuple kv = python::new_cpu_kv(spec, found.tokens(), &dst);
            python::copy_releasing_gil_if_large(dst.bytes(), [&] { found.copy_to(dst); });
            const Provenance p = found.converted_provenance();
            return py::make_tuple(found.tokens(), std::move(kv), p.source_fingerprint,
                                  p.adapter_fingerprint);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("namespace"),
          "(tokens, kv, source fingerprint, adapter fingerprint) of match(): kv is the matched "
          "prefix copied into a legacy tuple of fresh contiguous CPU torch tensors, None (and "
          "tokens 0) on a miss.")
      .def(
          "match_length",
          [](KVStore& store, const ModelSpec& spec, const py::handle& tokens,
             const std::string& ns) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            MatchLength found;
            {
              py::gil_scoped_release release;
              found = store.match_length(spec, span, ns);
            }
            return py::make_tuple(found.tokens, found.converted_provenance.source_fingerprint,
                                  found.converted_provenance.adapter_fingerprint);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("namespace"),
          "(tokens, source fingerprint, adapter fingerprint) of KVStore::match_length.")
      .def(
          "erase",
          [](KVStore& store, const ModelSpec& spec, const py::handle& tokens,
             const std::string& ns, unsigned tiers) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            py::gil_scoped_release release;
            return store.erase(spec, span, ns, tiers);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("namespace"), py::arg("tiers") = kAllTiers)
      .def(
          "invalidate",
          [](KVStore& store, const ModelSpec& spec) {
            return python::invalidation([&] { return store.invalidate(spec); });
          },
          py::arg("spec"))
      .def(
          "invalidate_adapter",
          [](KVStore& store, const ModelSpec& target, const std::string& adapter_fingerprint) {
            return python::invalidation(
                [&] { return store.invalidate_adapter(target, adapter_fingerprint); });
          },
          py::arg("target"), py::arg("adapter_fingerprint"))
      .def("clear", &KVStore::clear, py::arg("tiers") = kMemoryTier | kDiskTier,
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const KVStore& s) { return stats_dict(s.stats()); })
      .def("metrics_text", &KVStore::metrics_text);

  py::class_<FitOptions> fit_options(m, "FitOptions");
  py::enum_<FitOptions::Selection>(fit_options, "Selection")
      .value("AUTO", FitOptions::Selection::kAuto)
      .value("ALL", FitOptions::Selection::kAll)
      .value("EXPLICIT", FitOptions::Selection::kExplicit);
  fit_options.def(py::init<>())
      .def_readwrite("selection", &FitOptions::selection)
      .def_readwrite("source_layers", &FitOptions::source_layers)
      .def_readwrite("max_source_layers", &FitOptions::max_source_layers)
      .def_readwrite("rope_aware", &FitOptions::rope_aware)
      .def_readwrite("alignment_policy", &FitOptions::alignment_policy)
      .def_readwrite("ridge_grid", &FitOptions::ridge_grid)
      .def_readwrite("holdout", &FitOptions::holdout)
      .def_readwrite("seed", &FitOptions::seed)
      .def_readwrite("max_memory_bytes", &FitOptions::max_memory_bytes)
      .def_readwrite("min_gain", &FitOptions::min_gain)
      .def_readwrite("exact_candidates", &FitOptions::exact_candidates)
      .def_readwrite("target_key_norm", &FitOptions::target_key_norm)
      .def_readwrite("token_context", &FitOptions::token_context)
      .def_readwrite("token_code_dims", &FitOptions::token_code_dims)
      // codes: float32 [vocab, dims], copied.
      .def("set_target_token_codes",
           [](FitOptions& o, const py::array_t<float, py::array::c_style | py::array::forcecast>& codes) {
             KVB_CHECK(codes.ndim() == 2, "target_token_codes: expected [vocab, dims], got "
                                              << codes.ndim() << " dimensions");
             o.target_token_codes.vocab = codes.shape(0);
             o.target_token_codes.dims = codes.shape(1);
             o.target_token_codes.values.assign(codes.data(), codes.data() + codes.size());
           },
           py::arg("codes"));

  // Shared: a Bridge holds the adapters registered with it.
  py::class_<LinearAdapter, std::shared_ptr<LinearAdapter>>(m, "LinearAdapter")
      .def_property_readonly("source", &LinearAdapter::source)
      .def_property_readonly("target", &LinearAdapter::target)
      .def_property_readonly("report", [](const LinearAdapter& a) { return report_dict(a.report()); })
      .def("save", &LinearAdapter::save, py::arg("path"))
      .def_property_readonly("fingerprint", &LinearAdapter::fingerprint)
      .def_property_readonly("has_key_norm", &LinearAdapter::has_key_norm)
      .def("key_norm", &LinearAdapter::key_norm, py::arg("layer"))
      .def_property_readonly("has_token_codes", &LinearAdapter::has_token_codes)
      .def_property_readonly("token_context", &LinearAdapter::token_context)
      // float32 [vocab, dims], a copy (empty [0, 0] when none).
      .def_property_readonly("token_codes",
                             [](const LinearAdapter& a) {
                               const TokenCodes& c = a.token_codes();
                               py::array_t<float> out({c.vocab, c.dims});
                               std::memcpy(out.mutable_data(), c.values.data(),
                                           c.values.size() * sizeof(float));
                               return out;
                             })
      .def("token_weights", &LinearAdapter::token_weights, py::arg("layer"), py::arg("kind"))
      // Serving defaults: a dict (NaN figures as None), None when nothing is recorded.
      .def_property_readonly("serving",
                             [](const LinearAdapter& a) -> py::object {
                               const ServingDefaults s = a.serving();
                               if (!s.recorded) return py::none();
                               auto figure = [](double v) -> py::object {
                                 return std::isnan(v) ? py::object(py::none()) : py::float_(v);
                               };
                               py::list measured;
                               for (const ServingPoint& p : s.measured) {
                                 py::dict d;
                                 d["recompute_tail"] = p.recompute_tail;
                                 d["kept"] = figure(p.kept);
                                 d["agreement"] = figure(p.agreement);
                                 d["computed_share"] = figure(p.computed_share);
                                 d["prompt_tokens"] = p.prompt_tokens;
                                 measured.append(d);
                               }
                               py::list by_length;
                               for (const LengthTail& t : s.by_length) {
                                 py::dict d;
                                 d["prompt_tokens"] = t.prompt_tokens;
                                 d["recompute_tail"] = t.recompute_tail;
                                 by_length.append(d);
                               }
                               py::dict out;
                               out["recompute_tail"] = s.recompute_tail;
                               out["recompute_share"] = s.recompute_share;
                               out["by_length"] = by_length;
                               out["agreement_goal"] = figure(s.agreement_goal);
                               out["measured"] = measured;
                               out["note"] = s.note;
                               return std::move(out);
                             })
      // by_length: (prompt_tokens, recompute_tail) per length; measured: (recompute_tail, kept,
      // agreement, computed_share, prompt_tokens) per point, NaN for a figure not measured;
      // recorded false clears the record.
      .def(
          "set_serving",
          [](LinearAdapter& a, bool recorded, int64_t recompute_tail, double recompute_share,
             const std::vector<std::tuple<int64_t, int64_t>>& by_length, double agreement_goal,
             const std::vector<std::tuple<int64_t, double, double, double, int64_t>>& measured,
             const std::string& note) {
            ServingDefaults s;
            s.recorded = recorded;
            s.recompute_tail = recompute_tail;
            s.recompute_share = recompute_share;
            for (const auto& [prompt, tail] : by_length) s.by_length.push_back({prompt, tail});
            s.agreement_goal = agreement_goal;
            s.note = note;
            for (const auto& [r, kept, agreement, share, prompt] : measured)
              s.measured.push_back({r, kept, agreement, share, prompt});
            a.set_serving(s);
          },
          py::arg("recorded"), py::arg("recompute_tail"), py::arg("recompute_share"),
          py::arg("by_length"), py::arg("agreement_goal"),
          py::arg("measured"), py::arg("note"))
      .def_static(
          "load",
          [](const std::string& path, bool allow_unchecked) {
            AdapterLoadOptions o;
            o.allow_unchecked = allow_unchecked;
            return LinearAdapter::load(path, o);
          },
          py::arg("path"), py::kw_only(), py::arg("allow_unchecked") = false)
      .def(
          "convert",
          [](const LinearAdapter& a, const std::vector<TensorView>& src_keys,
             const std::vector<TensorView>& src_values, int64_t start_pos,
             const std::vector<TensorView>& dst_keys, const std::vector<TensorView>& dst_values,
             bool reference, uintptr_t stream, const std::optional<std::vector<int64_t>>& alignment,
             int64_t target_start_pos, const std::optional<std::vector<int64_t>>& target_ids,
             const std::vector<int64_t>& previous_ids) {
            const KVView src = KVView::from_hf_layers(src_keys, src_values);
            const KVView dst = KVView::from_hf_layers(dst_keys, dst_values);
            py::gil_scoped_release release;
            void* s = reinterpret_cast<void*>(stream);
            if (target_ids) {
              const TargetTokens t{TokenSpan(*target_ids), previous_ids};
              if (alignment && reference) {
                a.convert_reference(src, start_pos, dst, *alignment, target_start_pos, t);
              } else if (alignment) {
                a.convert(src, start_pos, dst, *alignment, target_start_pos, t, s);
              } else if (reference) {
                a.convert_reference(src, start_pos, dst, t);
              } else {
                a.convert(src, start_pos, dst, t, s);
              }
            } else if (alignment && reference) {
              a.convert_reference(src, start_pos, dst, *alignment, target_start_pos);
            } else if (alignment) {
              a.convert(src, start_pos, dst, *alignment, target_start_pos, s);
            } else if (reference) {
              a.convert_reference(src, start_pos, dst);
            } else {
              a.convert(src, start_pos, dst, s);
            }
          },
          py::arg("src_keys"), py::arg("src_values"), py::arg("start_pos"), py::arg("dst_keys"),
          py::arg("dst_values"), py::arg("reference") = false, py::arg("stream") = 0,
          py::arg("alignment") = py::none(), py::arg("target_start_pos") = 0,
          py::arg("target_ids") = py::none(), py::arg("previous_ids") = std::vector<int64_t>());

  py::class_<AdapterFitter>(m, "AdapterFitter")
      .def(py::init<const ModelSpec&, const ModelSpec&, const FitOptions&>(), py::arg("source"),
           py::arg("target"), py::arg("options"))
      .def(
          "add",
          [](AdapterFitter& f, const std::vector<TensorView>& src_keys,
             const std::vector<TensorView>& src_values, const std::vector<TensorView>& tgt_keys,
             const std::vector<TensorView>& tgt_values, int64_t start_pos,
             const std::optional<std::vector<int64_t>>& alignment,
             const std::optional<std::vector<int64_t>>& target_ids,
             const std::vector<int64_t>& previous_ids) {
            const KVView src = KVView::from_hf_layers(src_keys, src_values);
            const KVView tgt = KVView::from_hf_layers(tgt_keys, tgt_values);
            py::gil_scoped_release release;
            if (target_ids) {
              const TargetTokens t{TokenSpan(*target_ids), previous_ids};
              if (alignment) {
                f.add(src, tgt, start_pos, *alignment, t);
              } else {
                f.add(src, tgt, start_pos, t);
              }
            } else if (alignment) {
              f.add(src, tgt, start_pos, *alignment);
            } else {
              f.add(src, tgt, start_pos);
            }
          },
          py::arg("src_keys"), py::arg("src_values"), py::arg("tgt_keys"), py::arg("tgt_values"),
          py::arg("start_pos"), py::arg("alignment") = py::none(),
          py::arg("target_ids") = py::none(), py::arg("previous_ids") = std::vector<int64_t>())
      .def_property_readonly("train_tokens", &AdapterFitter::train_tokens)
      .def_property_readonly("holdout_tokens", &AdapterFitter::holdout_tokens)
      .def_property_readonly("memory_bytes", &AdapterFitter::memory_bytes)
      .def_property_readonly("passes", &AdapterFitter::passes)
      .def_property_readonly("pass_index", &AdapterFitter::pass)
      .def("next_pass", &AdapterFitter::next_pass, py::call_guard<py::gil_scoped_release>())
      .def("candidate_layers", &AdapterFitter::candidate_layers)
      .def(
          "fit",
          [](const AdapterFitter& f, const py::object& progress) {
            // Called from fit()'s threads with the GIL released: each call takes it.
            FitProgressCallback callback;
            if (!progress.is_none())
              callback = [&progress](const FitProgress& p) {
                py::gil_scoped_acquire gil;
                progress(p.done, p.total, p.target_layer, p.source_layers);
              };
            py::gil_scoped_release release;
            return f.fit(callback);
          },
          py::arg("progress") = py::none());

  m.def(
      "align",
      [](const std::vector<int64_t>& source_starts, const std::vector<int64_t>& source_ends,
         const std::vector<int64_t>& target_starts, const std::vector<int64_t>& target_ends,
         const std::string& policy, const std::vector<std::string>& source_roles,
         const std::vector<std::string>& target_roles) {
        const auto spans = [](const std::vector<int64_t>& starts, const std::vector<int64_t>& ends) {
          KVB_CHECK(starts.size() == ends.size(), "offsets: " << starts.size() << " starts and "
                                                              << ends.size() << " ends");
          std::vector<TextSpan> out(starts.size());
          for (size_t i = 0; i < out.size(); ++i) out[i] = {starts[i], ends[i]};
          return out;
        };
        const std::vector<int64_t> a =
            align(spans(source_starts, source_ends), spans(target_starts, target_ends),
                  parse_align_policy(policy), source_roles, target_roles);
        py::array_t<int64_t> out(static_cast<py::ssize_t>(a.size()));
        std::copy(a.begin(), a.end(), out.mutable_data());
        return out;
      },
      py::arg("source_starts"), py::arg("source_ends"), py::arg("target_starts"),
      py::arg("target_ends"), py::arg("policy"), py::arg("source_roles"),
      py::arg("target_roles"));

  m.def(
      "prefix_hashes",
      [](const ModelSpec& spec, const py::handle& tokens, const std::string& ns,
         int64_t chunk_tokens) {
        spec.validate();
        const PyTokens ids(tokens);
        const Hash128 salt = prefix_salt(ns, spec);
        std::vector<std::string> out{salt.hex()};
        for (const Hash128& h : prefix_hashes(salt, ids.span(), chunk_tokens))
          out.push_back(h.hex());
        return out;
      },
      py::arg("spec"), py::arg("tokens"), py::arg("namespace"), py::arg("chunk_tokens"));

  python::bind_bridge(m);
}
