// Serving defaults (ServingDefaults, adapter.h): validation and their JSON form in the adapter
// file's "serving" metadata key (docs/adapter_file.md).
#pragma once

#include <string>

#include "kvbridge/adapter.h"

namespace kvbridge {
namespace detail {

/// The metadata key of the record.
inline constexpr const char* kServingKey = "serving";

/// Throws InvalidArgument for a recorded value out of range (LinearAdapter::set_serving).
void check_serving(const ServingDefaults& serving);

/// The record as compact JSON: {"agreement_goal": number or null, "measured": [{"agreement",
/// "computed_share", "kept", "prompt_tokens", "recompute_tail"}, ...], "note": string,
/// "recompute_tail": int} (NaN figures as null). Only for serving.recorded.
std::string serving_json(const ServingDefaults& serving);

/// The inverse (recorded = true); throws Corrupt naming what does not parse or is out of range.
ServingDefaults parse_serving(const std::string& text);

}  // namespace detail
}  // namespace kvbridge
