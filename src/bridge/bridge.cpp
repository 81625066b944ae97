#include "kvbridge/bridge.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <new>

#include "kvbridge/error.h"
#include "src/core/prometheus.h"

namespace kvbridge {

namespace {

using Clock = std::chrono::steady_clock;

int64_t elapsed_ns(Clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count();
}

struct Registered {
  std::shared_ptr<const LinearAdapter> adapter;
  std::string source_fp, target_fp;
  double quality = 0;
};

// A dense canonical buffer [layers, 2, tokens, kv_heads, head_dim] of `spec`'s dtype.
std::shared_ptr<void> allocate_kv(const ModelSpec& spec, int64_t tokens) {
  const int64_t bytes = std::max<int64_t>(spec.kv_bytes_per_token() * tokens, 1);
  return std::shared_ptr<void>(new unsigned char[static_cast<size_t>(bytes)],
                               [](void* p) { delete[] static_cast<unsigned char*>(p); });
}

KVView dense_view(void* data, const ModelSpec& spec, int64_t tokens) {
  return KVView::contiguous(data, spec.dtype, Device{}, spec.num_layers, tokens,
                            spec.num_kv_heads, spec.head_dim);
}

}  // namespace

struct Bridge::Impl {
  Impl(KVStore& s, const BridgeOptions& o) : store(s), options(o) {}
  KVStore& store;
  const BridgeOptions options;

  mutable std::mutex mu;            // guards `registry`
  std::vector<Registered> registry;  // registration order

  std::atomic<int64_t> saves{0}, loads{0}, native_hits{0}, converted_hits{0}, misses{0},
      conversions{0}, native_tokens{0}, converted_tokens{0}, written_back_tokens{0},
      skipped_quality{0}, skipped_stale{0}, lookup_ns{0}, convert_ns{0};

  bool usable(const Registered& r) const { return r.quality >= options.min_quality; }
};

Load::~Load() = default;

void Load::copy_to(const KVView& dst) const {
  KVB_CHECK(dst.tokens() == tokens_,
            "dst holds " << dst.tokens() << " tokens but the load has " << tokens_);
  if (tokens_ == 0) return;
  if (buffer_) {
    copy_kv(buffer_view_, dst);
  } else {
    native_.copy_range_to(0, dst);
  }
}

Bridge::Bridge(KVStore& store, const BridgeOptions& options) {
  KVB_CHECK(!std::isnan(options.min_quality), "min_quality must not be NaN");
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
  KVB_CHECK(!source.tokenizer.empty() && source.tokenizer == target.tokenizer,
            "add_adapter: cross-model reuse needs equal, non-empty tokenizer ids, got '"
                << source.tokenizer << "' (" << source.name << ") and '" << target.tokenizer
                << "' (" << target.name << ")");
  entry.quality = quality(*adapter);
  entry.adapter = adapter;
  std::shared_ptr<const LinearAdapter> replaced;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto& reg = impl_->registry;
    auto it = std::find_if(reg.begin(), reg.end(), [&](const Registered& r) {
      return r.source_fp == entry.source_fp && r.target_fp == entry.target_fp;
    });
    if (it == reg.end()) {
      reg.push_back(std::move(entry));
      return;
    }
    KVB_CHECK(replace, "add_adapter: an adapter " << source.name << " -> " << target.name
                                                  << " is already registered (pass replace)");
    replaced = std::move(it->adapter);
    *it = std::move(entry);
  }
  // Outside the lock (it scans every tier); loads meanwhile already use the new adapter.
  if (replaced->fingerprint() != adapter->fingerprint()) invalidate_adapter(*replaced);
}

bool Bridge::remove_adapter(const ModelSpec& source, const ModelSpec& target) {
  const std::string source_fp = source.fingerprint(), target_fp = target.fingerprint();
  std::shared_ptr<const LinearAdapter> gone;  // purged and released after the lock is dropped
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto& reg = impl_->registry;
    auto it = std::find_if(reg.begin(), reg.end(), [&](const Registered& r) {
      return r.source_fp == source_fp && r.target_fp == target_fp;
    });
    if (it == reg.end()) return false;
    gone = std::move(it->adapter);
    reg.erase(it);
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
                     std::string_view ns) {
  impl_->saves.fetch_add(1, std::memory_order_relaxed);
  return impl_->store.put(spec, tokens, kv, ns);
}

