#include "kvbridge/bridge.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>

#include "kvbridge/error.h"
#include "src/bridge/bridge_impl.h"
#include "src/core/dtype_convert.h"
#include "src/core/prometheus.h"

namespace kvbridge {

using detail::Registered;

int64_t Bridge::Impl::tail_of(const LinearAdapter& adapter, int64_t prompt_tokens) const {
  if (options.recompute_tail >= 0) return options.recompute_tail;
  return adapter.serving().tail_for(prompt_tokens);
}

int64_t Bridge::Impl::tail_of(const std::string& adapter_fp, int64_t prompt_tokens) {
  if (options.recompute_tail >= 0) return options.recompute_tail;
  std::shared_ptr<const LinearAdapter> adapter;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (Registered* r = find(adapter_fp)) adapter = r->adapter;
  }
  return adapter ? tail_of(*adapter, prompt_tokens) : 0;
}

Registered* Bridge::Impl::find(const std::string& adapter_fp) {
  for (Registered& r : registry)
    if (r.adapter->fingerprint() == adapter_fp) return &r;
  return nullptr;
}

std::shared_ptr<const LinearAdapter> Bridge::Impl::disable(Registered& r) {
  return r.monitor->disable() ? r.adapter : nullptr;
}

void Bridge::Impl::enable(Registered& r) {
  r.monitor->enable();
  dropped.erase(r.adapter->fingerprint());
}

void Bridge::Impl::drop(std::unique_lock<std::mutex>& lock, const std::string& adapter_fp) {
  dropped.insert(adapter_fp);
  at("dropped");
  written.wait(lock, [&] { return writing.find(adapter_fp) == writing.end(); });
}

Bridge::Impl::Write::Write(Impl& m, std::string adapter_fp) : m_(m), fp_(std::move(adapter_fp)) {
  if (fp_.empty()) {
    ok_ = true;
    return;
  }
  std::lock_guard<std::mutex> lock(m_.mu);
  if (m_.dropped.count(fp_)) return;
  ++m_.writing[fp_];
  ok_ = counted_ = true;
}

Bridge::Impl::Write::~Write() {
  if (!counted_) return;
  {
    std::lock_guard<std::mutex> lock(m_.mu);
    auto it = m_.writing.find(fp_);
    if (--it->second == 0) m_.writing.erase(it);
  }
  m_.written.notify_all();
}

detail::Usable Bridge::Impl::usable_prefix(const Match& match, bool count) {
  detail::Usable out;
  out.tokens = out.own = match.tokens();
  const int64_t chunks = match.chunks();
  if (chunks == 0) return out;
  const int64_t chunk_tokens = match.tokens() / chunks;
  std::vector<Provenance> provenance;
  for (int64_t c = 0; c < chunks; ++c) provenance.push_back(match.provenance(c));
  if (std::none_of(provenance.begin(), provenance.end(),
                   [](const Provenance& p) { return p.converted(); }))
    return out;  // the common case: the model's own KV, no lock taken
  std::lock_guard<std::mutex> lock(mu);
  for (int64_t c = 0; c < chunks; ++c) {
    const Provenance& p = provenance[static_cast<size_t>(c)];
    if (!p.converted()) continue;
    if (dropped.count(p.adapter_fingerprint)) {
      out.tokens = c * chunk_tokens;
      out.own = std::min(out.own, out.tokens);
      if (count) dropped_tokens.fetch_add(match.tokens() - out.tokens, std::memory_order_relaxed);
      return out;
    }
    if (!out.origin.converted()) {
      out.origin = p;
      out.own = c * chunk_tokens;
    }
  }
  return out;
}

Load::~Load() = default;

void Load::copy_to(const KVView& dst) const {
  KVB_CHECK(dst.tokens() == tokens_,
            "dst holds " << dst.tokens() << " tokens but the load has " << tokens_);
  if (tokens_ == 0) return;
  KVB_CHECK(buffer_ || native_, "this Load came from Bridge::probe and holds no KV");
  if (buffer_) {
    copy_kv(buffer_view_, dst);
  } else {
    native_.copy_range_to(0, dst);
  }
  if (start_) copy_kv(start_view_, dst.slice_tokens(0, 1));
}

Bridge::Bridge(KVStore& store, const BridgeOptions& options) {
  KVB_CHECK(!std::isnan(options.min_quality), "min_quality must not be NaN");
  KVB_CHECK(options.recompute_tail >= -1,
            "recompute_tail must be >= 0, or -1 for each adapter's recorded tail, got "
                << options.recompute_tail);
  KVB_CHECK(options.min_agreement == -std::numeric_limits<double>::infinity() ||
                (options.min_agreement >= 0 && options.min_agreement <= 1),
            "min_agreement must lie in [0, 1] or be -infinity, got " << options.min_agreement);
  KVB_CHECK(options.check_window >= 1, "check_window must be >= 1, got " << options.check_window);
  KVB_CHECK(options.min_checks >= 1 && options.min_checks <= options.check_window,
            "min_checks must lie in [1, check_window = " << options.check_window << "], got "
                                                         << options.min_checks);
  impl_ = std::make_unique<Impl>(store, options);
}

