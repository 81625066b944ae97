// Bridge::Impl: the state behind a Bridge (the adapter registry, the dropped adapters and the
// writes under way, the counters) and the steps of a load (src/bridge/load.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/bridge.h"
#include "src/bridge/adapter_monitor.h"
#include "src/bridge/start_tokens.h"

namespace kvbridge {

namespace detail {

// A registered adapter. Copies share its monitor.
struct Registered {
  std::shared_ptr<const LinearAdapter> adapter;
  std::string source_fp, target_fp;
  double quality = 0;
  std::shared_ptr<AdapterMonitor> monitor = std::make_shared<AdapterMonitor>();
};

// What a load was asked for, checked (Bridge::Impl::request).
struct LoadRequest {
  const ModelSpec& spec;
  TokenSpan tokens;
  const Tokenization* target;          // the target tokenization across tokenizers, else nullptr
  const SourceTokenizations* sources;  // with `target`: the source tokenizations
  std::string_view ns;
  int64_t verified = 0;  // target tokens whose text is verified (target->ids.size())
  int64_t limit = 0;     // the most tokens a load may hold: n - 1
};

// How much of a match may be served: the tokens before its first chunk whose provenance names
// a dropped adapter, and the provenance of the first converted chunk among them.
struct Usable {
  int64_t tokens = 0;
  int64_t own = 0;  // of `tokens`, those before the first converted chunk
  Provenance origin;
};

// The target's own cached prefix and how much of it a load may serve.
struct NativePrefix {
  Match match;
  Usable use;
  int64_t tail = 0;    // the tail its written-back entries keep (0: none)
  int64_t length = 0;  // tokens that may be served, before the limit
};

// One way to serve a load: a registered adapter and the source's cached prefix; with an
// alignment (across tokenizers) the target tokens [0, length) are computed from source tokens
// alignment[j] of that prefix.
struct Candidate {
  const Registered* registered = nullptr;
  Match match;
  int64_t cached = 0;  // of match's tokens, those that may be served (usable_prefix)
  int64_t length = 0;
  int64_t tail = 0;  // Bridge::recompute_tail of the adapter for this prompt
  std::vector<int64_t> alignment;  // empty: same tokenizer, token j from source token j
};

// A converted prefix: native [0, native_len) as stored, [native_len, total) converted, dense in
// the target's dtype.
struct Converted {
  std::shared_ptr<void> buffer;
  KVView view;  // all `total` tokens of `buffer`
  int64_t total = 0;
  // False when the source or the output held a NaN or an infinity: only the native prefix in
  // `buffer` may be served then.
  bool finite = false;
};

}  // namespace detail

struct Bridge::Impl {
  Impl(KVStore& s, const BridgeOptions& o) : store(s), options(o) {}
  KVStore& store;
  const BridgeOptions options;

  mutable std::mutex mu;                     // guards `registry`, `dropped` and `writing`
  std::vector<detail::Registered> registry;  // registration order
  // Fingerprints of the adapters dropped (disabled, removed, replaced) and not taken back.
  std::set<std::string> dropped;
  // Writes (write-backs, saves with a provenance) under way per adapter fingerprint, past the
  // check that it is not dropped; `written` is signalled as each ends.
  std::map<std::string, int64_t> writing;
  std::condition_variable written;
  std::function<void(std::string_view)> hook;  // set_test_hook
  detail::StartTokens starts;                  // the models' own start-token KV (add_start)

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

  bool usable(const detail::Registered& r) const { return r.quality >= options.min_quality; }

  // Why a registered adapter cannot serve a load of `spec` (whose fingerprint is target_fp):
  // kServes when it can. The one filter of candidates() and wanted_tokenizers().
  enum class Unfit { kServes, kOtherTarget, kStale, kQuality, kDisabled };
  Unfit unfit(const detail::Registered& r, const ModelSpec& spec,
              const std::string& target_fp) const;

  // Bridge::recompute_tail.
  int64_t tail_of(const LinearAdapter& adapter, int64_t prompt_tokens) const;
  // The tail, for a prompt of prompt_tokens, of entries whose provenance names this adapter
  // fingerprint: the option, or the registered adapter's own tail (0 for one not registered).
  int64_t tail_of(const std::string& adapter_fp, int64_t prompt_tokens);

