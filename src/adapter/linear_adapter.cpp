#include <Eigen/Dense>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"
#include "src/adapter/adapter_impl.h"
#include "src/adapter/convert_cuda.h"
#include "src/adapter/gemm.h"
#include "src/adapter/numeric.h"
#include "src/adapter/parallel.h"

namespace kvbridge {

namespace {
template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Per-call working memory of the conversion, one per thread: one source layer's un-rotated
// features and one target layer's key and value planes for a block of tokens, and the RoPE
// tables of both models for it, one per distinct set of frequencies (detail::LayerInvFreq).
template <typename T>
struct Workspace {
  RowMat<T> x;
  std::array<RowMat<T>, 2> y;
  RowMat<T> z;  // the token codes' features of the block (has_token_codes)
  std::vector<float> buf;  // double: gathered and stored through float32
  detail::Bf16TiledA x_bf16;  // x rounded for the bfloat16 GEMMs
  std::vector<detail::RopeTable<T>> source_angles, target_angles;
};

// A bfloat16 output is rounded to 8 significant bits anyway: its GEMMs take bfloat16 inputs (as
// the CUDA path's do) where the CPU multiplies bfloat16 natively (AMX tiles: several times the
// float32 GEMM's rate; AVX512-BF16: about twice).
bool bf16_convert(DType dst_dtype) {
  return dst_dtype == DType::kBFloat16 && detail::bf16_gemm_kernel() != nullptr;
}

// Tokens per block of the float32 path. Blocks are converted in parallel, one per OpenMP thread
// at a time, each with single-threaded GEMMs: the threads need no synchronisation inside a
// block, which keeps the GEMMs at their speed on a busy machine where a thread waiting at a
// barrier can lose its core for a whole time slice. The working memory of all blocks in flight
// together is kept within 90% of the output's size in its dtype (the GEMMs' packing buffers and
// the allocator take a few percent on top), and it does not grow with the number of layers.
// Blocks are at least kMinBlockTokens long (below that the GEMMs lose speed) unless the input is
// shorter, there are enough of them to keep every thread busy, in whole rounds of the threads,
// and of equal length. The float64 reference converts in one block (it is the check of
// blocking).
constexpr int64_t kMinBlockTokens = 128;

int64_t block_tokens(const LinearAdapter::Impl& a, int64_t tokens, DType dst_dtype,
                     int64_t threads, bool bf16) {
  // float32 features (and the token codes' features), planes and RoPE tables (one per distinct
  // frequency set); with bfloat16 GEMMs the features once more in bfloat16.
  const int64_t per_token_work =
      static_cast<int64_t>(sizeof(float)) *
          (2 * a.source_width() + 2 * a.target_width() + a.token_context * a.token_codes.dims +
           a.source_inv_freq.num_sets() * a.source.head_dim +
           a.target_inv_freq.num_sets() * a.target.head_dim) +
      (bf16 ? static_cast<int64_t>(sizeof(uint16_t)) * 2 * a.source_width() : 0);
  const int64_t per_token_output = a.target.num_layers * 2 * a.target_width() *
                                   static_cast<int64_t>(dtype_size(dst_dtype));
  // Tokens of working memory that the output's size allows, all threads together.
  const int64_t fit = tokens * per_token_output * 9 / (10 * std::max<int64_t>(per_token_work, 1));
  const int64_t longest = std::max(kMinBlockTokens, fit / threads);
  int64_t blocks = (tokens + longest - 1) / longest;
  blocks = std::max(blocks, std::min(threads, tokens / kMinBlockTokens));
  if (blocks > threads) blocks = (blocks + threads - 1) / threads * threads;
  return (tokens + blocks - 1) / blocks;
}

// Converts target tokens [b0, b0 + n) in arithmetic type T: per target layer, for each of its source
// layers, gather and un-rotate that layer's keys and values (with that source layer's RoPE) and
// add their GEMMs into the key and value planes (started at the bias); then rotate the keys (with
// the target layer's RoPE) and store both. bf16: the float32
// path's GEMMs on detail::gemm_bf16 with the features and weights in bfloat16 (nullptr: float32
// GEMMs).
template <typename T>
void convert_block(const LinearAdapter::Impl& a, const KVView& src, int64_t start_pos,
                   const KVView& dst, const int64_t* alignment, int64_t target_start_pos,
                   const TargetTokens* tokens, int64_t b0, int64_t n, Workspace<T>& w,
                   const detail::Bf16Weights* bf16) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  const int64_t sw = a.source_width(), tw = a.target_width();
  const bool rope = a.report.rope_aware;
  if (w.x.rows() < n) {
    w.x.resize(n, 2 * sw);
    for (auto& y : w.y) y.resize(n, tw);
    if (!kFloat) w.buf.resize(static_cast<size_t>(n * 2 * std::max(sw, tw)));
  }
  // Source rows of the block: tokens b0.. (positions start_pos + b0 + t), or with an alignment
  // tokens alignment[b0 + t] of the whole source (positions start_pos + alignment[b0 + t]).
  const int64_t* rows = alignment ? alignment + b0 : nullptr;
  const KVView s = rows ? src : src.slice_tokens(b0, n);
  const KVView d = dst.slice_tokens(b0, n);
  if (rope) {
    w.source_angles.resize(a.source_inv_freq.sets.size());
    w.target_angles.resize(a.target_inv_freq.sets.size());
    for (size_t i = 0; i < w.source_angles.size(); ++i)
      detail::rope_table(a.source_inv_freq.sets[i], rows ? start_pos : start_pos + b0, n,
                         w.source_angles[i], rows);
    for (size_t i = 0; i < w.target_angles.size(); ++i)
      detail::rope_table(a.target_inv_freq.sets[i], target_start_pos + b0, n, w.target_angles[i]);
  }
  const int64_t zw = a.token_context * a.token_codes.dims;
  if (zw > 0) {
    w.z.resize(n, zw);
    detail::token_features(a.token_codes, a.token_context, *tokens, target_start_pos, b0, n,
                           w.z.data());
  }
  for (int64_t j = 0; j < a.target.num_layers; ++j) {
    const auto& layers = a.layers[static_cast<size_t>(j)];
    for (int kind = 0; kind < 2; ++kind) {
      const auto& b = a.bias[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      w.y[static_cast<size_t>(kind)].topRows(n).rowwise() =
          Eigen::Map<const Eigen::Matrix<float, 1, Eigen::Dynamic>>(b.data(), tw)
              .template cast<T>();
    }
    for (size_t si = 0; si < layers.size(); ++si) {
      const int64_t l = layers[si];
      float* gathered = w.buf.data();
      if constexpr (kFloat) gathered = w.x.data();
      for (int kind = 0; kind < 2; ++kind)
        detail::load_plane(s.plane(l, static_cast<KVView::Kind>(kind)), s.dtype(), n,
                           a.source.num_kv_heads, a.source.head_dim, gathered + kind * sw, 2 * sw,
                           rows);
      if constexpr (!kFloat)
        w.x.topRows(n) = Eigen::Map<RowMat<float>>(w.buf.data(), n, 2 * sw).cast<T>();
      if (rope)
        detail::apply_rope(a.source, w.source_angles[a.source_inv_freq.set(l)], /*inverse=*/true,
                           a.source.num_kv_heads, w.x.data(), 2 * sw);
      if constexpr (kFloat)
        if (bf16) detail::tile_a_bf16(n, 2 * sw, w.x.data(), 2 * sw, w.x_bf16);
      for (int kind = 0; kind < 2; ++kind) {
        const float* ws = a.weights[static_cast<size_t>(j)][static_cast<size_t>(kind)].data() +
                          static_cast<int64_t>(si) * 2 * sw * tw;
        RowMat<T>& y = w.y[static_cast<size_t>(kind)];
        if constexpr (kFloat) {
          if (bf16)
            detail::gemm_bf16(w.x_bf16,
                              (*bf16)[static_cast<size_t>(j)][static_cast<size_t>(kind)][si],
                              y.data(), tw);
          else
            detail::gemm_f32(n, tw, 2 * sw, w.x.data(), 2 * sw, ws, tw, y.data(), tw,
                             /*accumulate=*/true);
        } else {
          y.topRows(n).noalias() +=
              w.x.topRows(n) * Eigen::Map<const RowMat<float>>(ws, 2 * sw, tw).cast<T>();
        }
      }
    }
    for (int kind = 0; kind < 2 && zw > 0; ++kind) {
      const auto& wz = a.token_weights[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      if (wz.empty()) continue;
      RowMat<T>& y = w.y[static_cast<size_t>(kind)];
      if constexpr (kFloat)
        detail::gemm_f32(n, tw, zw, w.z.data(), zw, wz.data(), tw, y.data(), tw,
                         /*accumulate=*/true);
      else
        y.topRows(n).noalias() += w.z * Eigen::Map<const RowMat<float>>(wz.data(), zw, tw).cast<T>();
    }
    if (!a.key_norm.empty())
      detail::project_key_norm(a.key_norm[static_cast<size_t>(j)], a.target.num_kv_heads, n,
                               w.y[0].data(), tw);
    if (rope)
      detail::apply_rope(a.target, w.target_angles[a.target_inv_freq.set(j)], /*inverse=*/false,
                         a.target.num_kv_heads, w.y[0].data(), tw);
    for (int kind = 0; kind < 2; ++kind) {
      const float* plane = nullptr;
      if constexpr (kFloat) {
        plane = w.y[static_cast<size_t>(kind)].data();
      } else {
        Eigen::Map<RowMat<float>>(w.buf.data(), n, tw) =
            w.y[static_cast<size_t>(kind)].topRows(n).template cast<float>();
        plane = w.buf.data();
      }
      detail::store_plane(plane, tw, d.dtype(), n, a.target.num_kv_heads, a.target.head_dim,
                          d.plane(j, static_cast<KVView::Kind>(kind)));
    }
  }
}

template <typename T>
void convert_impl(const LinearAdapter::Impl& a, const KVView& src, int64_t start_pos,
                  const KVView& dst, const std::vector<int64_t>* alignment,
                  int64_t target_start_pos, const TargetTokens* tokens) {
  check_pair(a.source, a.target, src, dst, "source_kv", "target_kv", alignment == nullptr);
  detail::check_convert_positions(src, start_pos, dst, alignment, target_start_pos);
  if (!a.token_codes.empty()) {
    KVB_CHECK(tokens != nullptr,
              "convert: this adapter takes the target's token ids (has_token_codes); pass them "
              "(TargetTokens)");
    detail::check_target_tokens(*tokens, dst.tokens(), target_start_pos, a.token_codes.vocab,
                                a.token_context);
  }
  const int64_t T_ = dst.tokens();
  if (T_ == 0) return;
  constexpr bool kFloat = std::is_same_v<T, float>;
  const auto* bf16 = kFloat && bf16_convert(dst.dtype()) ? &a.bf16_weights() : nullptr;
  const int64_t threads = kFloat ? std::max(1, omp_get_max_threads()) : 1;
  const int64_t B = kFloat ? block_tokens(a, T_, dst.dtype(), threads, bf16 != nullptr) : T_;
  const int64_t blocks = (T_ + B - 1) / B;
  // One workspace per thread (empty until its first block); a single block runs on the calling
  // thread, whose plane passes and GEMMs are then threaded themselves.
  std::vector<Workspace<T>> work(static_cast<size_t>(blocks > 1 ? threads : 1));
  detail::parallel_for(blocks, [&](int64_t i) {
    const int64_t b0 = i * B;
    const size_t slot = blocks > 1 ? static_cast<size_t>(omp_get_thread_num()) : 0;
    convert_block(a, src, start_pos, dst, alignment ? alignment->data() : nullptr, target_start_pos,
                  a.token_codes.empty() ? nullptr : tokens, b0, std::min(B, T_ - b0), work[slot],
                  bf16);
  });
}
}  // namespace

void check_alignment(const std::vector<int64_t>& alignment, int64_t source_tokens,
                     int64_t target_tokens, bool allow_missing) {
  KVB_CHECK(static_cast<int64_t>(alignment.size()) == target_tokens,
            "alignment: expected one entry per target token (" << target_tokens << "), got "
                                                               << alignment.size());
  for (size_t j = 0; j < alignment.size(); ++j) {
    const int64_t i = alignment[j];
    KVB_CHECK((i >= 0 && i < source_tokens) || (allow_missing && i == kNoSource),
              "alignment[" << j << "] = " << i << ": expected a source token index in [0, "
                           << source_tokens << ")" << (allow_missing ? " or -1" : "")
                           << (i == kNoSource ? " (no source token serves this target token; "
                                                "convert only tokens that have one)"
                                              : ""));
  }
}

namespace detail {
void check_key_norm(const std::vector<std::vector<float>>& gains, const ModelSpec& target,
                    const char* what) {
  if (gains.empty()) return;
  KVB_CHECK(static_cast<int64_t>(gains.size()) == target.num_layers,
            what << ": expected one gain vector per target layer (" << target.num_layers
                 << "), got " << gains.size());
  for (size_t j = 0; j < gains.size(); ++j) {
    KVB_CHECK(static_cast<int64_t>(gains[j].size()) == target.head_dim,
              what << "[" << j << "]: expected " << target.head_dim << " gains (head_dim), got "
                   << gains[j].size());
    for (float g : gains[j])
      KVB_CHECK(std::isfinite(g), what << "[" << j << "]: gains must be finite, got " << g);
  }
}

template <typename T>
void project_key_norm(const std::vector<float>& g, int64_t heads, int64_t n, T* keys, int64_t ld) {
  const int64_t d = static_cast<int64_t>(g.size());
  // 1 / g_i, and 0 where g_i = 0, so the loops below multiply only (and mask by it).
  std::vector<T> inv(static_cast<size_t>(d));
  int64_t used = 0;
  for (int64_t i = 0; i < d; ++i) {
    const float gi = g[static_cast<size_t>(i)];
    inv[static_cast<size_t>(i)] = gi != 0 ? T(1) / static_cast<T>(gi) : T(0);
    used += gi != 0;
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      T* k = keys + t * ld + h * d;
      T sum = 0;
      for (int64_t i = 0; i < d; ++i) {
        const T u = k[i] * inv[static_cast<size_t>(i)];
        sum += u * u;
      }
      // A head with nothing to scale keeps its values (sum 0); NaN stays NaN, as elsewhere.
      const T scale = sum != 0 ? std::sqrt(static_cast<T>(used) / sum) : T(1);
      for (int64_t i = 0; i < d; ++i)
        k[i] = inv[static_cast<size_t>(i)] != 0 ? k[i] * scale : T(0);
    }
}
template void project_key_norm<float>(const std::vector<float>&, int64_t, int64_t, float*,
                                      int64_t);
template void project_key_norm<double>(const std::vector<float>&, int64_t, int64_t, double*,
                                       int64_t);

void check_token_codes(const TokenCodes& codes, int64_t context, const char* what) {
  if (codes.empty()) return;
  KVB_CHECK(codes.vocab > 0 && codes.dims > 0,
            what << ": expected vocab and dims > 0, got " << codes.vocab << " and " << codes.dims);
  KVB_CHECK(static_cast<int64_t>(codes.values.size()) == codes.vocab * codes.dims,
            what << ": expected vocab * dims = " << codes.vocab * codes.dims << " values, got "
                 << codes.values.size());
  for (size_t i = 0; i < codes.values.size(); ++i)
    KVB_CHECK(std::isfinite(codes.values[i]),
              what << ": codes must be finite, got " << codes.values[i] << " for id "
                   << static_cast<int64_t>(i) / codes.dims);
  KVB_CHECK(context >= 1 && context <= 8, "token_context must lie in [1, 8], got " << context);
}

namespace {
int64_t token_at(const TokenSpan& ids, size_t i) {
  return ids.data ? ids.data[i] : static_cast<int64_t>(ids.data32[i]);
}
}  // namespace

void check_target_tokens(const TargetTokens& tokens, int64_t count, int64_t first, int64_t vocab,
                         int64_t context) {
  KVB_CHECK(static_cast<int64_t>(tokens.ids.size) == count,
            "target token ids: expected one per target token (" << count << "), got "
                                                                 << tokens.ids.size);
  const auto check = [&](int64_t id, const char* where, size_t i) {
    KVB_CHECK(id >= 0 && id < vocab, "target token ids: " << where << "[" << i << "] = " << id
                                                          << " is outside the adapter's codes [0, "
                                                          << vocab << ")");
  };
  for (size_t i = 0; i < tokens.ids.size; ++i) check(token_at(tokens.ids, i), "ids", i);
  const int64_t need = std::min(context - 1, first);
  KVB_CHECK(static_cast<int64_t>(tokens.previous.size()) >= need,
            "target token ids: the call starts at position "
                << first << ", so the " << need << " ids before it are needed (previous), got "
                << tokens.previous.size());
  for (size_t i = 0; i < tokens.previous.size(); ++i) check(tokens.previous[i], "previous", i);
}

template <typename T>
void token_features(const TokenCodes& codes, int64_t context, const TargetTokens& tokens,
                    int64_t first, int64_t t0, int64_t n, T* out) {
  const int64_t d = codes.dims, width = context * d;
  const int64_t before = static_cast<int64_t>(tokens.previous.size());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < context; ++c) {
      T* row = out + t * width + c * d;
      const int64_t i = t0 + t - c;  // index among the call's tokens; < 0: before them
      int64_t id = -1;
      if (first + i >= 0) id = i >= 0 ? token_at(tokens.ids, static_cast<size_t>(i))
                                      : tokens.previous[static_cast<size_t>(before + i)];
      if (id < 0) {
        std::fill(row, row + d, T(0));
      } else {
        const float* code = codes.values.data() + id * d;
        for (int64_t k = 0; k < d; ++k) row[k] = static_cast<T>(code[k]);
      }
    }
  }
}
template void token_features<float>(const TokenCodes&, int64_t, const TargetTokens&, int64_t,
                                    int64_t, int64_t, float*);
template void token_features<double>(const TokenCodes&, int64_t, const TargetTokens&, int64_t,
                                     int64_t, int64_t, double*);

void check_convert_positions(const KVView& src, int64_t start_pos, const KVView& dst,
                             const std::vector<int64_t>* alignment, int64_t target_start_pos) {
  detail::check_positions(start_pos, src.tokens());
  if (!alignment) return;
  detail::check_positions(target_start_pos, dst.tokens());
  check_alignment(*alignment, src.tokens(), dst.tokens(), /*allow_missing=*/false);
}
}  // namespace detail