Bridge::~Bridge() = default;

const BridgeOptions& Bridge::options() const noexcept { return impl_->options; }
KVStore& Bridge::store() const noexcept { return impl_->store; }

double Bridge::quality(const LinearAdapter& adapter) {
  const FitReport& report = adapter.report();
  if (report.layers.empty()) return -std::numeric_limits<double>::infinity();
  double q = std::numeric_limits<double>::infinity();
  for (const LayerFit& layer : report.layers) {
    // A NaN R² (never produced by the fitter, but a file could carry one) counts as unusable.
    if (std::isnan(layer.r2_key) || std::isnan(layer.r2_value))
      return -std::numeric_limits<double>::infinity();
    q = std::min({q, layer.r2_key, layer.r2_value});
  }
  return q;
}

int64_t Bridge::recompute_tail(const LinearAdapter& adapter, int64_t prompt_tokens) const {
  KVB_CHECK(prompt_tokens >= 0,
            "recompute_tail: prompt_tokens must be >= 0, got " << prompt_tokens);
  return impl_->tail_of(adapter, prompt_tokens);
}

void Bridge::add_adapter(std::shared_ptr<const LinearAdapter> adapter, bool replace) {
  KVB_CHECK(adapter != nullptr, "add_adapter: null adapter");
  const ModelSpec& source = adapter->source();
  const ModelSpec& target = adapter->target();
  Registered entry;
  entry.source_fp = source.fingerprint();
  entry.target_fp = target.fingerprint();
  KVB_CHECK(entry.source_fp != entry.target_fp,
            "add_adapter: source and target are the same model '" << source.name
                                                                   << "' (its own cache is used)");
  KVB_CHECK(!source.tokenizer.empty() && !target.tokenizer.empty(),
            "add_adapter: cross-model reuse needs non-empty tokenizer ids, got '"
                << source.tokenizer << "' (" << source.name << ") and '" << target.tokenizer
                << "' (" << target.name << ")");
  KVB_CHECK(source.tokenizer == target.tokenizer || !adapter->report().alignment_policy.empty(),
            "add_adapter: " << source.name << " and " << target.name
                            << " have different tokenizer ids ('" << source.tokenizer << "', '"
                            << target.tokenizer
                            << "'); such a pair needs an adapter fitted with an alignment policy "
                               "(FitOptions::alignment_policy) on aligned samples");
  entry.quality = quality(*adapter);
  entry.adapter = adapter;
  std::shared_ptr<const LinearAdapter> replaced;
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    auto& reg = impl_->registry;
    auto it = std::find_if(reg.begin(), reg.end(), [&](const Registered& r) {
      return r.source_fp == entry.source_fp && r.target_fp == entry.target_fp;
    });
    if (it == reg.end()) {
      impl_->dropped.erase(adapter->fingerprint());
      reg.push_back(std::move(entry));
      return;
    }
    KVB_CHECK(replace, "add_adapter: an adapter " << source.name << " -> " << target.name
                                                  << " is already registered (pass replace)");
    replaced = std::move(it->adapter);
    *it = std::move(entry);
    impl_->dropped.erase(adapter->fingerprint());
    if (replaced->fingerprint() == adapter->fingerprint()) return;
    impl_->drop(lock, replaced->fingerprint());
  }
  // Outside the lock (it scans every tier); loads meanwhile already use the new adapter.
  invalidate_adapter(*replaced);
}

bool Bridge::remove_adapter(const ModelSpec& source, const ModelSpec& target) {
  const std::string source_fp = source.fingerprint(), target_fp = target.fingerprint();
  std::shared_ptr<const LinearAdapter> gone;  // purged and released after the lock is dropped
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    auto& reg = impl_->registry;
    auto it = std::find_if(reg.begin(), reg.end(), [&](const Registered& r) {
      return r.source_fp == source_fp && r.target_fp == target_fp;
    });
    if (it == reg.end()) return false;
    gone = std::move(it->adapter);
    reg.erase(it);
    impl_->drop(lock, gone->fingerprint());
  }
  invalidate_adapter(*gone);
  return true;
}

InvalidateResult Bridge::invalidate_adapter(const LinearAdapter& adapter) {
  return impl_->store.invalidate_adapter(adapter.target(), adapter.fingerprint());
}

