// Bridge: the façade over a KVStore and a registry of LinearAdapters. save() stores a model's
// prompt KV; load() returns the longest usable prefix for a target model, from its own cache or
// converted from another model's through a registered adapter.
//
// Load policy, for a target spec T and prompt tokens[0, n):
//  - Candidates: T's own cached prefix (length p_T), and for every registered adapter S -> T
//    (exact fingerprints, equal non-empty tokenizer ids, quality >= min_quality) S's cached
//    prefix (length p_S), all in the same namespace.
//  - The longest wins. A converted candidate must be strictly longer than the native one; ties
//    between adapters go to the higher quality, then to the earlier registered.
//  - When a converted candidate wins, the native prefix is kept as it is and only source tokens
//    [p_T, p_S) are converted (start_pos = p_T; the map is per token, so this equals converting
//    everything and keeping the tail). The assembled [0, p_S) KV is then written back as T's own
//    entry, so the next load of the same prompt is a native hit. The written-back chunks record
//    their provenance (S's fingerprint and the adapter's, KVStore::put), which later loads report
//    (Load::converted_from, Load::adapter) and which invalidate_adapter purges by: replacing or
//    removing an adapter purges what it wrote back, in every tier.
//  - The target always computes at least the last prompt token itself: a Load holds at most
//    n - 1 tokens (a chunk-aligned prefix covering the whole prompt is trimmed by one token).
//    Prompts of fewer than 2 tokens are misses.
//
// Quality of an adapter: the minimum held-out R² over every target layer's key and value maps in
// its FitReport (one badly mapped layer is enough to spoil attention, so the mean would hide it).
// Adapters under BridgeOptions::min_quality may be registered but are never used; each load that
// passes one over counts it in BridgeStats::adapters_skipped_quality.
//
// Thread safety: every method may be called concurrently. The adapter registry is guarded by a
// mutex held only to copy the candidate list; lookups, copies and conversions run outside it.
// Stats are atomics (a stats() snapshot is per counter, not a consistent cut).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/adapter.h"
#include "kvbridge/kv_store.h"
#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "kvbridge/prefix_hash.h"

namespace kvbridge {

struct BridgeOptions {
  /// Adapters whose quality (see above) is below this are never used. Any number but NaN;
  /// -infinity disables the gate. R² is a floor, not a promise: it does not predict downstream
  /// quality well, so set it from measured results for the model pair.
  double min_quality = 0.5;
  /// Write a converted prefix back into the store as the target's own entry.
  bool write_back = true;
};

/// Counters since construction. Times are wall-clock seconds summed over calls.
/// BridgeStats described once, as kv_store.h's tables: X(type, member, metric, kind, help),
/// metric names after the kvbridge_bridge_ prefix. adapters_skipped_quality counts, per load,
/// the adapters to the target under min_quality; adapters_skipped_stale, per load, the adapters
/// whose target has the load spec's name but another fingerprint (a stale adapter after a model
/// update: never used, since adapters match by exact fingerprint). converted_tokens includes any
/// trimmed last token.
#define KVBRIDGE_BRIDGE_STATS(X)                                                                  \
  X(int64_t, saves, "saves_total", counter, "Bridge save calls.")                                \
  X(int64_t, loads, "loads_total", counter, "Bridge load calls.")                                \
  X(int64_t, native_hits, "native_hits_total", counter,                                          \
    "Loads served from the target model's own cache only.")                                      \
  X(int64_t, converted_hits, "converted_hits_total", counter,                                    \
    "Loads that used a prefix converted from another model.")                                    \
  X(int64_t, misses, "misses_total", counter, "Loads that returned nothing.")                    \
  X(int64_t, conversions, "conversions_total", counter, "Adapter conversions run.")              \
  X(int64_t, native_tokens, "native_tokens_total", counter,                                      \
    "Tokens returned from the target model's own cache.")                                        \
  X(int64_t, converted_tokens, "converted_tokens_total", counter,                                \
    "Tokens converted through adapters.")                                                        \
  X(int64_t, written_back_tokens, "written_back_tokens_total", counter,                          \
    "Tokens past the native prefix cached by writing converted prefixes back.")                  \
  X(int64_t, adapters_skipped_quality, "adapters_skipped_quality_total", counter,                \
    "Adapters to a load's target passed over for quality under min_quality.")                    \
  X(int64_t, adapters_skipped_stale, "adapters_skipped_stale_total", counter,                    \
    "Adapters whose target has a load's model name but another fingerprint.")                    \
  X(double, lookup_seconds, "lookup_seconds_total", counter,                                     \
    "Seconds spent in store lookups and copies out of the store.")                               \
  X(double, convert_seconds, "convert_seconds_total", counter,                                   \
    "Seconds spent converting through adapters.")                                                \
  X(int64_t, adapters, "adapters", gauge, "Adapters registered.")                                \
  X(int64_t, adapters_below_quality, "adapters_below_quality", gauge,                            \
    "Registered adapters under min_quality (never used).")

struct BridgeStats {
  KVBRIDGE_BRIDGE_STATS(KVBRIDGE_STATS_MEMBER_)
};

/// The result of Bridge::load. Owns (or pins) its KV; movable, not copyable. Thread-compatible.
class Load {
 public:
  Load() = default;
  Load(Load&&) noexcept = default;
  Load& operator=(Load&&) noexcept = default;
  Load(const Load&) = delete;
  Load& operator=(const Load&) = delete;
  ~Load();

