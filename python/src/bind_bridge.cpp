// pybind11 bindings of the Bridge: type conversions only (see bindings.cpp).
#include "bind_bridge.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "kvbridge/kvbridge.h"
#include "tokens.h"

namespace py = pybind11;

namespace kvbridge::python {

namespace {

// One key per row of KVBRIDGE_BRIDGE_STATS (bridge.h).
py::dict stats_dict(const BridgeStats& from) {
  py::dict d;
#define KVBRIDGE_DICT_ITEM_(type, member, metric, kind, help) d[#member] = from.member;
  KVBRIDGE_BRIDGE_STATS(KVBRIDGE_DICT_ITEM_)
#undef KVBRIDGE_DICT_ITEM_
  return d;
}

}  // namespace

void bind_bridge(py::module_& m) {
  py::class_<Load>(m, "BridgeLoad")
      .def_property_readonly("tokens", &Load::tokens)
      .def_property_readonly("native_tokens", &Load::native_tokens)
      .def_property_readonly("converted", &Load::converted)
      .def_property_readonly("source", &Load::source)
      .def_property_readonly("quality", &Load::quality)
      .def_property_readonly("converted_from", &Load::converted_from)
      .def_property_readonly("adapter", &Load::adapter)
      .def(
          "copy_to",
          [](const Load& load, const std::vector<TensorView>& keys,
             const std::vector<TensorView>& values) {
            const KVView dst = KVView::from_hf_layers(keys, values);
            py::gil_scoped_release release;
            load.copy_to(dst);
          },
          py::arg("keys"), py::arg("values"));

  py::class_<Bridge>(m, "Bridge")
      .def(py::init([](KVStore& store, double min_quality, bool write_back) {
             BridgeOptions o;
             o.min_quality = min_quality;
             o.write_back = write_back;
             return std::make_unique<Bridge>(store, o);
           }),
           py::arg("store"), py::arg("min_quality") = BridgeOptions{}.min_quality,
           py::arg("write_back") = BridgeOptions{}.write_back,
           py::keep_alive<1, 2>())  // the Bridge borrows the store
      .def_property_readonly("min_quality", [](const Bridge& b) { return b.options().min_quality; })
      .def_property_readonly("write_back", [](const Bridge& b) { return b.options().write_back; })
      .def(
          "add_adapter",
          [](Bridge& b, std::shared_ptr<LinearAdapter> adapter, bool replace) {
            b.add_adapter(std::move(adapter), replace);
          },
          py::arg("adapter"), py::arg("replace") = false)
      .def("remove_adapter", &Bridge::remove_adapter, py::arg("source"), py::arg("target"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "invalidate_adapter",
          [](Bridge& b, const LinearAdapter& adapter) {
            return invalidation([&] { return b.invalidate_adapter(adapter); });
          },
          py::arg("adapter"))
      .def("adapters",
           [](const Bridge& b) {
             std::vector<std::shared_ptr<LinearAdapter>> out;
             for (auto& a : b.adapters()) out.push_back(std::const_pointer_cast<LinearAdapter>(a));
             return out;
           })
      .def_static("quality", &Bridge::quality, py::arg("adapter"))
      .def(
          "save",
          [](Bridge& b, const ModelSpec& spec, const py::handle& tokens,
             const std::vector<TensorView>& keys, const std::vector<TensorView>& values,
             const std::string& ns) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            const KVView kv = KVView::from_hf_layers(keys, values);
            py::gil_scoped_release release;
            return b.save(spec, span, kv, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("keys"), py::arg("values"),
          py::arg("namespace"))
      .def(
          "load",
          [](Bridge& b, const ModelSpec& spec, const py::handle& tokens, const std::string& ns) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            py::gil_scoped_release release;
            return b.load(spec, span, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("namespace"))
      .def("stats", [](const Bridge& b) { return stats_dict(b.stats()); })
      .def("prometheus_text", &Bridge::prometheus_text);
}

}  // namespace kvbridge::python