std::vector<std::shared_ptr<const LinearAdapter>> Bridge::adapters() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::shared_ptr<const LinearAdapter>> out;
  out.reserve(impl_->registry.size());
  for (const Registered& r : impl_->registry) out.push_back(r.adapter);
  return out;
}

int64_t Bridge::save(const ModelSpec& spec, TokenSpan tokens, const KVView& kv,
                     std::string_view ns, const Provenance& provenance) {
  Impl& m = *impl_;
  m.saves.fetch_add(1, std::memory_order_relaxed);
  kv.check_matches(spec, "kv");
  if (kv.device().type == DeviceType::kCPU) {  // put refuses other devices itself
    const auto bad = detail::find_nonfinite(kv);
    if (bad) m.nonfinite_refused.fetch_add(1, std::memory_order_relaxed);
    KVB_CHECK(!bad, "save: " << spec.name << "'s KV holds a NaN or an infinity (layer "
                             << bad->layer << ", " << (bad->kind ? "V" : "K") << ", token "
                             << bad->token << "); nothing was stored");
  }
  Impl::Write write(m, provenance.adapter_fingerprint);
  if (!write) {
    m.dropped_writes.fetch_add(1, std::memory_order_relaxed);
    return 0;
  }
  m.at("writing");
  const int64_t stored = m.store.put(spec, tokens, kv, ns, provenance);
  if (stored > 0 && provenance.source_fingerprint.empty() && provenance.adapter_fingerprint.empty())
    m.starts.add(spec, tokens.data ? tokens.data[0] : static_cast<int64_t>(tokens.data32[0]), kv,
                 /*replace=*/false);
  return stored;
}

void Bridge::add_start(const ModelSpec& spec, int64_t token_id, const KVView& kv) {
  spec.validate();
  KVB_CHECK(token_id >= 0 && token_id < (int64_t{1} << 32),
            "add_start: token_id must lie in [0, 2^32), got " << token_id);
  impl_->starts.add(spec, token_id, kv, /*replace=*/true);
}

bool Bridge::copy_start(const ModelSpec& spec, int64_t token_id, const KVView& dst) const {
  const std::shared_ptr<const detail::StartKV> start =
      impl_->starts.find(spec.fingerprint(), token_id);
  if (!start) return false;
  dst.check_matches(spec, "dst");
  copy_kv(start->view, dst);
  return true;
}

bool Bridge::adapter_dropped(const std::string& adapter_fingerprint) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->dropped.count(adapter_fingerprint) > 0;
}

void Bridge::set_test_hook(std::function<void(std::string_view)> hook) {
  impl_->hook = std::move(hook);
}

Load Bridge::load(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  return impl_->load(spec, tokens, nullptr, nullptr, ns);
}

Load Bridge::load(const ModelSpec& spec, TokenSpan tokens, const Tokenization& target,
                  const SourceTokenizations& sources, std::string_view ns) {
  return impl_->load(spec, tokens, &target, &sources, ns);
}

Load Bridge::probe(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  return impl_->probe(spec, tokens, nullptr, nullptr, ns);
}

Load Bridge::probe(const ModelSpec& spec, TokenSpan tokens, const Tokenization& target,
                   const SourceTokenizations& sources, std::string_view ns) {
  return impl_->probe(spec, tokens, &target, &sources, ns);
}

std::vector<std::string> Bridge::wanted_tokenizers(const ModelSpec& spec, TokenSpan tokens,
                                                   std::string_view ns) {
  return impl_->wanted_tokenizers(spec, tokens, ns);
}

bool Bridge::record_check(const std::string& adapter_fingerprint, const QualityCheck& check) {
  detail::AdapterMonitor::validate(check);
  Impl& m = *impl_;
  std::shared_ptr<const LinearAdapter> purge;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    Registered* r = m.find(adapter_fingerprint);
    KVB_CHECK_AS(NotFound, r != nullptr,
                 "record_check: no registered adapter has fingerprint " << adapter_fingerprint);
    m.quality_checks.fetch_add(1, std::memory_order_relaxed);
    if (!r->monitor->record(check, m.options)) return false;
    purge = r->adapter;
    m.quality_disables.fetch_add(1, std::memory_order_relaxed);
    m.drop(lock, adapter_fingerprint);  // `r` may be stale once this waited
  }
  invalidate_adapter(*purge);  // outside the lock: it scans every tier
  return true;
}

bool Bridge::disable_adapter(const std::string& adapter_fingerprint) {
  std::shared_ptr<const LinearAdapter> purge;
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    Registered* r = impl_->find(adapter_fingerprint);
    if (r == nullptr) return false;
    purge = impl_->disable(*r);
    if (purge) impl_->drop(lock, adapter_fingerprint);
  }
  if (purge) invalidate_adapter(*purge);
  return true;
}