const detail::Bf16Weights& LinearAdapter::Impl::bf16_weights() const {
  std::call_once(bf16_once, [&] {
    const int64_t features = 2 * source_width(), outputs = target_width();
    bf16_packed.resize(layers.size());
    for (size_t j = 0; j < layers.size(); ++j)
      for (size_t kind = 0; kind < 2; ++kind)
        for (size_t si = 0; si < layers[j].size(); ++si)
          bf16_packed[j][kind].push_back(detail::pack_b_bf16(
              weights[j][kind].data() + static_cast<int64_t>(si) * features * outputs, outputs,
              features, outputs));
  });
  return bf16_packed;
}

const char* cpu_convert_kernel(DType target_dtype) noexcept {
  return bf16_convert(target_dtype) ? detail::bf16_gemm_kernel() : detail::gemm_isa();
}

LinearAdapter::LinearAdapter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LinearAdapter::LinearAdapter(LinearAdapter&&) noexcept = default;
LinearAdapter& LinearAdapter::operator=(LinearAdapter&&) noexcept = default;
LinearAdapter::~LinearAdapter() = default;

const ModelSpec& LinearAdapter::source() const noexcept { return impl_->source; }
const ModelSpec& LinearAdapter::target() const noexcept { return impl_->target; }
const FitReport& LinearAdapter::report() const noexcept { return impl_->report; }

