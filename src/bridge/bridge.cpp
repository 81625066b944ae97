#include "kvbridge/bridge.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <set>

#include "kvbridge/align.h"
#include "kvbridge/error.h"
#include "src/core/dtype_convert.h"
#include "src/core/prometheus.h"

namespace kvbridge {

namespace {

using Clock = std::chrono::steady_clock;

int64_t elapsed_ns(Clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count();
}

// Monitoring state of one registered adapter; guarded by Bridge::Impl::mu.
struct Health {
  bool enabled = true;
  std::deque<QualityCheck> window;  // the last check_window checks
  int64_t checks = 0, disables = 0;
};

struct Registered {
  std::shared_ptr<const LinearAdapter> adapter;
  std::string source_fp, target_fp;
  double quality = 0;
  std::shared_ptr<Health> health = std::make_shared<Health>();
};

// Pooled figures of a check window.
struct Pooled {
  int64_t positions = 0, agreed = 0, loss_positions = 0;
  double kl_sum = 0, loss_gap_sum = 0;
  explicit Pooled(const std::deque<QualityCheck>& window) {
    for (const QualityCheck& c : window) {
      positions += c.positions;
      agreed += c.agreed;
      kl_sum += c.kl_sum;
      loss_positions += c.loss_positions;
      loss_gap_sum += c.loss_gap_sum;
    }
  }
  static double ratio(double num, int64_t den) {
    return den > 0 ? num / static_cast<double>(den) : std::numeric_limits<double>::quiet_NaN();
  }
  double agreement() const { return ratio(static_cast<double>(agreed), positions); }
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

  mutable std::mutex mu;            // guards `registry`, `dropped` and `writing`
  std::vector<Registered> registry;  // registration order
  // Fingerprints of the adapters dropped (disabled, removed, replaced) and not taken back.
  std::set<std::string> dropped;
  // Writes (write-backs, saves with a provenance) under way per adapter fingerprint, past the
  // check that it is not dropped; `written` is signalled as each ends.
  std::map<std::string, int64_t> writing;
  std::condition_variable written;
  std::function<void(std::string_view)> hook;  // set_test_hook

  void at(std::string_view point) const {
    if (hook) hook(point);
  }

  // One atomic per counter row of KVBRIDGE_BRIDGE_STATS, named as the BridgeStats member. The
  // double rows (seconds) count nanoseconds; stats() converts. Gauges are computed in stats().
#define KVBRIDGE_COUNTER_counter(type, member) std::atomic<int64_t> member{0};
#define KVBRIDGE_COUNTER_gauge(type, member)
#define KVBRIDGE_COUNTER_(type, member, metric, kind, help) KVBRIDGE_COUNTER_##kind(type, member)
  KVBRIDGE_BRIDGE_STATS(KVBRIDGE_COUNTER_)
#undef KVBRIDGE_COUNTER_
#undef KVBRIDGE_COUNTER_gauge
#undef KVBRIDGE_COUNTER_counter

  bool usable(const Registered& r) const { return r.quality >= options.min_quality; }

  // Bridge::recompute_tail.
  int64_t tail_of(const LinearAdapter& adapter) const {
    if (options.recompute_tail >= 0) return options.recompute_tail;
    const ServingDefaults serving = adapter.serving();
    return serving.recorded ? serving.recompute_tail : 0;
  }
  // The tail for entries whose provenance names this adapter fingerprint: the option, or the
  // registered adapter's own tail (0 for one not registered here).
  int64_t tail_of(const std::string& adapter_fp) {
    if (options.recompute_tail >= 0) return options.recompute_tail;
    std::shared_ptr<const LinearAdapter> adapter;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (Registered* r = find(adapter_fp)) adapter = r->adapter;
    }
    return adapter ? tail_of(*adapter) : 0;
  }