bool Bridge::enable_adapter(const std::string& adapter_fingerprint) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Registered* r = impl_->find(adapter_fingerprint);
  if (r == nullptr) return false;
  impl_->enable(*r);
  return true;
}

std::vector<AdapterHealth> Bridge::adapter_health() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<AdapterHealth> out;
  out.reserve(impl_->registry.size());
  for (const Registered& r : impl_->registry) {
    AdapterHealth a = r.monitor->figures();
    a.adapter = r.adapter->fingerprint();
    a.source = r.adapter->source().name;
    a.target = r.adapter->target().name;
    out.push_back(std::move(a));
  }
  return out;
}

namespace {

// A counter's value as its BridgeStats member: a count, or seconds from nanoseconds.
template <typename T>
T counter_value(const std::atomic<int64_t>& a);
template <>
int64_t counter_value<int64_t>(const std::atomic<int64_t>& a) {
  return a.load(std::memory_order_relaxed);
}
template <>
double counter_value<double>(const std::atomic<int64_t>& a) {
  return static_cast<double>(a.load(std::memory_order_relaxed)) * 1e-9;
}

}  // namespace

BridgeStats Bridge::stats() const {
  const Impl& m = *impl_;
  BridgeStats s;
#define KVBRIDGE_READ_counter(type, member) s.member = counter_value<type>(m.member);
#define KVBRIDGE_READ_gauge(type, member)
#define KVBRIDGE_READ_(type, member, metric, kind, help) KVBRIDGE_READ_##kind(type, member)
  KVBRIDGE_BRIDGE_STATS(KVBRIDGE_READ_)
#undef KVBRIDGE_READ_
#undef KVBRIDGE_READ_gauge
#undef KVBRIDGE_READ_counter
  std::lock_guard<std::mutex> lock(m.mu);
  s.adapters = static_cast<int64_t>(m.registry.size());
  s.adapters_below_quality = static_cast<int64_t>(
      std::count_if(m.registry.begin(), m.registry.end(),
                    [&](const Registered& r) { return !m.usable(r); }));
  s.adapters_disabled = static_cast<int64_t>(
      std::count_if(m.registry.begin(), m.registry.end(),
                    [](const Registered& r) { return !r.monitor->enabled(); }));
  return s;
}

std::string Bridge::metrics_text() const {
  const BridgeStats from = stats();
  const std::vector<AdapterHealth> health = adapter_health();
  detail::PrometheusText out("kvbridge_bridge_");
#define KVBRIDGE_ROW_(type, member, metric, kind, help) \
  detail::emit_row(out, metric, #kind, help, static_cast<double>(from.member));
  KVBRIDGE_BRIDGE_STATS(KVBRIDGE_ROW_)
#undef KVBRIDGE_ROW_
  // Per adapter, labelled by fingerprint and model names.
  auto per_adapter = [&](const char* name, const char* type, const char* help,
                         double (*value)(const AdapterHealth&)) {
    out.family(name, type, help);
    for (const AdapterHealth& a : health)
      out.sample(name,
                 "adapter=\"" + detail::label_value(a.adapter) + "\",source=\"" +
                     detail::label_value(a.source) + "\",target=\"" +
                     detail::label_value(a.target) + "\"",
                 value(a));
  };
  per_adapter("adapter_enabled", "gauge", "1 if the adapter is enabled, 0 if disabled.",
              [](const AdapterHealth& a) { return a.enabled ? 1.0 : 0.0; });
  per_adapter("adapter_agreement", "gauge",
              "Rolling top-1 agreement of converted with own-prefill next tokens.",
              [](const AdapterHealth& a) { return a.agreement; });
  per_adapter("adapter_kl", "gauge",
              "Rolling mean KL(own || converted) of next-token distributions, nats.",
              [](const AdapterHealth& a) { return a.kl; });
  per_adapter("adapter_loss_gap", "gauge",
              "Rolling mean cross-entropy gap (converted minus own), nats per token.",
              [](const AdapterHealth& a) { return a.loss_gap; });
  per_adapter("adapter_window_checks", "gauge", "Checks in the rolling window.",
              [](const AdapterHealth& a) { return static_cast<double>(a.window_checks); });
  per_adapter("adapter_checks_total", "counter", "Quality checks recorded for the adapter.",
              [](const AdapterHealth& a) { return static_cast<double>(a.checks); });
  per_adapter("adapter_disables_total", "counter",
              "Times the adapter was disabled by the agreement floor.",
              [](const AdapterHealth& a) { return static_cast<double>(a.disables); });
  return out.text();
}

}  // namespace kvbridge