const std::vector<float>& LinearAdapter::weights(int64_t layer, int kind) const {
  KVB_CHECK(layer >= 0 && layer < impl_->target.num_layers && (kind == 0 || kind == 1),
            "weights: no layer " << layer << " kind " << kind);
  return impl_->weights[static_cast<size_t>(layer)][static_cast<size_t>(kind)];
}
const std::vector<float>& LinearAdapter::bias(int64_t layer, int kind) const {
  KVB_CHECK(layer >= 0 && layer < impl_->target.num_layers && (kind == 0 || kind == 1),
            "bias: no layer " << layer << " kind " << kind);
  return impl_->bias[static_cast<size_t>(layer)][static_cast<size_t>(kind)];
}
bool LinearAdapter::has_key_norm() const noexcept { return !impl_->key_norm.empty(); }
const std::vector<float>& LinearAdapter::key_norm(int64_t layer) const {
  KVB_CHECK(layer >= 0 && layer < impl_->target.num_layers, "key_norm: no layer " << layer);
  static const std::vector<float> kNone;
  return impl_->key_norm.empty() ? kNone : impl_->key_norm[static_cast<size_t>(layer)];
}

bool LinearAdapter::has_token_codes() const noexcept { return !impl_->token_codes.empty(); }
const TokenCodes& LinearAdapter::token_codes() const noexcept { return impl_->token_codes; }
int64_t LinearAdapter::token_context() const noexcept { return impl_->token_context; }
const std::vector<float>& LinearAdapter::token_weights(int64_t layer, int kind) const {
  KVB_CHECK(layer >= 0 && layer < impl_->target.num_layers && (kind == 0 || kind == 1),
            "token_weights: no layer " << layer << " kind " << kind);
  static const std::vector<float> kNone;
  return impl_->token_weights.empty()
             ? kNone
             : impl_->token_weights[static_cast<size_t>(layer)][static_cast<size_t>(kind)];
}

