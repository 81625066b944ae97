// Bridge: the façade over a KVStore and a registry of LinearAdapters. save() stores a model's
// prompt KV; load() returns the longest usable prefix for a target model, from its own cache or
// converted from another model's through a registered adapter.
//
// Load policy, for a target spec T and prompt tokens[0, n):
//  - Candidates: T's own cached prefix (length p_T), and for every registered adapter S -> T
//    (exact fingerprints, equal non-empty tokenizer ids, quality >= min_quality) S's cached
//    prefix (length p_S), all in the same namespace. With the prompt's text tokenization (the
//    second load overload) also adapters between different tokenizers: see there.
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
//  - Tail recompute: a tail r > 0 leaves r more prompt tokens to the target: a converted
//    candidate holds at most n - 1 - r tokens (only tokens [p_T, min(p_S, n - 1 - r)) are
//    converted and written back), so the target's own forward covers the prompt's last r + 1
//    tokens over the converted prefix. A converted candidate must still be strictly longer than
//    the native one after that cut. r is per adapter and prompt length (recompute_tail(adapter,
//    n)): the adapter's recorded serving defaults (LinearAdapter::serving().tail_for(n),
//    measured by its evaluation: a fixed tail, tails by prompt length, or a share) unless
//    BridgeOptions::recompute_tail >= 0 fixes it for every adapter and length. The target's own
//    entries are never cut; a native prefix holding entries a conversion wrote back (their
//    provenance names an adapter) is cut to max(its own-KV part, n - 1 - r), r the tail for n of
//    the adapter the first such entry names (0 when that adapter is not registered here and no
//    option fixes r), so a shorter prompt over a written-back prefix keeps the same promise.
//    Load::recompute_tail() says which r a load applied.
//
//  - The start token: at position 0 a causal model's KV depends on that token alone, and it is
//    the one every later token attends to most (the attention sink), where a conversion's error
//    costs the most. A load holding KV that is not the target's own prefill (Load::adapter()
//    set: converted now, or a native hit on entries a conversion wrote back) takes position 0
//    from the target's own KV of tokens[0] where one is registered: add_start(), and save() of
//    the target's own KV (no provenance) registers its first token when that token has none yet.
//    Load::copy_to() writes it; the written-back entries keep the conversion's. Without one
//    position 0 is the converted (or written-back) KV.
//
// Quality of an adapter: the minimum held-out R² over every target layer's key and value maps in
// its FitReport (one badly mapped layer is enough to spoil attention, so the mean would hide it).
// Adapters under BridgeOptions::min_quality may be registered but are never used; each load that
// passes one over counts it in BridgeStats::adapters_skipped_quality.
//
// Quality checks and fallback: see bridge_health.h (record_check, the agreement floor).
//
// Dropped adapters: disable_adapter, remove_adapter, a replacing add_adapter (another
// fingerprint) and a disabling record_check drop an adapter. Once such a call returns, nothing
// the adapter converted is stored or served by this Bridge, in any tier:
//  - a load that converted with it before the drop does not write back and returns only its
//    native prefix (counted in dropped_writes): the write-back and the check that the adapter is
//    still in use are one step, and the drop waits for write-backs already past that check, then
//    purges (invalidate_adapter);
//  - save() with a provenance naming it stores nothing (returns 0, counted in dropped_writes);
//  - cached entries whose provenance names it are never served (native or as a conversion's
//    source): a prefix ends before the first such chunk (the cut tokens count in dropped_tokens).
//    This covers entries another process writes back later, or that a failed Redis purge left.
// enable_adapter and registering the fingerprint again (add_adapter) undo the drop.
// Other processes sharing the disk directory or Redis: the purge deletes the adapter's entries
// from both before the dropping call returns, so their lookups that reach those tiers miss
// them at once; entries already in their memory tiers, and write-backs by a process that still
// uses the adapter, stay until the adapter is dropped in that process too (call the same
// method in every process, e.g. through the vLLM shadow worker extension's disable_adapter).
//
// Non-finite numbers: save() refuses KV holding a NaN or an infinity (InvalidArgument, nothing
// stored, counted in nonfinite_refused). A conversion whose source KV (an entry put directly
// into the KVStore) or output holds one is dropped: nothing is written back and the load returns
// its native prefix (counted in nonfinite_refused). LinearAdapter::convert casts with saturation
// (finite float32 results beyond float16 / bfloat16 range become the largest finite value), so
// finite input converts to finite output unless the float32 arithmetic itself overflows.
//
// Thread safety: every method may be called concurrently. The adapter registry is guarded by a
// mutex held only to copy the candidate list; lookups, copies and conversions run outside it.
// Stats are atomics (a stats() snapshot is per counter, not a consistent cut).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/adapter.h"
#include "kvbridge/align.h"
#include "kvbridge/bridge_health.h"
#include "kvbridge/bridge_options.h"
#include "kvbridge/bridge_stats.h"
#include "kvbridge/kv_store.h"
#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "kvbridge/prefix_hash.h"