  // The registered adapter with this fingerprint, or nullptr; call with `mu` held.
  Registered* find(const std::string& adapter_fp) {
    for (Registered& r : registry)
      if (r.adapter->fingerprint() == adapter_fp) return &r;
    return nullptr;
  }
  // Sets `r`'s state; returns the adapter to purge (disabling, after drop()) outside the lock,
  // or nullptr.
  std::shared_ptr<const LinearAdapter> set_enabled(Registered& r, bool enabled) {
    Health& h = *r.health;
    const bool was = h.enabled;
    h.enabled = enabled;
    if (enabled) {
      h.window.clear();
      dropped.erase(r.adapter->fingerprint());
    }
    return was && !enabled ? r.adapter : nullptr;
  }
  // Marks the adapter dropped and waits until its writes under way have ended; `lock` holds
  // `mu` (released while waiting). The caller purges afterwards.
  void drop(std::unique_lock<std::mutex>& lock, const std::string& adapter_fp) {
    dropped.insert(adapter_fp);
    at("dropped");
    written.wait(lock, [&] { return writing.find(adapter_fp) == writing.end(); });
  }

  // A write of KV converted by an adapter, or derived from such KV: starts only while the adapter
  // is not dropped, and a drop waits for it to end. An empty fingerprint always starts.
  class Write {
   public:
    Write(Impl& m, std::string adapter_fp) : m_(m), fp_(std::move(adapter_fp)) {
      if (fp_.empty()) {
        ok_ = true;
        return;
      }
      std::lock_guard<std::mutex> lock(m_.mu);
      if (m_.dropped.count(fp_)) return;
      ++m_.writing[fp_];
      ok_ = counted_ = true;
    }
    ~Write() {
      if (!counted_) return;
      {
        std::lock_guard<std::mutex> lock(m_.mu);
        auto it = m_.writing.find(fp_);
        if (--it->second == 0) m_.writing.erase(it);
      }
      m_.written.notify_all();
    }
    Write(const Write&) = delete;
    Write& operator=(const Write&) = delete;
    explicit operator bool() const noexcept { return ok_; }

   private:
    Impl& m_;
    std::string fp_;
    bool ok_ = false, counted_ = false;
  };

  // How much of a match may be served: the tokens before its first chunk whose provenance names
  // a dropped adapter, and the provenance of the first converted chunk among them.
  struct Usable {
    int64_t tokens = 0;
    int64_t own = 0;  // of `tokens`, those before the first converted chunk
    Provenance origin;
  };
  Usable usable_prefix(const Match& match) {
    Usable out;
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
        dropped_tokens.fetch_add(match.tokens() - out.tokens, std::memory_order_relaxed);
        return out;
      }
      if (!out.origin.converted()) {
        out.origin = p;
        out.own = c * chunk_tokens;
      }
    }
    return out;
  }
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

int64_t Bridge::recompute_tail(const LinearAdapter& adapter) const {
  return impl_->tail_of(adapter);
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
  return m.store.put(spec, tokens, kv, ns, provenance);
}

bool Bridge::adapter_dropped(const std::string& adapter_fingerprint) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->dropped.count(adapter_fingerprint) > 0;
}

void Bridge::set_test_hook(std::function<void(std::string_view)> hook) {
  impl_->hook = std::move(hook);
}

Load Bridge::load(const ModelSpec& spec, TokenSpan tokens, std::string_view ns) {
  return load_impl(spec, tokens, nullptr, nullptr, ns);
}

Load Bridge::load(const ModelSpec& spec, TokenSpan tokens, const Tokenization& target,
                  const TokenizeText& tokenize, std::string_view ns) {
  KVB_CHECK(static_cast<bool>(tokenize), "load: tokenize must be callable");
  return load_impl(spec, tokens, &target, &tokenize, ns);
}