void LinearAdapter::convert(const KVView& src, int64_t start_pos, const KVView& dst) const {
  convert(src, start_pos, dst, nullptr);
}

void LinearAdapter::convert(const KVView& src, int64_t start_pos, const KVView& dst,
                            void* cuda_stream) const {
  convert_dispatch(src, start_pos, dst, nullptr, start_pos, nullptr, cuda_stream);
}

void LinearAdapter::convert(const KVView& src, int64_t start_pos, const KVView& dst,
                            const std::vector<int64_t>& alignment, int64_t target_start_pos,
                            void* cuda_stream) const {
  convert_dispatch(src, start_pos, dst, &alignment, target_start_pos, nullptr, cuda_stream);
}

void LinearAdapter::convert(const KVView& src, int64_t start_pos, const KVView& dst,
                            const TargetTokens& tokens, void* cuda_stream) const {
  convert_dispatch(src, start_pos, dst, nullptr, start_pos, &tokens, cuda_stream);
}

void LinearAdapter::convert(const KVView& src, int64_t start_pos, const KVView& dst,
                            const std::vector<int64_t>& alignment, int64_t target_start_pos,
                            const TargetTokens& tokens, void* cuda_stream) const {
  convert_dispatch(src, start_pos, dst, &alignment, target_start_pos, &tokens, cuda_stream);
}

