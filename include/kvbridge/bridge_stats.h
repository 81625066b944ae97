// BridgeStats: the Bridge's counters and gauges, described once as a field table (see
// docs/architecture.md, "A new counter"). Bridge::stats() snapshots them and
// Bridge::metrics_text() writes them for Prometheus.
#pragma once

#include <cstdint>

namespace kvbridge {

/// Counters since construction. Times are wall-clock seconds summed over calls.
/// BridgeStats described once, as kv_store.h's tables: X(type, member, metric, kind, help),
/// metric names after the kvbridge_bridge_ prefix. adapters_skipped_quality counts, per load or
/// probe, the adapters to the target under min_quality; adapters_skipped_stale, per load or
/// probe, the adapters whose target has the load spec's name but another fingerprint (a stale
/// adapter after a model update: never used, since adapters match by exact fingerprint).
/// converted_tokens includes any trimmed last token.
#define KVBRIDGE_BRIDGE_STATS(X)                                                                  \
  X(int64_t, saves, "saves_total", counter, "Bridge save calls.")                                \
  X(int64_t, loads, "loads_total", counter, "Bridge load calls.")                                \
  X(int64_t, probes, "probes_total", counter,                                                    \
    "Bridge probe calls (a load's length found without converting).")                            \
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
  X(int64_t, adapters_skipped_disabled, "adapters_skipped_disabled_total", counter,              \
    "Adapters to a load's target passed over because they are disabled.")                        \
  X(int64_t, quality_checks, "quality_checks_total", counter,                                    \
    "Shadow quality checks recorded (record_check calls).")                                      \
  X(int64_t, quality_disables, "quality_disables_total", counter,                                \
    "Adapters disabled by the agreement floor.")                                                 \
  X(int64_t, cross_tokenizer_loads, "cross_tokenizer_loads_total", counter,                      \
    "Load calls given a target tokenization (across tokenizers; Python's Bridge gives one "      \
    "only where wanted_tokenizers names a tokenizer it has).")                                   \
  X(int64_t, unverified_tokens, "unverified_tokens_total", counter,                              \
    "Prompt tokens past the verified prefix of a load across tokenizers (never served).")        \
  X(int64_t, aligned_hits, "aligned_hits_total", counter,                                        \
    "Converted hits across tokenizers (of converted_hits).")                                     \
  X(int64_t, dropped_writes, "dropped_writes_total", counter,                                  \
    "Write-backs and saves not stored because their adapter was dropped (disabled, removed or " \
    "replaced).")                                                                                \
  X(int64_t, dropped_tokens, "dropped_tokens_total", counter,                                    \
    "Cached tokens not served because their entry's provenance names a dropped adapter.")       \
  X(int64_t, nonfinite_refused, "nonfinite_refused_total", counter,                              \
    "Saves refused and conversions dropped for KV holding a NaN or an infinity.")               \
  X(double, lookup_seconds, "lookup_seconds_total", counter,                                     \
    "Seconds spent in store lookups and copies out of the store.")                               \
  X(double, convert_seconds, "convert_seconds_total", counter,                                   \
    "Seconds spent converting through adapters.")                                                \
  X(int64_t, adapters, "adapters", gauge, "Adapters registered.")                                \
  X(int64_t, adapters_below_quality, "adapters_below_quality", gauge,                            \
    "Registered adapters under min_quality (never used).")                                       \
  X(int64_t, adapters_disabled, "adapters_disabled", gauge,                                      \
    "Registered adapters disabled now (by quality checks or disable_adapter).")

#define KVBRIDGE_BRIDGE_STATS_MEMBER_(type, member, metric, kind, help) type member{};

/// The Bridge's counters and gauges (Bridge::stats()); one member per row above.
struct BridgeStats {
  KVBRIDGE_BRIDGE_STATS(KVBRIDGE_BRIDGE_STATS_MEMBER_)
};

}  // namespace kvbridge