  /// Prompt tokens whose KV this holds: 0 on a miss, at most len(tokens) - 1.
  int64_t tokens() const noexcept { return tokens_; }
  /// Of those, how many came from the target's own cache (the rest were converted).
  int64_t native_tokens() const noexcept { return native_tokens_; }
  /// True when any token was converted through an adapter.
  bool converted() const noexcept { return converted_; }
  /// Name of the model whose cache served the load: the adapter's source model when converted,
  /// the target's own name for a native hit, empty on a miss.
  const std::string& source() const noexcept { return source_; }
  /// The adapter's quality when converted, else NaN.
  double quality() const noexcept { return quality_; }
  /// Provenance of the tokens that did not come from the target's own prefill: the source
  /// model's fingerprint and the adapter's (LinearAdapter::fingerprint()), for a conversion now
  /// and also for a native hit on entries an earlier conversion wrote back (then converted() is
  /// false; the first such chunk's provenance is reported). Both empty when every token is the
  /// target's own KV.
  const std::string& converted_from() const noexcept { return converted_from_; }
  const std::string& adapter() const noexcept { return adapter_; }
  explicit operator bool() const noexcept { return tokens_ > 0; }

  /// Copies the KV into `dst`: a CPU view with the target spec's layers, kv_heads, head_dim and
  /// dtype and exactly tokens() tokens (any strides). Throws InvalidArgument otherwise.
  void copy_to(const KVView& dst) const;

 private:
  friend class Bridge;
  Match native_;                      // set for a native hit (the store's entries, pinned)
  std::shared_ptr<void> buffer_;      // set when converted: dense canonical, target dtype
  KVView buffer_view_;                // view of buffer_ (tokens() tokens)
  int64_t tokens_ = 0;
  int64_t native_tokens_ = 0;
  bool converted_ = false;
  std::string source_;
  double quality_ = 0;
  std::string converted_from_, adapter_;
};

class Bridge {
 public:
  /// `store` is borrowed: it must outlive the Bridge. Throws InvalidArgument for a NaN
  /// min_quality.
  explicit Bridge(KVStore& store, const BridgeOptions& options = {});
  ~Bridge();
  Bridge(const Bridge&) = delete;
  Bridge& operator=(const Bridge&) = delete;

  const BridgeOptions& options() const noexcept;
  KVStore& store() const noexcept;

  /// Registers an adapter source() -> target() (shared: the caller may keep its reference).
  /// Throws InvalidArgument for a null adapter, source == target, an empty or differing
  /// tokenizer id, or a pair already registered unless `replace` (which then swaps it in).
  /// Adapters under min_quality are accepted but never used. Replacing an adapter by one with
  /// another fingerprint purges the replaced one's written-back entries (invalidate_adapter).
  void add_adapter(std::shared_ptr<const LinearAdapter> adapter, bool replace = false);
  /// Unregisters the adapter for (source, target) and purges its written-back entries; false if
  /// there was none.
  bool remove_adapter(const ModelSpec& source, const ModelSpec& target);
  /// Removes every entry `adapter` wrote back (KVStore::invalidate_adapter on its target and
  /// fingerprint), in every tier; the target's own entries stay. The adapter need not be
  /// registered.
  InvalidateResult invalidate_adapter(const LinearAdapter& adapter);
  /// Registered adapters, in registration order.
  std::vector<std::shared_ptr<const LinearAdapter>> adapters() const;
  /// min held-out R² over every target layer's K and V maps (-infinity for an empty report).
  static double quality(const LinearAdapter& adapter);

  /// Stores `kv` as `spec`'s cache of `tokens`: KVStore::put with the same contract (a CPU view
  /// matching spec, kv.tokens() == tokens.size). Returns the tokens now cached.
  int64_t save(const ModelSpec& spec, TokenSpan tokens, const KVView& kv,
               std::string_view ns = "default");

  /// The longest usable prefix of `tokens` for `spec` (see the policy above). A miss is an empty
  /// Load, also for empty or one-token prompts. Throws InvalidArgument for a bad spec or token ids
  /// outside [0, 2^32).
  Load load(const ModelSpec& spec, TokenSpan tokens, std::string_view ns = "default");

  BridgeStats stats() const;
  /// The stats in Prometheus text exposition format (version 0.0.4), one family per counter:
  /// kvbridge_bridge_{saves,loads,native_hits,converted_hits,misses,conversions}_total,
  /// kvbridge_bridge_{native,converted,written_back}_tokens_total,
  /// kvbridge_bridge_adapters_skipped_{quality,stale}_total,
  /// kvbridge_bridge_{lookup,convert}_seconds_total
  /// (counters) and kvbridge_bridge_adapters, kvbridge_bridge_adapters_below_quality (gauges).
  std::string prometheus_text() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
