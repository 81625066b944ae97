// Provenance: where a stored chunk's KV came from (the model's own prefill, or a conversion).
#pragma once

#include <string>

namespace kvbridge {

/// Where a stored chunk's KV came from; recorded with the entry in every tier
/// (docs/storage.md). Both fields empty: the model's own KV. Otherwise both are 32 lowercase hex
/// digits: ModelSpec::fingerprint() of the model whose cache was converted, and
/// LinearAdapter::fingerprint() of the adapter that converted it (Bridge write-back).
struct Provenance {
  std::string source_fingerprint;
  std::string adapter_fingerprint;
  bool converted() const noexcept { return !adapter_fingerprint.empty(); }
};

}  // namespace kvbridge
