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

py::dict health_dict(const AdapterHealth& a) {
  py::dict d;
  d["adapter"] = a.adapter;
  d["source"] = a.source;
  d["target"] = a.target;
  d["enabled"] = a.enabled;
  d["checks"] = a.checks;
  d["window_checks"] = a.window_checks;
  d["window_positions"] = a.window_positions;
  d["agreement"] = a.agreement;
  d["kl"] = a.kl;
  d["loss_gap"] = a.loss_gap;
  d["disables"] = a.disables;
  return d;
}

// A tokenization from Python: (ids, starts, ends, roles), lists of equal length (roles "" for
// ordinary tokens); the library checks the contents.
Tokenization tokenization(const py::handle& t) {
  const auto parts = t.cast<std::tuple<std::vector<int64_t>, std::vector<int64_t>,
                                       std::vector<int64_t>, std::vector<std::string>>>();
  Tokenization out;
  out.ids = std::get<0>(parts);
  const auto& starts = std::get<1>(parts);
  const auto& ends = std::get<2>(parts);
  KVB_CHECK(starts.size() == ends.size(),
            "tokenization: " << starts.size() << " starts and " << ends.size() << " ends");
  out.spans.resize(starts.size());
  for (size_t i = 0; i < starts.size(); ++i) out.spans[i] = {starts[i], ends[i]};
  out.roles = std::get<3>(parts);
  return out;
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
      .def(py::init([](KVStore& store, double min_quality, bool write_back,
                       int64_t recompute_tail, double min_agreement, int64_t check_window,
                       int64_t min_checks) {
             BridgeOptions o;
             o.min_quality = min_quality;
             o.write_back = write_back;
             o.recompute_tail = recompute_tail;
             o.min_agreement = min_agreement;
             o.check_window = check_window;
             o.min_checks = min_checks;
             return std::make_unique<Bridge>(store, o);
           }),
           py::arg("store"), py::arg("min_quality") = BridgeOptions{}.min_quality,
           py::arg("write_back") = BridgeOptions{}.write_back,
           py::arg("recompute_tail") = BridgeOptions{}.recompute_tail,
           py::arg("min_agreement") = BridgeOptions{}.min_agreement,
           py::arg("check_window") = BridgeOptions{}.check_window,
           py::arg("min_checks") = BridgeOptions{}.min_checks,
           py::keep_alive<1, 2>())  // the Bridge borrows the store
      .def_property_readonly("min_quality", [](const Bridge& b) { return b.options().min_quality; })
      .def_property_readonly("write_back", [](const Bridge& b) { return b.options().write_back; })
      .def_property_readonly("recompute_tail",
                             [](const Bridge& b) { return b.options().recompute_tail; })
      .def_property_readonly("min_agreement",
                             [](const Bridge& b) { return b.options().min_agreement; })
      .def_property_readonly("check_window",
                             [](const Bridge& b) { return b.options().check_window; })
      .def_property_readonly("min_checks", [](const Bridge& b) { return b.options().min_checks; })
      .def(
          "record_check",
          [](Bridge& b, const std::string& adapter, int64_t positions, int64_t agreed,
             double kl_sum, int64_t loss_positions, double loss_gap_sum) {
            QualityCheck c;
            c.positions = positions;
            c.agreed = agreed;
            c.kl_sum = kl_sum;
            c.loss_positions = loss_positions;
            c.loss_gap_sum = loss_gap_sum;
            py::gil_scoped_release release;
            return b.record_check(adapter, c);
          },
          py::arg("adapter"), py::arg("positions"), py::arg("agreed"), py::arg("kl_sum"),
          py::arg("loss_positions"), py::arg("loss_gap_sum"))
      .def("disable_adapter", &Bridge::disable_adapter, py::arg("adapter"),
           py::call_guard<py::gil_scoped_release>())
      .def("enable_adapter", &Bridge::enable_adapter, py::arg("adapter"),
           py::call_guard<py::gil_scoped_release>())
      .def("adapter_health",
           [](const Bridge& b) {
             py::list out;
             for (const AdapterHealth& a : b.adapter_health()) out.append(health_dict(a));
             return out;
           })
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
      .def(
          "load_across",
          [](Bridge& b, const ModelSpec& spec, const py::handle& tokens, const py::handle& target,
             const py::function& tokenize, const std::string& ns) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            const Tokenization target_text = tokenization(target);
            // Called by the library on this thread; a Python exception propagates out of load.
            const TokenizeText source_text = [&tokenize](const std::string& id, Tokenization& out) {
              py::gil_scoped_acquire gil;
              const py::object got = tokenize(id);
              if (got.is_none()) return false;
              out = tokenization(got);
              return true;
            };
            py::gil_scoped_release release;
            return b.load(spec, span, target_text, source_text, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("target"), py::arg("tokenize"),
          py::arg("namespace"))
      .def("stats", [](const Bridge& b) { return stats_dict(b.stats()); })
      .def("prometheus_text", &Bridge::prometheus_text);
}

}  // namespace kvbridge::python
