// BridgeOptions: the Bridge's settings, described once as a field table (see
// docs/architecture.md, "A new Bridge option").
#pragma once

#include <cstdint>

namespace kvbridge {

/// BridgeOptions described once: X(type, member, default, doc). The struct's members (in this
/// order, so aggregate initialisation keeps working), the Python keyword arguments with their
/// defaults, the properties and their docstrings are produced from it; a new option is one row
/// here (and its check in the Bridge constructor, src/bridge/bridge.cpp). Types are double,
/// bool or int64_t; Python takes an int64_t option as a count (an int >= 0), recompute_tail as
/// an int >= -1.
#define KVBRIDGE_BRIDGE_OPTIONS(X)                                                                \
  X(double, min_quality, 0.5,                                                                    \
    "Adapters whose quality (the minimum held-out R^2 over the target's layers) is below this "  \
    "are never used. Any number but NaN; -infinity disables the gate. R^2 is a floor, not a "    \
    "promise: it does not predict downstream quality well, so set it from measured results for " \
    "the model pair.")                                                                           \
  X(bool, write_back, true, "Write a converted prefix back into the store as the target's own "  \
    "entry, so the next load of the same prompt is a native hit.")                               \
  X(int64_t, recompute_tail, -1,                                                                 \
    "Prompt tokens before the last one that a load holding converted tokens leaves for the "     \
    "target to compute itself over the converted prefix (it holds at most n - 1 - r tokens; the " \
    "target's own entries are not cut). -1 (the default): each adapter's own recorded tail "     \
    "(LinearAdapter::serving(), from its held-out evaluation; 0 when none is recorded). >= 0: "  \
    "that tail for every adapter; 0 converts everything but the last token.")                    \
  X(double, min_agreement, 0.8,                                                                  \
    "Floor on an adapter's rolling top-1 agreement from record_check(); in [0, 1], or "          \
    "-infinity to never disable. Agreement is the share of compared positions where the "        \
    "target's greedy next token after the converted cache equals the one after its own prefill.") \
  X(int64_t, check_window, 32,                                                                   \
    "Quality checks (record_check calls) per adapter kept for the rolling figures; >= 1.")       \
  X(int64_t, min_checks, 8,                                                                      \
    "Checks an adapter must have in its window before the agreement floor applies; in "          \
    "[1, check_window]. A broken adapter is disabled by its min_checks-th check at the latest.")

#define KVBRIDGE_BRIDGE_OPTION_MEMBER_(type, member, default_value, doc) \
  type member = default_value;

/// The Bridge's options; every field's meaning and default is in KVBRIDGE_BRIDGE_OPTIONS above.
struct BridgeOptions {
  KVBRIDGE_BRIDGE_OPTIONS(KVBRIDGE_BRIDGE_OPTION_MEMBER_)
};

}  // namespace kvbridge
