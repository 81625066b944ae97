// The models' own KV of the token at position 0 (Bridge::add_start): per model fingerprint and
// token id, one token's KV, dense in the model's dtype on the CPU.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"

namespace kvbridge::detail {

/// One token's KV: `view` covers `buffer` (immutable once registered).
struct StartKV {
  std::shared_ptr<void> buffer;
  KVView view;
};

/// Thread-safe.
class StartTokens {
 public:
  /// Registers the first token of `kv` (a CPU view matching `spec`, at least one token) as
  /// spec's own KV of `token_id` at position 0. Unless `replace`, one already registered stays
  /// (and nothing is copied). Throws InvalidArgument for a view that does not match.
  void add(const ModelSpec& spec, int64_t token_id, const KVView& kv, bool replace);
  /// The KV registered for (spec_fingerprint, token_id), or nullptr.
  std::shared_ptr<const StartKV> find(const std::string& spec_fingerprint,
                                      int64_t token_id) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int64_t>, std::shared_ptr<const StartKV>> starts_;
};

}  // namespace kvbridge::detail