namespace kvbridge {

/// The result of Bridge::load. Owns (or pins) its KV; movable, not copyable. Thread-compatible.
/// Bridge::probe returns one without KV.
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
  /// The tail recompute this load applied (Bridge::recompute_tail of the adapter that converted,
  /// or that written-back entries name, for this prompt's length): the target computes the
  /// prompt's last r + 1 tokens itself. 0 when every token is the target's own KV, and on a miss.
  int64_t recompute_tail() const noexcept { return recompute_tail_; }
  explicit operator bool() const noexcept { return tokens_ > 0; }

  /// Copies the KV into `dst`: a CPU view with the target spec's layers, kv_heads, head_dim and
  /// dtype and exactly tokens() tokens (any strides). Throws InvalidArgument otherwise.
  /// Position 0 is the target's own start-token KV where the load policy says so.
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
  int64_t recompute_tail_ = 0;
  std::shared_ptr<const void> start_;  // set: the target's own KV for position 0 (start_view_)
  KVView start_view_;
};

/// One text's tokenization by one tokenizer: token ids with their UTF-8 byte spans in the text
/// and roles ("" ordinary; see align.h).
struct Tokenization {
  std::vector<int64_t> ids;
  std::vector<TextSpan> spans;     ///< one per id
  std::vector<std::string> roles;  ///< empty (all ordinary) or one per id
};

/// The load's text under source tokenizers, by tokenizer id (a source model's ModelSpec
/// tokenizer id). A tokenizer id missing from it is one the caller does not have.
using SourceTokenizations = std::map<std::string, Tokenization>;

class Bridge {
 public:
  /// `store` is borrowed: it must outlive the Bridge. Throws InvalidArgument for an option out
  /// of range (a NaN min_quality, a recompute_tail < -1, ...).
  explicit Bridge(KVStore& store, const BridgeOptions& options = {});
  ~Bridge();
  Bridge(const Bridge&) = delete;
  Bridge& operator=(const Bridge&) = delete;

  const BridgeOptions& options() const noexcept;
  KVStore& store() const noexcept;

  /// Registers an adapter source() -> target() (shared: the caller may keep its reference).
  /// Throws InvalidArgument for a null adapter, source == target, an empty tokenizer id,
  /// differing tokenizer ids without an alignment policy (report().alignment_policy: only an
  /// adapter fitted on aligned samples can serve another tokenizer, and only through the load
  /// overload that takes the text's tokenizations), or a pair already registered unless
  /// `replace` (which then swaps it in).
  /// Adapters under min_quality are accepted but never used. Replacing an adapter by one with
  /// another fingerprint purges the replaced one's written-back entries (invalidate_adapter).
  void add_adapter(std::shared_ptr<const LinearAdapter> adapter, bool replace = false);
  /// Unregisters the adapter for (source, target), drops it (see "Dropped adapters" above) and
  /// purges its written-back entries; false if there was none.
  bool remove_adapter(const ModelSpec& source, const ModelSpec& target);
  /// Removes every entry `adapter` wrote back (KVStore::invalidate_adapter on its target and
  /// fingerprint), in every tier; the target's own entries stay. The adapter need not be
  /// registered.
  InvalidateResult invalidate_adapter(const LinearAdapter& adapter);
  /// Registered adapters, in registration order.
  std::vector<std::shared_ptr<const LinearAdapter>> adapters() const;
  /// min held-out R² over every target layer's K and V maps (-infinity for an empty report).
  static double quality(const LinearAdapter& adapter);
  /// The tail recompute loads of a prompt of prompt_tokens tokens converted by `adapter` get (see
  /// the load policy above): options().recompute_tail when >= 0, else the adapter's recorded
  /// serving tail for that length (adapter.serving().tail_for(prompt_tokens)), else 0. The
  /// adapter need not be registered. Throws InvalidArgument for prompt_tokens < 0.
  int64_t recompute_tail(const LinearAdapter& adapter, int64_t prompt_tokens) const;

