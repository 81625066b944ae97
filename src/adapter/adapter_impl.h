// State shared by the fitter and the adapter.
#pragma once

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvbridge/adapter.h"
#include "kvbridge/align.h"
#include "src/adapter/gemm.h"
#include "src/adapter/numeric.h"

namespace kvbridge {

/// The CUDA path's per-device state (src/adapter/convert_cuda.cpp): weights uploaded on first use
/// of a device and reusable workspaces. Builds without CUDA never create one.
struct CudaCache;
struct CudaCacheDeleter {
  void operator()(CudaCache* cache) const noexcept;  // frees the device memory
};

namespace detail {
/// An adapter's weights packed for the bfloat16 GEMM (detail::gemm_bf16): [target layer][kind]
/// [source layer of its `layers`].
using Bf16Weights = std::vector<std::array<std::vector<Bf16PackedB>, 2>>;
}  // namespace detail

struct LinearAdapter::Impl {
  ModelSpec source, target;
  FitReport report;
  detail::LayerInvFreq source_inv_freq, target_inv_freq;  // per layer (each distinct set once)
  /// Per target layer: source layers (ascending), and for K (0) and V (1) the weights
  /// [features, outputs] row-major and bias [outputs].
  std::vector<std::vector<int64_t>> layers;
  std::vector<std::array<std::vector<float>, 2>> weights, bias;
  /// FitOptions::target_key_norm: per target layer the gains [target.head_dim], or empty.
  std::vector<std::vector<float>> key_norm;
  /// FitOptions::target_token_codes (empty: none) and token_context (0 when none); per target
  /// layer, for K (0) and V (1), the codes' weights [token_context * dims, outputs] row-major
  /// (empty: that map has no codes' term).
  TokenCodes token_codes;
  int64_t token_context = 0;
  std::vector<std::array<std::vector<float>, 2>> token_weights;
  /// Created by the first convert of CUDA views; cuda_mutex guards the pointer and the map of
  /// devices inside it.
  mutable std::mutex cuda_mutex;
  mutable std::unique_ptr<CudaCache, CudaCacheDeleter> cuda_cache;
  /// Built by the first bfloat16 convert that uses the bfloat16 GEMM (bf16_weights()).
  mutable std::once_flag bf16_once;
  mutable detail::Bf16Weights bf16_packed;
  /// LinearAdapter::fingerprint(), computed once on first use.
  mutable std::once_flag fingerprint_once;
  mutable std::string fingerprint;
  /// LinearAdapter::serving(): the one part that may change after fit or load (set_serving).
  mutable std::mutex serving_mutex;
  ServingDefaults serving;  // guarded by serving_mutex

  int64_t source_width() const { return source.num_kv_heads * source.head_dim; }
  int64_t target_width() const { return target.num_kv_heads * target.head_dim; }
  /// bf16_packed, packed on first call (thread-safe).
  const detail::Bf16Weights& bf16_weights() const;
};

namespace detail {
/// Checks gains shaped as FitOptions::target_key_norm for `target` (empty, or one finite vector
/// of head_dim per layer); `what` names them in the InvalidArgument it throws.
void check_key_norm(const std::vector<std::vector<float>>& gains, const ModelSpec& target,
                    const char* what);
/// Puts each key head of rows [n, heads * g.size()] (row stride ld) back on the target's key
/// norm set with gains g (FitOptions::target_key_norm says how).
template <typename T>
void project_key_norm(const std::vector<float>& g, int64_t heads, int64_t n, T* keys, int64_t ld);
}  // namespace detail

/// Checks that a source/target view pair fits the specs (shared by the fitter and the adapter);
/// same_tokens: both hold the same number of tokens (false: an alignment pairs them).
void check_pair(const ModelSpec& source, const ModelSpec& target, const KVView& src,
                const KVView& dst, const char* src_name, const char* dst_name,
                bool same_tokens = true);

/// Checks an alignment (one entry per target token, each a source token index in
/// [0, source_tokens), or kNoSource where allow_missing) (shared by the fitter and the adapter).
void check_alignment(const std::vector<int64_t>& alignment, int64_t source_tokens,
                     int64_t target_tokens, bool allow_missing);

namespace detail {
/// Checks codes shaped as FitOptions::target_token_codes (empty, or vocab, dims > 0 and
/// vocab * dims finite values) and a context in [1, 8]; `what` names them.
void check_token_codes(const TokenCodes& codes, int64_t context, const char* what);
/// Checks the target ids of `tokens` target tokens at absolute positions first, first + 1, ...
/// against codes of `vocab` entries and a context of `context` tokens (TargetTokens).
void check_target_tokens(const TargetTokens& tokens, int64_t count, int64_t first, int64_t vocab,
                         int64_t context);
/// The codes' features of target tokens [t0, t0 + n) of `tokens` (the call's first token at
/// absolute position `first`): row t holds the codes of token t0 + t and of the context - 1
/// before it, nearest first, zeros before position 0; [n, context * dims] row-major into out.
template <typename T>
void token_features(const TokenCodes& codes, int64_t context, const TargetTokens& tokens,
                    int64_t first, int64_t t0, int64_t n, T* out);

/// The position and alignment checks of a convert (CPU and CUDA): start_pos for the source's
/// tokens; with an alignment also target_start_pos for the target's and the alignment itself
/// (every entry a source index, no kNoSource).
void check_convert_positions(const KVView& src, int64_t start_pos, const KVView& dst,
                             const std::vector<int64_t>* alignment, int64_t target_start_pos);
}  // namespace detail

}  // namespace kvbridge