void LinearAdapter::convert_dispatch(const KVView& src, int64_t start_pos, const KVView& dst,
                                     const std::vector<int64_t>* alignment,
                                     int64_t target_start_pos, const TargetTokens* tokens,
                                     void* cuda_stream) const {
  KVB_CHECK(src.device() == dst.device(),
            "source_kv and target_kv must be on one device, got "
                << (src.device().type == DeviceType::kCUDA ? "cuda:" : "cpu:") << src.device().index
                << " and " << (dst.device().type == DeviceType::kCUDA ? "cuda:" : "cpu:")
                << dst.device().index);
  if (src.device().type == DeviceType::kCUDA) {
    KVB_CHECK_AS(Unavailable, impl_->key_norm.empty(),
                 "convert: this adapter applies the target's key norm (has_key_norm), which only "
                 "the CPU path does so far; convert on the CPU");
    KVB_CHECK_AS(Unavailable, impl_->token_codes.empty(),
                 "convert: this adapter takes the target's token codes (has_token_codes), which "
                 "only the CPU path does so far; convert on the CPU");
    detail::convert_cuda(*impl_, src, start_pos, dst, cuda_stream, alignment, target_start_pos);
    return;
  }
  convert_impl<float>(*impl_, src, start_pos, dst, alignment, target_start_pos, tokens);
}

void LinearAdapter::convert_reference(const KVView& src, int64_t start_pos,
                                      const KVView& dst) const {
  convert_impl<double>(*impl_, src, start_pos, dst, nullptr, start_pos, nullptr);
}

void LinearAdapter::convert_reference(const KVView& src, int64_t start_pos, const KVView& dst,
                                      const std::vector<int64_t>& alignment,
                                      int64_t target_start_pos) const {
  convert_impl<double>(*impl_, src, start_pos, dst, &alignment, target_start_pos, nullptr);
}

void LinearAdapter::convert_reference(const KVView& src, int64_t start_pos, const KVView& dst,
                                      const TargetTokens& tokens) const {
  convert_impl<double>(*impl_, src, start_pos, dst, nullptr, start_pos, &tokens);
}

void LinearAdapter::convert_reference(const KVView& src, int64_t start_pos, const KVView& dst,
                                      const std::vector<int64_t>& alignment,
                                      int64_t target_start_pos, const TargetTokens& tokens) const {
  convert_impl<double>(*impl_, src, start_pos, dst, &alignment, target_start_pos, &tokens);
}

}  // namespace kvbridge