Load Bridge::load(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  Impl& m = *impl_;
  spec.validate();
  if (tokens.size > 0) check_tokens(tokens);
  m.loads.fetch_add(1, std::memory_order_relaxed);
  Load out;
  const int64_t n = static_cast<int64_t>(tokens.size);
  const int64_t limit = n - 1;  // the target computes at least the last token itself
  if (limit <= 0) {
    m.misses.fetch_add(1, std::memory_order_relaxed);
    return out;
  }

  auto start = Clock::now();
  Match native = m.store.match(spec, tokens, ns);
  m.lookup_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  const int64_t native_len = native.tokens();

  // Candidates: adapters to exactly this spec, copied out so the lock is not held while working.
  const std::string target_fp = spec.fingerprint();
  std::vector<Registered> candidates;
  int64_t skipped_quality = 0, skipped_stale = 0;
  if (native_len < limit) {
    std::lock_guard<std::mutex> lock(m.mu);
    for (const Registered& r : m.registry) {
      if (r.target_fp != target_fp) {
        if (r.adapter->target().name == spec.name) ++skipped_stale;
        continue;
      }
      if (!m.usable(r)) {
        ++skipped_quality;
        continue;
      }
      candidates.push_back(r);
    }
  }
  m.skipped_quality.fetch_add(skipped_quality, std::memory_order_relaxed);
  m.skipped_stale.fetch_add(skipped_stale, std::memory_order_relaxed);

  // The longest source prefix; ties go to the higher quality, then the earlier registered.
  const Registered* best = nullptr;
  Match best_match;
  for (const Registered& r : candidates) {
    start = Clock::now();
    Match found = m.store.match(r.adapter->source(), tokens, ns);
    m.lookup_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
    const int64_t len = found.tokens();
    if (std::min(len, limit) <= std::min(native_len, limit)) continue;
    if (best && (len < best_match.tokens() ||
                 (len == best_match.tokens() && r.quality <= best->quality)))
      continue;
    best = &r;
    best_match = std::move(found);
  }

  if (!best) {
    if (native_len == 0) {
      m.misses.fetch_add(1, std::memory_order_relaxed);
      return out;
    }
    out.tokens_ = std::min(native_len, limit);
    out.native_tokens_ = out.tokens_;
    out.source_ = spec.name;
    out.quality_ = std::numeric_limits<double>::quiet_NaN();
    // Entries an earlier conversion wrote back are native hits now; say where they came from.
    for (int64_t c = 0; c < native.chunks(); ++c) {
      const Provenance p = native.provenance(c);
      if (p.converted()) {
        out.converted_from_ = p.source_fingerprint;
        out.adapter_ = p.adapter_fingerprint;
        break;
      }
    }
    out.native_ = std::move(native);
    m.native_hits.fetch_add(1, std::memory_order_relaxed);
    m.native_tokens.fetch_add(out.tokens_, std::memory_order_relaxed);
    return out;
  }

  // Native [0, native_len) as stored, source [native_len, total) converted at its positions.
  const LinearAdapter& adapter = *best->adapter;
  const int64_t total = best_match.tokens();
  const int64_t missing = total - native_len;
  std::shared_ptr<void> buffer = allocate_kv(spec, total);
  const KVView full = dense_view(buffer.get(), spec, total);
  std::shared_ptr<void> source_kv = allocate_kv(adapter.source(), missing);
  const KVView source_view = dense_view(source_kv.get(), adapter.source(), missing);
  start = Clock::now();
  if (native_len > 0) native.copy_range_to(0, full.slice_tokens(0, native_len));
  best_match.copy_range_to(native_len, source_view);
  m.lookup_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  // Unpin before converting: the store may need the room for the write-back.
  native = Match();
  best_match = Match();

  start = Clock::now();
  adapter.convert(source_view, native_len, full.slice_tokens(native_len, missing));
  m.convert_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  source_kv.reset();
  m.conversions.fetch_add(1, std::memory_order_relaxed);
  m.converted_tokens.fetch_add(missing, std::memory_order_relaxed);

  const Provenance provenance{adapter.source().fingerprint(), adapter.fingerprint()};
  if (m.options.write_back) {
    const int64_t cached =
        m.store.put(spec, tokens.first(static_cast<size_t>(total)), full, ns, provenance);
    m.written_back_tokens.fetch_add(std::max<int64_t>(cached - native_len, 0),
                                    std::memory_order_relaxed);
  }

  out.tokens_ = std::min(total, limit);
  out.native_tokens_ = native_len;
  out.converted_ = true;
  out.source_ = adapter.source().name;
  out.quality_ = best->quality;
  out.converted_from_ = provenance.source_fingerprint;
  out.adapter_ = provenance.adapter_fingerprint;
  out.buffer_view_ = full.slice_tokens(0, out.tokens_);
  out.buffer_ = std::move(buffer);
  m.converted_hits.fetch_add(1, std::memory_order_relaxed);
  m.native_tokens.fetch_add(native_len, std::memory_order_relaxed);
  return out;
}

BridgeStats Bridge::stats() const {
  const Impl& m = *impl_;
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  BridgeStats s;
  s.saves = get(m.saves);
  s.loads = get(m.loads);
  s.native_hits = get(m.native_hits);
  s.converted_hits = get(m.converted_hits);
  s.misses = get(m.misses);
  s.conversions = get(m.conversions);
  s.native_tokens = get(m.native_tokens);
  s.converted_tokens = get(m.converted_tokens);
  s.written_back_tokens = get(m.written_back_tokens);
  s.adapters_skipped_quality = get(m.skipped_quality);
  s.adapters_skipped_stale = get(m.skipped_stale);
  s.lookup_seconds = static_cast<double>(get(m.lookup_ns)) * 1e-9;
  s.convert_seconds = static_cast<double>(get(m.convert_ns)) * 1e-9;
  std::lock_guard<std::mutex> lock(m.mu);
  s.adapters = static_cast<int64_t>(m.registry.size());
  s.adapters_below_quality = static_cast<int64_t>(
      std::count_if(m.registry.begin(), m.registry.end(),
                    [&](const Registered& r) { return !m.usable(r); }));
  return s;
}

std::string Bridge::prometheus_text() const {
  const BridgeStats from = stats();
  detail::PrometheusText out("kvbridge_bridge_");
#define KVBRIDGE_ROW_(type, member, metric, kind, help) \
  detail::emit_row(out, metric, #kind, help, static_cast<double>(from.member));
  KVBRIDGE_BRIDGE_STATS(KVBRIDGE_ROW_)
#undef KVBRIDGE_ROW_
  return out.text();
}

}  // namespace kvbridge