  // The registered adapter with this fingerprint, or nullptr; call with `mu` held.
  detail::Registered* find(const std::string& adapter_fp);
  // Disables `r`; returns the adapter to purge (after drop()) outside the lock when it was
  // enabled, else nullptr. Call with `mu` held.
  std::shared_ptr<const LinearAdapter> disable(detail::Registered& r);
  // Re-enables `r` with an empty window and undoes its drop. Call with `mu` held.
  void enable(detail::Registered& r);
  // Marks the adapter dropped and waits until its writes under way have ended; `lock` holds
  // `mu` (released while waiting). The caller purges afterwards.
  void drop(std::unique_lock<std::mutex>& lock, const std::string& adapter_fp);

  // A write of KV converted by an adapter, or derived from such KV: starts only while the adapter
  // is not dropped, and a drop waits for it to end. An empty fingerprint always starts.
  class Write {
   public:
    Write(Impl& m, std::string adapter_fp);
    ~Write();
    Write(const Write&) = delete;
    Write& operator=(const Write&) = delete;
    explicit operator bool() const noexcept { return ok_; }

   private:
    Impl& m_;
    std::string fp_;
    bool ok_ = false, counted_ = false;
  };

  // How much of `match` may be served (counts the tokens cut for a dropped adapter when
  // `count`).
  detail::Usable usable_prefix(const Match& match, bool count = true);

  // ---- The steps of a load, in order (src/bridge/load.cpp) ----
  // Checks the arguments and fills `verified` and `limit`.
  detail::LoadRequest request(const ModelSpec& spec, TokenSpan tokens,
                              const Tokenization* target, const SourceTokenizations* sources,
                              std::string_view ns);
  // Counts the call: a load (across tokenizers, with its unverified tokens), or a probe.
  void count_call(const detail::LoadRequest& req, bool probe);
  // The target's own cached prefix (`count`: as usable_prefix).
  detail::NativePrefix native_prefix(const detail::LoadRequest& req, bool count = true);
  // The adapters that may serve the load (copied out of the registry); counts those skipped.
  std::vector<detail::Registered> candidates(const detail::LoadRequest& req, bool wanted);
  // The longest candidate (ties: higher quality, then earlier registered); none when no
  // candidate beats the native prefix.
  detail::Candidate choose(const detail::LoadRequest& req, const detail::NativePrefix& native,
                           const std::vector<detail::Registered>& candidates);
  // Copies the native prefix and the candidate's source KV out of the store (unpinning both)
  // and converts the rest (see Converted::finite).
  detail::Converted convert(const detail::LoadRequest& req, detail::NativePrefix& native,
                            detail::Candidate& best);
  // Writes the converted prefix back (when options.write_back) unless its adapter was dropped;
  // false when it was (nothing written).
  bool write_back(const detail::LoadRequest& req, const detail::Converted& out,
                  int64_t native_len, const Provenance& provenance);
  // What a load serving the native prefix, or `best`'s conversion after native_len own tokens,
  // reports (tokens, source, provenance, tail), without its KV: serve_native, serve_converted
  // and probe fill their Loads with these.
  Load described_native(const detail::LoadRequest& req, const detail::NativePrefix& native) const;
  Load described_converted(const detail::LoadRequest& req, int64_t native_len,
                           const detail::Candidate& best) const;
  // A load served from the target's own entries only: from the pinned match, or from `buffer`
  // (`view`), which holds at least the first min(native.length, limit) tokens.
  Load serve_native(const detail::LoadRequest& req, detail::NativePrefix& native,
                    std::shared_ptr<void> buffer = nullptr, const KVView& view = KVView());
  // A load holding converted tokens.
  Load serve_converted(const detail::LoadRequest& req, int64_t native_len,
                       const detail::Candidate& best, detail::Converted out);
  // Attaches the target's own start-token KV to a load holding KV that is not its own prefill.
  void with_own_start(const detail::LoadRequest& req, Load& load) const;
  // The whole load.
  Load load(const ModelSpec& spec, TokenSpan tokens, const Tokenization* target,
            const SourceTokenizations* sources, std::string_view ns);
  // A load's first steps, up to the choice (Bridge::probe).
  Load probe(const ModelSpec& spec, TokenSpan tokens, const Tokenization* target,
             const SourceTokenizations* sources, std::string_view ns);
  // Bridge::wanted_tokenizers.
  std::vector<std::string> wanted_tokenizers(const ModelSpec& spec, TokenSpan tokens,
                                             std::string_view ns);
};

}  // namespace kvbridge
