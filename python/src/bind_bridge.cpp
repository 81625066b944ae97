// pybind11 bindings of the Bridge: type conversions only (see bindings.cpp).
#include "bind_bridge.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "field_types.h"
#include "kvbridge/kvbridge.h"
#include "tokens.h"

namespace py = pybind11;

namespace kvbridge::python {

namespace {

// One key per row of KVBRIDGE_BRIDGE_STATS (bridge_stats.h).
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

// load() and probe() take the same arguments: both are bound through these two calls.
using PlainLoad = Load (Bridge::*)(const ModelSpec&, TokenSpan, std::string_view);
using AcrossLoad = Load (Bridge::*)(const ModelSpec&, TokenSpan, const Tokenization&,
                                    const SourceTokenizations&, std::string_view);

Load call_plain(PlainLoad method, Bridge& b, const ModelSpec& spec, const py::handle& tokens,
                const std::string& ns) {
  const PyTokens ids(tokens);
  const TokenSpan span = ids.span();
  py::gil_scoped_release release;
  return (b.*method)(spec, span, ns);
}

Load call_across(AcrossLoad method, Bridge& b, const ModelSpec& spec, const py::handle& tokens,
                 const py::handle& target, const py::dict& sources, const std::string& ns) {
  const PyTokens ids(tokens);
  const TokenSpan span = ids.span();
  const Tokenization target_text = tokenization(target);
  SourceTokenizations source_texts;
  for (const auto& [id, text] : sources)
    source_texts.emplace(id.cast<std::string>(), tokenization(text));
  py::gil_scoped_release release;
  return (b.*method)(spec, span, target_text, source_texts, ns);
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
      .def_property_readonly("recompute_tail", &Load::recompute_tail)
      .def(
          "copy_to",
          [](const Load& load, const std::vector<TensorView>& keys,
             const std::vector<TensorView>& values) {
            const KVView dst = KVView::from_hf_layers(keys, values);
            py::gil_scoped_release release;
            load.copy_to(dst);
          },
          py::arg("keys"), py::arg("values"));

  // The constructor's keyword arguments (after the store), their defaults (BridgeOptions{}'s)
  // and the read-only properties, one per row of KVBRIDGE_BRIDGE_OPTIONS (bridge_options.h).
#define KVBRIDGE_OPTION_PARAM_(type, member, default_value, doc) , type member
#define KVBRIDGE_OPTION_SET_(type, member, default_value, doc) o.member = member;
#define KVBRIDGE_OPTION_ARG_(type, member, default_value, doc) \
  , py::arg(#member) = BridgeOptions{}.member
#define KVBRIDGE_OPTION_PROPERTY_(type, member, default_value, doc) \
  .def_property_readonly(                                           \
      #member, [](const Bridge& b) { return b.options().member; }, doc)
  py::class_<Bridge> bridge(m, "Bridge");
  bridge
      .def(py::init([](KVStore& store KVBRIDGE_BRIDGE_OPTIONS(KVBRIDGE_OPTION_PARAM_)) {
             BridgeOptions o;
             KVBRIDGE_BRIDGE_OPTIONS(KVBRIDGE_OPTION_SET_)
             return std::make_unique<Bridge>(store, o);
           }),
           py::arg("store") KVBRIDGE_BRIDGE_OPTIONS(KVBRIDGE_OPTION_ARG_),
           py::keep_alive<1, 2>())  // the Bridge borrows the store
      KVBRIDGE_BRIDGE_OPTIONS(KVBRIDGE_OPTION_PROPERTY_)
      .def(
          "recompute_tail_for",
          [](const Bridge& b, const LinearAdapter& adapter, int64_t prompt_tokens) {
            return b.recompute_tail(adapter, prompt_tokens);
          },
          py::arg("adapter"), py::arg("prompt_tokens"))
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
      .def("adapter_dropped", &Bridge::adapter_dropped, py::arg("adapter"))
      .def("adapter_health",
           [](const Bridge& b) {
             py::list out;
             for (const AdapterHealth& a : b.adapter_health()) out.append(health_dict(a));
             return out;
           })
      .def(
          "add_adapter",
          [](Bridge& b, std::shared_ptr<LinearAdapter> adapter, bool replace) {
            py::gil_scoped_release release;  // a replacing add waits for write-backs, purges
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
             const std::string& ns, const std::string& converted_from,
             const std::string& adapter) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            const KVView kv = KVView::from_hf_layers(keys, values);
            py::gil_scoped_release release;
            return b.save(spec, span, kv, ns, Provenance{converted_from, adapter});
          },
          py::arg("spec"), py::arg("tokens"), py::arg("keys"), py::arg("values"),
          py::arg("namespace"), py::arg("converted_from") = "", py::arg("adapter") = "")
      .def(
          "load",
          [](Bridge& b, const ModelSpec& spec, const py::handle& tokens, const std::string& ns) {
            return call_plain(&Bridge::load, b, spec, tokens, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("namespace"))
      .def(
          "load_across",
          [](Bridge& b, const ModelSpec& spec, const py::handle& tokens, const py::handle& target,
             const py::dict& sources, const std::string& ns) {
            return call_across(&Bridge::load, b, spec, tokens, target, sources, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("target"), py::arg("sources"),
          py::arg("namespace"))
      .def(
          "probe",
          [](Bridge& b, const ModelSpec& spec, const py::handle& tokens, const std::string& ns) {
            return call_plain(&Bridge::probe, b, spec, tokens, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("namespace"))
      .def(
          "probe_across",
          [](Bridge& b, const ModelSpec& spec, const py::handle& tokens, const py::handle& target,
             const py::dict& sources, const std::string& ns) {
            return call_across(&Bridge::probe, b, spec, tokens, target, sources, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("target"), py::arg("sources"),
          py::arg("namespace"))
      .def(
          "wanted_tokenizers",
          [](Bridge& b, const ModelSpec& spec, const py::handle& tokens, const std::string& ns) {
            const PyTokens ids(tokens);
            const TokenSpan span = ids.span();
            py::gil_scoped_release release;
            return b.wanted_tokenizers(spec, span, ns);
          },
          py::arg("spec"), py::arg("tokens"), py::arg("namespace"))
      .def(
          "add_start",
          [](Bridge& b, const ModelSpec& spec, int64_t token_id,
             const std::vector<TensorView>& keys, const std::vector<TensorView>& values) {
            const KVView kv = KVView::from_hf_layers(keys, values);
            py::gil_scoped_release release;
            b.add_start(spec, token_id, kv);
          },
          py::arg("spec"), py::arg("token_id"), py::arg("keys"), py::arg("values"))
      .def(
          "copy_start",
          [](const Bridge& b, const ModelSpec& spec, int64_t token_id,
             const std::vector<TensorView>& keys, const std::vector<TensorView>& values) {
            const KVView dst = KVView::from_hf_layers(keys, values);
            py::gil_scoped_release release;
            return b.copy_start(spec, token_id, dst);
          },
          py::arg("spec"), py::arg("token_id"), py::arg("keys"), py::arg("values"))
      .def("stats", [](const Bridge& b) { return stats_dict(b.stats()); })
      .def("metrics_text", &Bridge::metrics_text);

  // Bridge.OPTIONS: ((name, type, default, doc), ...) in the table's order, for the Python
  // wrapper (kvbridge.Bridge takes its options from it) and the stub check.
  py::list options;
#define KVBRIDGE_OPTION_ROW_(type, member, default_value, doc) \
  options.append(py::make_tuple(#member, python_type_name<type>(), BridgeOptions{}.member, doc));
  KVBRIDGE_BRIDGE_OPTIONS(KVBRIDGE_OPTION_ROW_)
  bridge.attr("OPTIONS") = py::tuple(options);
#undef KVBRIDGE_OPTION_ROW_
#undef KVBRIDGE_OPTION_PROPERTY_
#undef KVBRIDGE_OPTION_ARG_
#undef KVBRIDGE_OPTION_SET_
#undef KVBRIDGE_OPTION_PARAM_
}

}  // namespace kvbridge::python