  /// Records a quality check of the registered adapter with this fingerprint (see above) and
  /// returns true when this check disabled it. Throws InvalidArgument for a check out of range
  /// (positions <= 0, agreed or loss_positions outside [0, positions], a negative or non-finite
  /// kl_sum, a non-finite loss_gap_sum) and NotFound for an adapter that is not registered.
  /// Checks of a disabled adapter are counted but change nothing.
  bool record_check(const std::string& adapter_fingerprint, const QualityCheck& check);
  /// Disables / re-enables the registered adapter with this fingerprint; false if there is none.
  /// disable_adapter drops it (see "Dropped adapters" above): it waits for write-backs of the
  /// adapter already under way, then purges what it wrote back. enable_adapter empties its
  /// rolling window and undoes the drop.
  bool disable_adapter(const std::string& adapter_fingerprint);
  bool enable_adapter(const std::string& adapter_fingerprint);
  /// True when this Bridge has dropped the adapter with this fingerprint (disabled, removed or
  /// replaced it, and not re-enabled or registered it again since): entries naming it in their
  /// provenance are not served, saves naming it not stored.
  bool adapter_dropped(const std::string& adapter_fingerprint) const;
  /// Monitoring state of every registered adapter, in registration order.
  std::vector<AdapterHealth> adapter_health() const;

  /// Stores `kv` as `spec`'s cache of `tokens`: KVStore::put with the same contract (a CPU view
  /// matching spec, kv.tokens() == tokens.size). Returns the tokens now cached.
  /// `provenance`: of KV that is not spec's own prefill (computed over a converted prefix, as
  /// Load::converted_from and Load::adapter say); recorded with the chunks. When it names an
  /// adapter this Bridge has dropped nothing is stored and 0 returned; a drop that starts while
  /// this call stores waits for it and then purges what it stored.
  /// Throws InvalidArgument, storing nothing, when kv holds a NaN or an infinity.
  /// Without a provenance, a save that stored tokens registers kv's first token as spec's own
  /// start-token KV of tokens[0] unless that token has one (see "The start token" above).
  int64_t save(const ModelSpec& spec, TokenSpan tokens, const KVView& kv,
               std::string_view ns = "default", const Provenance& provenance = {});

  /// The longest usable prefix of `tokens` for `spec` (see the policy above). A miss is an empty
  /// Load, also for empty or one-token prompts. Throws InvalidArgument for a bad spec or token ids
  /// outside [0, 2^32).
  Load load(const ModelSpec& spec, TokenSpan tokens, std::string_view ns = "default");

  /// As above, and also from models with other tokenizers (the caller tokenizes; Python's
  /// Bridge.load does it for tokenizers registered with add_tokenizer).
  /// target: the text of the prompt as the target's tokenizer gives it, for the verified prefix
  ///     of `tokens`: target.ids must equal tokens[0, target.ids.size()), and the caller has
  ///     checked that decoding those tokens and encoding the text again reproduces them (where it
  ///     does not, pass only the part that does: the rest is never served across tokenizers and
  ///     is counted in BridgeStats::unverified_tokens). Spans are byte ranges of that text, and
  ///     are trusted: the caller also cuts the tokenization before the first token whose span
  ///     does not hold that token's decoded text (Python's Bridge does, for the target and each
  ///     source tokenization), or a misaligned cache would be converted.
  /// sources: the same text under each source tokenizer the caller has (SourceTokenizations),
  ///     tokenized before the call: the load calls nothing of the caller's. Only those of the
  ///     tokenizers of adapters to `spec` are used; the caller may leave out the others.
  /// Candidates are those of load() plus, for every usable adapter S -> spec whose source has
  /// another tokenizer id (add_adapter lets only adapters with an alignment policy in), S's cached
  /// prefix of sources[S.tokenizer]'s ids (none when the caller has no such tokenization). Its
  /// target tokens are aligned with the adapter's policy (align()), and the candidate is the
  /// longest target prefix (at most the verified part and n - 1) in which every token has a
  /// source token inside S's cached prefix and ends within the text those cached source tokens
  /// cover. The winner is chosen, converted (the target
  /// tokens past the native prefix, each from its aligned source token, keys re-rotated at their
  /// target positions) and written back as for load(). Throws InvalidArgument as load(), for a
  /// target tokenization that is not a prefix of tokens, or a tokenization (the target's or one
  /// of `sources`) whose ids are out of range or whose spans or roles do not match its ids or
  /// are malformed (align()).
  Load load(const ModelSpec& spec, TokenSpan tokens, const Tokenization& target,
            const SourceTokenizations& sources, std::string_view ns = "default");

