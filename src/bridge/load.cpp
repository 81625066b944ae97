// Bridge::load, step by step (see the load policy in include/kvbridge/bridge.h): check the
// request, find the target's own prefix, gather and choose a candidate adapter, convert, write
// back, serve. Bridge::probe stops after the choice.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/align.h"
#include "kvbridge/error.h"
#include "src/bridge/bridge_impl.h"
#include "src/core/dtype_convert.h"

namespace kvbridge {

using detail::Candidate;
using detail::Converted;
using detail::LoadRequest;
using detail::NativePrefix;
using detail::Registered;

namespace {

using Clock = std::chrono::steady_clock;

int64_t elapsed_ns(Clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count();
}

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

// Checks a tokenization's shape (ids in range, one span per id, roles empty or one per id).
void check_tokenization(const Tokenization& t, const char* what) {
  KVB_CHECK(t.spans.size() == t.ids.size(),
            what << ": " << t.ids.size() << " ids but " << t.spans.size() << " spans");
  KVB_CHECK(t.roles.empty() || t.roles.size() == t.ids.size(),
            what << ": " << t.ids.size() << " ids but " << t.roles.size() << " roles");
  if (!t.ids.empty()) check_tokens(TokenSpan(t.ids.data(), t.ids.size()));
}

// Converted tokens end here at most: with a tail r > 0 the target computes the prompt's last
// r + 1 tokens itself; with 0 a source prefix covering the whole prompt is converted whole (and
// written back) and the returned load trimmed by one.
int64_t converted_end(int64_t source_len, int64_t limit, int64_t tail) {
  return tail == 0 ? source_len : std::min(source_len, limit - tail);
}

// The most target tokens an aligned candidate (across tokenizers) serves: all the load may hold
// less the tail, or all with a tail of 0.
int64_t most_aligned(int64_t limit, int64_t tail) { return tail == 0 ? limit : limit - tail; }

// The tokens a conversion through `best` computes: [0, total), the native prefix included.
int64_t converted_total(const LoadRequest& req, const Candidate& best) {
  return best.alignment.empty() ? converted_end(best.cached, req.limit, best.tail) : best.length;
}

// The longest target prefix an aligned source prefix serves: every token has its aligned
// source token among the `cached` ones and ends within the text those cover. Cuts `alignment`
// to it and returns its length (at most `most`).
int64_t aligned_length(const Tokenization& source, const Tokenization& target, int64_t cached,
                       int64_t most, std::vector<int64_t>& alignment) {
  // The cached source tokens have seen the text up to `seen`.
  int64_t seen = 0;
  for (int64_t i = 0; i < cached; ++i)
    seen = std::max(seen, source.spans[static_cast<size_t>(i)].end);
  int64_t length = 0;
  while (length < most) {
    const int64_t a = alignment[static_cast<size_t>(length)];
    if (a == kNoSource || a >= cached || target.spans[static_cast<size_t>(length)].end > seen)
      break;
    ++length;
  }
  alignment.resize(static_cast<size_t>(length));
  return length;
}

}  // namespace

LoadRequest Bridge::Impl::request(const ModelSpec& spec, TokenSpan tokens,
                                  const Tokenization* target,
                                  const SourceTokenizations* sources, std::string_view ns) {
  spec.validate();
  if (tokens.size > 0) check_tokens(tokens);
  LoadRequest req{spec, tokens, target, sources, ns};
  if (target) {
    check_tokenization(*target, "target tokenization");
    req.verified = static_cast<int64_t>(target->ids.size());
    bool prefix = req.verified <= static_cast<int64_t>(tokens.size);
    for (int64_t i = 0; prefix && i < req.verified; ++i)
      prefix = target->ids[static_cast<size_t>(i)] ==
               (tokens.data ? tokens.data[i] : static_cast<int64_t>(tokens.data32[i]));
    KVB_CHECK(prefix, "load: the target tokenization's " << req.verified
                                                         << " ids must be a prefix of tokens");
    for (const auto& [id, source] : *sources)
      check_tokenization(source, ("source tokenization '" + id + "'").c_str());
  }
  req.limit = static_cast<int64_t>(tokens.size) - 1;  // the target computes the last token
  return req;
}

void Bridge::Impl::count_call(const LoadRequest& req, bool probe) {
  if (probe) {
    probes.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  loads.fetch_add(1, std::memory_order_relaxed);
  if (req.target) {
    cross_tokenizer_loads.fetch_add(1, std::memory_order_relaxed);
    unverified_tokens.fetch_add(static_cast<int64_t>(req.tokens.size) - req.verified,
                                std::memory_order_relaxed);
  }
}

NativePrefix Bridge::Impl::native_prefix(const LoadRequest& req, bool count) {
  NativePrefix native;
  const auto start = Clock::now();
  native.match = store.match(req.spec, req.tokens, req.ns);
  lookup_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  native.use = usable_prefix(native.match, count);
  // Entries a conversion wrote back keep their adapter's tail (the target's own part is not cut).
  native.tail = native.use.origin.converted()
                    ? tail_of(native.use.origin.adapter_fingerprint, req.limit + 1)
                    : 0;
  native.length = native.tail > 0 ? std::min(native.use.tokens,
                                             std::max(native.use.own, req.limit - native.tail))
                                  : native.use.tokens;
  return native;
}

Bridge::Impl::Unfit Bridge::Impl::unfit(const Registered& r, const ModelSpec& spec,
                                        const std::string& target_fp) const {
  if (r.target_fp != target_fp)
    return r.adapter->target().name == spec.name ? Unfit::kStale : Unfit::kOtherTarget;
  if (!usable(r)) return Unfit::kQuality;
  if (!r.monitor->enabled()) return Unfit::kDisabled;
  return Unfit::kServes;
}

std::vector<Registered> Bridge::Impl::candidates(const LoadRequest& req, bool wanted) {
  // Adapters to exactly this spec, copied out so the lock is not held while working.
  // Same-tokenizer adapters always; adapters across tokenizers only with a target tokenization.
  const std::string target_fp = req.spec.fingerprint();
  std::vector<Registered> out;
  int64_t skipped_quality = 0, skipped_stale = 0, skipped_disabled = 0;
  if (wanted) {
    std::lock_guard<std::mutex> lock(mu);
    for (const Registered& r : registry) {
      const Unfit why = unfit(r, req.spec, target_fp);
      if (why == Unfit::kStale) ++skipped_stale;
      if (why == Unfit::kOtherTarget || why == Unfit::kStale) continue;
      // Adapters across tokenizers only with a target tokenization (not counted as skipped).
      if (r.adapter->source().tokenizer != req.spec.tokenizer && !req.target) continue;
      if (why == Unfit::kQuality) ++skipped_quality;
      if (why == Unfit::kDisabled) ++skipped_disabled;
      if (why == Unfit::kServes) out.push_back(r);
    }
  }
  adapters_skipped_quality.fetch_add(skipped_quality, std::memory_order_relaxed);
  adapters_skipped_stale.fetch_add(skipped_stale, std::memory_order_relaxed);
  adapters_skipped_disabled.fetch_add(skipped_disabled, std::memory_order_relaxed);
  return out;
}

Candidate Bridge::Impl::choose(const LoadRequest& req, const NativePrefix& native,
                               const std::vector<Registered>& candidates) {
  const int64_t limit = req.limit;
  Candidate best;
  for (const Registered& r : candidates) {
    const ModelSpec& source = r.adapter->source();
    Candidate c;
    c.registered = &r;
    c.tail = tail_of(*r.adapter, limit + 1);
    if (source.tokenizer == req.spec.tokenizer) {
      const auto start = Clock::now();
      c.match = store.match(source, req.tokens, req.ns);
      lookup_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
      c.cached = usable_prefix(c.match).tokens;
      c.length = std::min(converted_end(c.cached, limit, c.tail), limit);
    } else {
      const auto it = req.sources->find(source.tokenizer);
      if (it == req.sources->end()) continue;  // a tokenizer the caller does not have
      const Tokenization& text = it->second;
      const auto start = Clock::now();
      c.match = store.match(source, TokenSpan(text.ids.data(), text.ids.size()), req.ns);
      lookup_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
      c.cached = usable_prefix(c.match).tokens;
      if (c.cached == 0) continue;
      c.alignment = align(text.spans, req.target->spans,
                          parse_align_policy(r.adapter->report().alignment_policy), text.roles,
                          req.target->roles);
      const int64_t most = std::min(req.verified, most_aligned(limit, c.tail));
      c.length = aligned_length(text, *req.target, c.cached, most, c.alignment);
    }
    if (c.length <= std::min(native.length, limit)) continue;
    if (best.registered && (c.length < best.length ||
                            (c.length == best.length && r.quality <= best.registered->quality)))
      continue;
    best = std::move(c);
  }
  return best;
}

Converted Bridge::Impl::convert(const LoadRequest& req, NativePrefix& native, Candidate& best) {
  // Native [0, native_len) as stored, [native_len, total) converted: from source tokens at the
  // same positions, or across tokenizers from the source tokens the alignment names (only the
  // source range [lo, hi) they span is copied out of the store).
  const LinearAdapter& adapter = *best.registered->adapter;
  const int64_t native_len = native.length;
  const bool aligned = !best.alignment.empty();
  Converted out;
  out.total = converted_total(req, best);
  const int64_t missing = out.total - native_len;
  int64_t lo = native_len, hi = out.total;
  std::vector<int64_t> rows;
  if (aligned) {
    rows.assign(best.alignment.begin() + native_len, best.alignment.end());
    lo = *std::min_element(rows.begin(), rows.end());
    hi = *std::max_element(rows.begin(), rows.end()) + 1;
    for (int64_t& r : rows) r -= lo;
  }
  out.buffer = allocate_kv(req.spec, out.total);
  out.view = dense_view(out.buffer.get(), req.spec, out.total);
  std::shared_ptr<void> source_kv = allocate_kv(adapter.source(), hi - lo);
  const KVView source_view = dense_view(source_kv.get(), adapter.source(), hi - lo);
  auto start = Clock::now();
  if (native_len > 0) native.match.copy_range_to(0, out.view.slice_tokens(0, native_len));
  best.match.copy_range_to(lo, source_view);
  lookup_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  // Unpin before converting: the store may need the room for the write-back.
  native.match = Match();
  best.match = Match();
  // Never convert from a NaN or an infinity (an entry put into the store directly).
  if (detail::find_nonfinite(source_view)) {
    nonfinite_refused.fetch_add(1, std::memory_order_relaxed);
    return out;
  }

  start = Clock::now();
  const KVView out_view = out.view.slice_tokens(native_len, missing);
  // The target's ids of the converted tokens and the few before them (adapters with token codes
  // take them; others ignore them).
  TargetTokens ids;
  const auto count = static_cast<size_t>(missing);
  ids.ids = req.tokens.data ? TokenSpan(req.tokens.data + native_len, count)
                            : TokenSpan(req.tokens.data32 + native_len, count);
  for (int64_t t = std::max<int64_t>(0, native_len - adapter.token_context()); t < native_len; ++t)
    ids.previous.push_back(req.tokens.data ? req.tokens.data[t]
                                           : static_cast<int64_t>(req.tokens.data32[t]));
  if (aligned) {
    adapter.convert(source_view, lo, out_view, rows, native_len, ids);
  } else {
    adapter.convert(source_view, native_len, out_view, ids);
  }
  convert_seconds.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  source_kv.reset();
  conversions.fetch_add(1, std::memory_order_relaxed);
  converted_tokens.fetch_add(missing, std::memory_order_relaxed);
  if (aligned) aligned_hits.fetch_add(1, std::memory_order_relaxed);
  // Finite input overflowing the float32 arithmetic is the only way here (the casts saturate).
  if (detail::find_nonfinite(out_view)) {
    nonfinite_refused.fetch_add(1, std::memory_order_relaxed);
    return out;
  }
  out.finite = true;
  return out;
}

bool Bridge::Impl::write_back(const LoadRequest& req, const Converted& out, int64_t native_len,
                              const Provenance& provenance) {
  // Written back and served only while the adapter is not dropped; a drop waits for this write.
  Write write(*this, provenance.adapter_fingerprint);
  if (!write) {
    dropped_writes.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  at("writing");
  if (options.write_back) {
    const int64_t cached = store.put(req.spec, req.tokens.first(static_cast<size_t>(out.total)),
                                     out.view, req.ns, provenance);
    written_back_tokens.fetch_add(std::max<int64_t>(cached - native_len, 0),
                                  std::memory_order_relaxed);
  }
  return true;
}

Load Bridge::Impl::described_native(const LoadRequest& req, const NativePrefix& native) const {
  Load o;
  if (native.length == 0) return o;
  o.tokens_ = std::min(native.length, req.limit);
  o.native_tokens_ = o.tokens_;
  o.source_ = req.spec.name;
  o.quality_ = std::numeric_limits<double>::quiet_NaN();
  // Entries an earlier conversion wrote back are native hits now; say where they came from
  // (when the load holds any of them).
  if (o.tokens_ > native.use.own) {
    o.converted_from_ = native.use.origin.source_fingerprint;
    o.adapter_ = native.use.origin.adapter_fingerprint;
    o.recompute_tail_ = native.tail;
  }
  return o;
}

Load Bridge::Impl::described_converted(const LoadRequest& req, int64_t native_len,
                                       const Candidate& best) const {
  const LinearAdapter& adapter = *best.registered->adapter;
  Load o;
  o.tokens_ = std::min(converted_total(req, best), req.limit);
  o.native_tokens_ = native_len;
  o.converted_ = true;
  o.source_ = adapter.source().name;
  o.quality_ = best.registered->quality;
  o.converted_from_ = adapter.source().fingerprint();
  o.adapter_ = adapter.fingerprint();
  o.recompute_tail_ = best.tail;
  return o;
}

Load Bridge::Impl::serve_native(const LoadRequest& req, NativePrefix& native,
                                std::shared_ptr<void> buffer, const KVView& view) {
  Load o = described_native(req, native);
  if (o.tokens_ == 0) {
    misses.fetch_add(1, std::memory_order_relaxed);
    return o;
  }
  if (buffer) {
    o.buffer_view_ = view.slice_tokens(0, o.tokens_);
    o.buffer_ = std::move(buffer);
  } else {
    o.native_ = std::move(native.match);
  }
  native_hits.fetch_add(1, std::memory_order_relaxed);
  native_tokens.fetch_add(o.tokens_, std::memory_order_relaxed);
  return o;
}

Load Bridge::Impl::serve_converted(const LoadRequest& req, int64_t native_len,
                                   const Candidate& best, Converted out) {
  Load o = described_converted(req, native_len, best);
  o.buffer_view_ = out.view.slice_tokens(0, o.tokens_);
  o.buffer_ = std::move(out.buffer);
  converted_hits.fetch_add(1, std::memory_order_relaxed);
  native_tokens.fetch_add(native_len, std::memory_order_relaxed);
  return o;
}

void Bridge::Impl::with_own_start(const LoadRequest& req, Load& load) const {
  if (load.tokens_ == 0 || load.adapter_.empty()) return;
  const int64_t first = req.tokens.data ? req.tokens.data[0]
                                        : static_cast<int64_t>(req.tokens.data32[0]);
  std::shared_ptr<const detail::StartKV> start = starts.find(req.spec.fingerprint(), first);
  if (!start) return;
  load.start_view_ = start->view;
  load.start_ = std::move(start);
}

Load Bridge::Impl::load(const ModelSpec& spec, TokenSpan tokens, const Tokenization* target,
                        const SourceTokenizations* sources, std::string_view ns) {
  const LoadRequest req = request(spec, tokens, target, sources, ns);
  count_call(req, /*probe=*/false);
  if (req.limit <= 0) {
    misses.fetch_add(1, std::memory_order_relaxed);
    return Load();
  }
  NativePrefix native = native_prefix(req);
  const std::vector<Registered> adapters = candidates(req, native.length < req.limit);
  Candidate best = choose(req, native, adapters);
  Load served;
  if (!best.registered) {
    served = serve_native(req, native);
  } else {
    const int64_t native_len = native.length;
    Converted out = convert(req, native, best);
    const LinearAdapter& adapter = *best.registered->adapter;
    const Provenance provenance{adapter.source().fingerprint(), adapter.fingerprint()};
    if (out.finite) at("converted");
    if (out.finite && write_back(req, out, native_len, provenance)) {
      served = serve_converted(req, native_len, best, std::move(out));
    } else {
      served = serve_native(req, native, std::move(out.buffer), out.view);
    }
  }
  with_own_start(req, served);  // after the write-back, which keeps the conversion's
  return served;
}

Load Bridge::Impl::probe(const ModelSpec& spec, TokenSpan tokens, const Tokenization* target,
                         const SourceTokenizations* sources, std::string_view ns) {
  const LoadRequest req = request(spec, tokens, target, sources, ns);
  count_call(req, /*probe=*/true);
  if (req.limit <= 0) return Load();
  const NativePrefix native = native_prefix(req);
  const std::vector<Registered> adapters = candidates(req, native.length < req.limit);
  const Candidate best = choose(req, native, adapters);  // points into `adapters`
  return best.registered ? described_converted(req, native.length, best)
                         : described_native(req, native);
}  // the matches unpin here: the Load holds no KV

std::vector<std::string> Bridge::Impl::wanted_tokenizers(const ModelSpec& spec,
                                                         TokenSpan tokens, std::string_view ns) {
  const LoadRequest req = request(spec, tokens, nullptr, nullptr, ns);  // not counted
  std::vector<std::pair<std::string, int64_t>> across;  // (source tokenizer, most it serves)
  if (req.limit > 0) {
    const std::string target_fp = spec.fingerprint();
    std::lock_guard<std::mutex> lock(mu);
    for (const Registered& r : registry) {
      if (r.adapter->source().tokenizer == spec.tokenizer) continue;
      if (unfit(r, spec, target_fp) != Unfit::kServes) continue;
      across.emplace_back(r.adapter->source().tokenizer,
                          most_aligned(req.limit, tail_of(*r.adapter, req.limit + 1)));
    }
  }
  std::vector<std::string> out;
  if (across.empty()) return out;
  // As choose(): an aligned candidate must be longer than the own prefix.
  const int64_t own = std::min(native_prefix(req, /*count=*/false).length, req.limit);
  for (const auto& [tokenizer, most] : across)
    if (most > own && std::find(out.begin(), out.end(), tokenizer) == out.end())
      out.push_back(tokenizer);
  return out;
}

}  // namespace kvbridge