namespace {

// Checks a tokenization's shape (ids in range, one span per id, roles empty or one per id).
void check_tokenization(const Tokenization& t, const char* what) {
  KVB_CHECK(t.spans.size() == t.ids.size(),
            what << ": " << t.ids.size() << " ids but " << t.spans.size() << " spans");
  KVB_CHECK(t.roles.empty() || t.roles.size() == t.ids.size(),
            what << ": " << t.ids.size() << " ids but " << t.roles.size() << " roles");
  if (!t.ids.empty()) check_tokens(TokenSpan(t.ids.data(), t.ids.size()));
}

// One way to serve a load: a registered adapter and the source's cached prefix; with an
// alignment (across tokenizers) the target tokens [0, length) are computed from source tokens
// alignment[j] of that prefix.
struct Candidate {
  const Registered* registered = nullptr;
  Match match;
  int64_t cached = 0;  // of match's tokens, those that may be served (Impl::usable_prefix)
  int64_t length = 0;
  int64_t tail = 0;  // Bridge::recompute_tail of the adapter
  std::vector<int64_t> alignment;  // empty: same tokenizer, token j from source token j
};

// Converted tokens end here at most: with a tail r > 0 the target computes the prompt's last
// r + 1 tokens itself; with 0 a source prefix covering the whole prompt is converted whole (and
// written back) and the returned load trimmed by one.
int64_t converted_end(int64_t source_len, int64_t limit, int64_t tail) {
  return tail == 0 ? source_len : std::min(source_len, limit - tail);
}

}  // namespace

