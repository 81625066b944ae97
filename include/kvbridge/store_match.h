// Match and MatchLength: what KVStore::match and KVStore::match_length return.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvbridge/kv_view.h"
#include "kvbridge/provenance.h"

namespace kvbridge {

namespace detail {
struct ChunkEntry;
}

/// The result of KVStore::match: the longest cached prefix, pinned while this object lives.
/// Movable, not copyable. Thread-compatible (use one Match from one thread at a time).
class Match {
 public:
  Match() = default;
  Match(Match&&) noexcept = default;
  Match& operator=(Match&&) noexcept = default;
  Match(const Match&) = delete;
  Match& operator=(const Match&) = delete;
  ~Match();

  /// Length of the matched prefix in tokens: a multiple of chunk_tokens, 0 on a miss.
  int64_t tokens() const noexcept { return tokens_; }
  int64_t chunks() const noexcept { return static_cast<int64_t>(entries_.size()); }
  explicit operator bool() const noexcept { return tokens_ > 0; }

  /// Where chunk `chunk` (0 <= chunk < chunks()) came from. Throws InvalidArgument otherwise.
  Provenance provenance(int64_t chunk) const;
  /// The provenance of the first chunk that is not the model's own prefill (converted through
  /// an adapter, or computed over such a prefix); empty when every chunk is the model's own.
  /// KV computed after this prefix derives from it and should be stored with this provenance.
  Provenance converted_provenance() const;

  /// Copies the matched prefix into `dst`, which must be a CPU view with the store entry's
  /// layers, kv_heads, head_dim and dtype, and exactly tokens() tokens.
  void copy_to(const KVView& dst) const;
  /// Copies tokens [begin, begin + dst.tokens()) of the matched prefix into `dst`.
  void copy_range_to(int64_t begin, const KVView& dst) const;

 private:
  friend class KVStore;
  std::vector<std::shared_ptr<const detail::ChunkEntry>> entries_;
  int64_t tokens_ = 0;
  int64_t chunk_tokens_ = 0;
};

/// The result of KVStore::match_length: what Match::tokens() and Match::converted_provenance()
/// of the same match() would say, without the KV.
struct MatchLength {
  int64_t tokens = 0;
  Provenance converted_provenance;
};

}  // namespace kvbridge