  /// What load() with the same arguments would serve, found by its lookups and choice (the
  /// same tokens, native_tokens, converted, source, quality, provenance and recompute_tail),
  /// without converting, copying KV out of the store or writing back: a store lookup per
  /// candidate (and, across tokenizers, the alignment) instead of a conversion. For callers
  /// that must know a load's length before they load, as a scheduler that promises tokens
  /// which a worker then loads. The result holds no KV (copy_to throws InvalidArgument) and
  /// pins nothing. A load that follows may serve less: entries evicted meanwhile, a conversion
  /// dropped for a NaN or an infinity, an adapter dropped meanwhile. Counts in
  /// BridgeStats::probes, not as a load (lookup_seconds, dropped_tokens and the
  /// adapters_skipped_* counters include its lookups). Throws as the matching load().
  Load probe(const ModelSpec& spec, TokenSpan tokens, std::string_view ns = "default");
  Load probe(const ModelSpec& spec, TokenSpan tokens, const Tokenization& target,
             const SourceTokenizations& sources, std::string_view ns = "default");

  /// The tokenizer ids whose tokenizations a load (or probe) of `tokens` across tokenizers could
  /// use now, in registration order, each once: those of the usable adapters to `spec` (enabled,
  /// quality >= min_quality) whose source has another tokenizer id and which could serve more
  /// than spec's own cached prefix (an aligned candidate serves at most n - 1 less its
  /// recompute tail, and is chosen only when longer than the own prefix). Empty when there are
  /// none: then load() without tokenizations serves what the overload with them would, and the
  /// caller need not tokenize (Python's Bridge.load asks this first, so a prompt whose own
  /// entries are cached, a repeated one, is not tokenized again). A store lookup of spec's own
  /// prefix, counted in neither loads nor probes (its time is in lookup_seconds). Empty for
  /// empty and one-token prompts. Throws InvalidArgument as load().
  std::vector<std::string> wanted_tokenizers(const ModelSpec& spec, TokenSpan tokens,
                                             std::string_view ns = "default");

  /// Registers the first token of `kv` (a CPU view matching spec with at least one token: a
  /// one-token prefill, or the first token of any prefill of spec's own) as spec's own KV of
  /// `token_id` at position 0, replacing one registered before (see "The start token" above).
  /// The KV is copied. Throws InvalidArgument for a view that does not match spec or a token_id
  /// outside [0, 2^32).
  void add_start(const ModelSpec& spec, int64_t token_id, const KVView& kv);
  /// Copies spec's registered start-token KV of `token_id` into `dst` (a CPU view matching spec,
  /// one token); false, copying nothing, when none is registered. For loads that do not go
  /// through load() (Python's kvbridge.vllm.device_load converts on the device).
  bool copy_start(const ModelSpec& spec, int64_t token_id, const KVView& dst) const;

  BridgeStats stats() const;
  /// The stats in Prometheus text exposition format (version 0.0.4), named as
  /// KVStore::metrics_text: one family kvbridge_bridge_<metric> per row of
  /// KVBRIDGE_BRIDGE_STATS (bridge_stats.h; its kind, counter or gauge, and help), and per
  /// adapter, labelled {adapter="<fingerprint>",source="<name>",target="<name>"}: the gauges
  /// kvbridge_bridge_adapter_{enabled,agreement,kl,loss_gap,window_checks} and the counters
  /// kvbridge_bridge_adapter_{checks,disables}_total (NaN figures are written as NaN).
  std::string metrics_text() const;

  /// Test seam: `hook` is called with the name of a point a call reaches, on the calling
  /// thread: "converted" (load, after converting and before the write-back with its check that
  /// the adapter is still in use), "writing" (load or save, inside that check: the adapter's
  /// drop waits until the write ends), "dropped" (a drop, after marking the adapter and before
  /// waiting for its writes and purging; called with the registry lock held, so that hook must
  /// not call the Bridge). An empty function removes it. Set it while no other call runs; for
  /// tests that order races deterministically.
  void set_test_hook(std::function<void(std::string_view point)> hook);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