Load Bridge::load_impl(const ModelSpec& spec, TokenSpan tokens, const Tokenization* target,
                       const TokenizeText* tokenize, std::string_view ns) {
  Impl& m = *impl_;
  spec.validate();
  if (tokens.size > 0) check_tokens(tokens);
  int64_t verified = 0;
  if (target) {
    check_tokenization(*target, "target tokenization");
    verified = static_cast<int64_t>(target->ids.size());
    bool prefix = verified <= static_cast<int64_t>(tokens.size);
    for (int64_t i = 0; prefix && i < verified; ++i)
      prefix = target->ids[static_cast<size_t>(i)] ==
               (tokens.data ? tokens.data[i] : static_cast<int64_t>(tokens.data32[i]));
    KVB_CHECK(prefix, "load: the target tokenization's " << verified
                                                         << " ids must be a prefix of tokens");
  }
  m.loads.fetch_add(1, std::memory_order_relaxed);
  if (target) {
    m.cross_tokenizer_loads.fetch_add(1, std::memory_order_relaxed);
    m.unverified_tokens.fetch_add(static_cast<int64_t>(tokens.size) - verified,
                                  std::memory_order_relaxed);
  }
  const int64_t n = static_cast<int64_t>(tokens.size);
  const int64_t limit = n - 1;  // the target computes at least the last token itself
  if (limit <= 0) {
    m.misses.fetch_add(1, std::memory_order_relaxed);
    return Load();
  }

  auto start = Clock::now();
  Match native = m.store.match(spec, tokens, ns);
  m.lookup_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  const Impl::Usable native_use = m.usable_prefix(native);
  // Entries a conversion wrote back keep their adapter's tail (the target's own part is not cut).
  const int64_t native_tail =
      native_use.origin.converted() ? m.tail_of(native_use.origin.adapter_fingerprint) : 0;
  const int64_t native_len =
      native_tail > 0
          ? std::min(native_use.tokens, std::max(native_use.own, limit - native_tail))
          : native_use.tokens;

  // Candidates: adapters to exactly this spec, copied out so the lock is not held while working.
  // Same-tokenizer adapters always; adapters across tokenizers only with a target tokenization.
  const std::string target_fp = spec.fingerprint();
  std::vector<Registered> candidates;
  int64_t skipped_quality = 0, skipped_stale = 0, skipped_disabled = 0;
  if (native_len < limit) {
    std::lock_guard<std::mutex> lock(m.mu);
    for (const Registered& r : m.registry) {
      if (r.target_fp != target_fp) {
        if (r.adapter->target().name == spec.name) ++skipped_stale;
        continue;
      }
      if (r.adapter->source().tokenizer != spec.tokenizer && !target) continue;
      if (!m.usable(r)) {
        ++skipped_quality;
        continue;
      }
      if (!r.health->enabled) {
        ++skipped_disabled;
        continue;
      }
      candidates.push_back(r);
    }
  }
  m.adapters_skipped_quality.fetch_add(skipped_quality, std::memory_order_relaxed);
  m.adapters_skipped_stale.fetch_add(skipped_stale, std::memory_order_relaxed);
  m.adapters_skipped_disabled.fetch_add(skipped_disabled, std::memory_order_relaxed);

  // The longest prefix; ties go to the higher quality, then the earlier registered.
  Candidate best;
  std::map<std::string, std::optional<Tokenization>> texts;  // per source tokenizer id
  for (const Registered& r : candidates) {
    const ModelSpec& source = r.adapter->source();
    Candidate c;
    c.registered = &r;
    c.tail = m.tail_of(*r.adapter);
    const int64_t tail = c.tail;
    if (source.tokenizer == spec.tokenizer) {
      start = Clock::now();
      c.match = m.store.match(source, tokens, ns);
      m.lookup_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
      c.cached = m.usable_prefix(c.match).tokens;
      c.length = std::min(converted_end(c.cached, limit, tail), limit);
    } else {
      auto it = texts.find(source.tokenizer);
      if (it == texts.end()) {  // the caller tokenizes the text once per source tokenizer
        std::optional<Tokenization> got;
        Tokenization t;
        if ((*tokenize)(source.tokenizer, t)) {
          check_tokenization(t, "source tokenization");
          got = std::move(t);
        }
        it = texts.emplace(source.tokenizer, std::move(got)).first;
      }
      if (!it->second) continue;  // a tokenizer the caller does not know
      const Tokenization* text = &*it->second;
      start = Clock::now();
      c.match = m.store.match(source, TokenSpan(text->ids.data(), text->ids.size()), ns);
      m.lookup_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
      const int64_t cached = c.cached = m.usable_prefix(c.match).tokens;
      if (cached == 0) continue;
      c.alignment = align(text->spans, target->spans,
                          parse_align_policy(r.adapter->report().alignment_policy), text->roles,
                          target->roles);
      // The cached source tokens have seen the text up to `seen`; target token j is served when
      // its source token is cached and its own text lies inside that.
      int64_t seen = 0;
      for (int64_t i = 0; i < cached; ++i)
        seen = std::max(seen, text->spans[static_cast<size_t>(i)].end);
      const int64_t most = std::min(verified, tail == 0 ? limit : limit - tail);
      while (c.length < most) {
        const int64_t a = c.alignment[static_cast<size_t>(c.length)];
        if (a == kNoSource || a >= cached ||
            target->spans[static_cast<size_t>(c.length)].end > seen)
          break;
        ++c.length;
      }
      c.alignment.resize(static_cast<size_t>(c.length));
    }
    if (c.length <= std::min(native_len, limit)) continue;
    if (best.registered && (c.length < best.length ||
                            (c.length == best.length && r.quality <= best.registered->quality)))
      continue;
    best = std::move(c);
  }

  // A load served from the target's own entries only: `kv` holds at least their first
  // min(native_len, limit) tokens (the pinned match, or a buffer they were copied into).
  auto serve_native = [&](Match kv_match, std::shared_ptr<void> kv_buffer, const KVView& kv_view) {
    Load o;
    if (native_len == 0) {
      m.misses.fetch_add(1, std::memory_order_relaxed);
      return o;
    }
    o.tokens_ = std::min(native_len, limit);
    o.native_tokens_ = o.tokens_;
    o.source_ = spec.name;
    o.quality_ = std::numeric_limits<double>::quiet_NaN();
    // Entries an earlier conversion wrote back are native hits now; say where they came from
    // (when the load holds any of them).
    if (o.tokens_ > native_use.own) {
      o.converted_from_ = native_use.origin.source_fingerprint;
      o.adapter_ = native_use.origin.adapter_fingerprint;
      o.recompute_tail_ = native_tail;
    }
    if (kv_buffer) {
      o.buffer_view_ = kv_view.slice_tokens(0, o.tokens_);
      o.buffer_ = std::move(kv_buffer);
    } else {
      o.native_ = std::move(kv_match);
    }
    m.native_hits.fetch_add(1, std::memory_order_relaxed);
    m.native_tokens.fetch_add(o.tokens_, std::memory_order_relaxed);
    return o;
  };
  if (!best.registered) return serve_native(std::move(native), nullptr, KVView());

  // Native [0, native_len) as stored, [native_len, total) converted: from source tokens at the
  // same positions, or across tokenizers from the source tokens the alignment names (only the
  // source range [lo, hi) they span is copied out of the store).
  const LinearAdapter& adapter = *best.registered->adapter;
  const bool aligned = !best.alignment.empty();
  const int64_t total = aligned ? best.length : converted_end(best.cached, limit, best.tail);
  const int64_t missing = total - native_len;
  int64_t lo = native_len, hi = total;
  std::vector<int64_t> rows;
  if (aligned) {
    rows.assign(best.alignment.begin() + native_len, best.alignment.end());
    lo = *std::min_element(rows.begin(), rows.end());
    hi = *std::max_element(rows.begin(), rows.end()) + 1;
    for (int64_t& r : rows) r -= lo;
  }
  std::shared_ptr<void> buffer = allocate_kv(spec, total);
  const KVView full = dense_view(buffer.get(), spec, total);
  std::shared_ptr<void> source_kv = allocate_kv(adapter.source(), hi - lo);
  const KVView source_view = dense_view(source_kv.get(), adapter.source(), hi - lo);
  start = Clock::now();
  if (native_len > 0) native.copy_range_to(0, full.slice_tokens(0, native_len));
  best.match.copy_range_to(lo, source_view);
  m.lookup_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  // Unpin before converting: the store may need the room for the write-back.
  native = Match();
  best.match = Match();
  // Never convert from a NaN or an infinity (an entry put into the store directly).
  if (detail::find_nonfinite(source_view)) {
    m.nonfinite_refused.fetch_add(1, std::memory_order_relaxed);
    return serve_native(Match(), std::move(buffer), full);
  }

  start = Clock::now();
  const KVView out_view = full.slice_tokens(native_len, missing);
  if (aligned) {
    adapter.convert(source_view, lo, out_view, rows, native_len);
  } else {
    adapter.convert(source_view, native_len, out_view);
  }
  m.convert_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  source_kv.reset();
  m.conversions.fetch_add(1, std::memory_order_relaxed);
  m.converted_tokens.fetch_add(missing, std::memory_order_relaxed);
  if (aligned) m.aligned_hits.fetch_add(1, std::memory_order_relaxed);
  // Finite input overflowing the float32 arithmetic is the only way here (the casts saturate).
  if (detail::find_nonfinite(out_view)) {
    m.nonfinite_refused.fetch_add(1, std::memory_order_relaxed);
    return serve_native(Match(), std::move(buffer), full);
  }
  m.at("converted");

  // Written back and served only while the adapter is not dropped; a drop waits for this write.
  const Provenance provenance{adapter.source().fingerprint(), adapter.fingerprint()};
  {
    Impl::Write write(m, provenance.adapter_fingerprint);
    if (!write) {
      m.dropped_writes.fetch_add(1, std::memory_order_relaxed);
      return serve_native(Match(), std::move(buffer), full);
    }
    m.at("writing");
    if (m.options.write_back) {
      const int64_t cached =
          m.store.put(spec, tokens.first(static_cast<size_t>(total)), full, ns, provenance);
      m.written_back_tokens.fetch_add(std::max<int64_t>(cached - native_len, 0),
                                      std::memory_order_relaxed);
    }
  }

  Load out;
  out.tokens_ = std::min(total, limit);
  out.native_tokens_ = native_len;
  out.converted_ = true;
  out.source_ = adapter.source().name;
  out.quality_ = best.registered->quality;
  out.converted_from_ = provenance.source_fingerprint;
  out.adapter_ = provenance.adapter_fingerprint;
  out.recompute_tail_ = best.tail;
  out.buffer_view_ = full.slice_tokens(0, out.tokens_);
  out.buffer_ = std::move(buffer);
  m.converted_hits.fetch_add(1, std::memory_order_relaxed);
  m.native_tokens.fetch_add(native_len, std::memory_order_relaxed);
  return out;
}

bool Bridge::record_check(const std::string& adapter_fingerprint, const QualityCheck& check) {
  KVB_CHECK(check.positions > 0, "record_check: positions must be > 0, got " << check.positions);
  KVB_CHECK(check.agreed >= 0 && check.agreed <= check.positions,
            "record_check: agreed must lie in [0, positions = " << check.positions << "], got "
                                                                << check.agreed);
  KVB_CHECK(check.loss_positions >= 0 && check.loss_positions <= check.positions,
            "record_check: loss_positions must lie in [0, positions = "
                << check.positions << "], got " << check.loss_positions);
  KVB_CHECK(std::isfinite(check.kl_sum) && check.kl_sum >= 0,
            "record_check: kl_sum must be finite and >= 0, got " << check.kl_sum);
  KVB_CHECK(std::isfinite(check.loss_gap_sum),
            "record_check: loss_gap_sum must be finite, got " << check.loss_gap_sum);
  Impl& m = *impl_;
  std::shared_ptr<const LinearAdapter> purge;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    Registered* r = m.find(adapter_fingerprint);
    KVB_CHECK_AS(NotFound, r != nullptr,
                 "record_check: no registered adapter has fingerprint " << adapter_fingerprint);
    m.quality_checks.fetch_add(1, std::memory_order_relaxed);
    Health& h = *r->health;
    ++h.checks;
    if (!h.enabled) return false;
    h.window.push_back(check);
    while (static_cast<int64_t>(h.window.size()) > m.options.check_window) h.window.pop_front();
    if (static_cast<int64_t>(h.window.size()) < m.options.min_checks ||
        !(Pooled(h.window).agreement() < m.options.min_agreement))
      return false;
    purge = m.set_enabled(*r, false);
    ++h.disables;
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
    purge = impl_->set_enabled(*r, false);
    if (purge) impl_->drop(lock, adapter_fingerprint);
  }
  if (purge) invalidate_adapter(*purge);
  return true;
}

bool Bridge::enable_adapter(const std::string& adapter_fingerprint) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Registered* r = impl_->find(adapter_fingerprint);
  if (r == nullptr) return false;
  impl_->set_enabled(*r, true);
  return true;
}

std::vector<AdapterHealth> Bridge::adapter_health() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<AdapterHealth> out;
  out.reserve(impl_->registry.size());
  for (const Registered& r : impl_->registry) {
    const Health& h = *r.health;
    const Pooled pooled(h.window);
    AdapterHealth a;
    a.adapter = r.adapter->fingerprint();
    a.source = r.adapter->source().name;
    a.target = r.adapter->target().name;
    a.enabled = h.enabled;
    a.checks = h.checks;
    a.window_checks = static_cast<int64_t>(h.window.size());
    a.window_positions = pooled.positions;
    a.agreement = pooled.agreement();
    a.kl = Pooled::ratio(pooled.kl_sum, pooled.positions);
    a.loss_gap = Pooled::ratio(pooled.loss_gap_sum, pooled.loss_positions);
    a.disables = h.disables;
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
                    [](const Registered& r) { return !r.health->enabled; }));
  return s;
}

namespace {

}  // namespace

std::string Bridge::prometheus_text() const {
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
