#include <Eigen/Dense>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"
#include "src/adapter/adapter_impl.h"
#include "src/adapter/convert_cuda.h"
#include "src/adapter/gemm.h"
#include "src/adapter/numeric.h"

namespace kvbridge {

namespace {
template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Tokens the float32 path converts together. Its working memory (the un-rotated features of
// every source layer the adapter uses, and one target plane) is held for one block at a time,
// so a convert needs at most about its output's size on top of the output: blocks are as long
// as that allows, and at least kMinBlockTokens (below that the GEMMs lose speed), unless the
// input is shorter. The float64 reference converts in one block (it is the check of blocking).
constexpr int64_t kMinBlockTokens = 64;

int64_t block_tokens(const LinearAdapter::Impl& a, int64_t tokens, DType dst_dtype) {
  int64_t used = 0;
  std::vector<char> seen(static_cast<size_t>(a.source.num_layers), 0);
  for (const auto& layers : a.layers)
    for (int64_t l : layers)
      if (!seen[static_cast<size_t>(l)]++) ++used;
  const int64_t per_token_work =
      static_cast<int64_t>(sizeof(float)) * (used * 2 * a.source_width() + a.target_width());
  const int64_t per_token_output = a.target.num_layers * 2 * a.target_width() *
                                   static_cast<int64_t>(dtype_size(dst_dtype));
  // 90%: the GEMM's packing buffers and the allocator take a few percent on top.
  const int64_t fit = tokens * per_token_output * 9 / (10 * std::max<int64_t>(per_token_work, 1));
  return std::min(tokens, std::max(kMinBlockTokens, fit));
}

// The conversion in arithmetic type T, token block by token block: un-rotate each used source
// layer of the block once, then per target layer sum the GEMMs of its source layers, add the
// bias, rotate and store.
template <typename T>
void convert_impl(const LinearAdapter::Impl& a, const KVView& src, int64_t start_pos,
                  const KVView& dst, const std::vector<int64_t>* alignment,
                  int64_t target_start_pos) {
  check_pair(a.source, a.target, src, dst, "source_kv", "target_kv", alignment == nullptr);
  detail::check_convert_positions(src, start_pos, dst, alignment, target_start_pos);
  const int64_t T_ = dst.tokens();
  if (T_ == 0) return;
  const int64_t sw = a.source_width(), tw = a.target_width();
  const bool rope = a.report.rope_aware;
  constexpr bool kFloat = std::is_same_v<T, float>;
  const int64_t B = kFloat ? block_tokens(a, T_, dst.dtype()) : T_;

  std::vector<RowMat<T>> features(static_cast<size_t>(a.source.num_layers));
  std::vector<char> used(static_cast<size_t>(a.source.num_layers), 0);
  for (const auto& layers : a.layers)
    for (int64_t l : layers) used[static_cast<size_t>(l)] = 1;
  std::vector<float> buf(kFloat ? 0 : static_cast<size_t>(B * 2 * sw));
  RowMat<T> y(B, tw);
  RowMat<float> out(kFloat ? 0 : B, kFloat ? 0 : tw);

  for (int64_t b0 = 0; b0 < T_; b0 += B) {
    const int64_t n = std::min(B, T_ - b0);
    // Source rows of the block: tokens b0.. (positions start_pos + b0 + t), or with an alignment
    // tokens alignment[b0 + t] of the whole source (positions start_pos + alignment[b0 + t]).
    const int64_t* rows = alignment ? alignment->data() + b0 : nullptr;
    const int64_t source_pos = rows ? start_pos : start_pos + b0;
    const int64_t target_pos = target_start_pos + b0;
    const KVView s = rows ? src : src.slice_tokens(b0, n);
    const KVView d = dst.slice_tokens(b0, n);
    for (int64_t l = 0; l < a.source.num_layers; ++l) {
      if (!used[static_cast<size_t>(l)]) continue;
      RowMat<T>& x = features[static_cast<size_t>(l)];
      if (x.rows() != n) x.resize(n, 2 * sw);
      // float: gather straight into the feature matrix; double: through a float buffer.
      float* gathered = buf.data();
      if constexpr (kFloat) gathered = x.data();
      for (int kind = 0; kind < 2; ++kind)
        detail::load_plane(s.plane(l, static_cast<KVView::Kind>(kind)), s.dtype(), n,
                           a.source.num_kv_heads, a.source.head_dim, gathered + kind * sw,
                           2 * sw, rows);
      if constexpr (!kFloat) x = Eigen::Map<RowMat<float>>(buf.data(), n, 2 * sw).cast<T>();
      if (rope)
        detail::apply_rope(a.source, a.source_inv_freq, source_pos, /*inverse=*/true, n,
                           a.source.num_kv_heads, x.data(), 2 * sw, rows);
    }
    auto yb = y.topRows(n);
    for (int64_t j = 0; j < a.target.num_layers; ++j) {
      const auto& layers = a.layers[static_cast<size_t>(j)];
      for (int kind = 0; kind < 2; ++kind) {
        const auto& w = a.weights[static_cast<size_t>(j)][static_cast<size_t>(kind)];
        const auto& b = a.bias[static_cast<size_t>(j)][static_cast<size_t>(kind)];
        yb.rowwise() = Eigen::Map<const Eigen::Matrix<float, 1, Eigen::Dynamic>>(b.data(), tw)
                           .template cast<T>();
        for (size_t si = 0; si < layers.size(); ++si) {
          const Eigen::Map<const RowMat<float>> ws(
              w.data() + static_cast<int64_t>(si) * 2 * sw * tw, 2 * sw, tw);
          const RowMat<T>& x = features[static_cast<size_t>(layers[si])];
          if constexpr (kFloat) {
            detail::gemm_f32(n, tw, 2 * sw, x.data(), 2 * sw, ws.data(), tw, y.data(), tw,
                             /*accumulate=*/true);
          } else {
            yb.noalias() += x * ws.template cast<T>();
          }
        }
        if (rope && kind == 0)
          detail::apply_rope(a.target, a.target_inv_freq, target_pos, /*inverse=*/false, n,
                             a.target.num_kv_heads, y.data(), tw);
        const float* plane = nullptr;
        if constexpr (kFloat) {
          plane = y.data();
        } else {
          out.topRows(n) = yb.template cast<float>();
          plane = out.data();
        }
        detail::store_plane(plane, tw, d.dtype(), n, a.target.num_kv_heads, a.target.head_dim,
                            d.plane(j, static_cast<KVView::Kind>(kind)));
      }
    }
  }
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
void check_convert_positions(const KVView& src, int64_t start_pos, const KVView& dst,
                             const std::vector<int64_t>* alignment, int64_t target_start_pos) {
  detail::check_positions(start_pos, src.tokens());
  if (!alignment) return;
  detail::check_positions(target_start_pos, dst.tokens());
  check_alignment(*alignment, src.tokens(), dst.tokens(), /*allow_missing=*/false);
}
}  // namespace detail

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

void LinearAdapter::convert(const KVView& src, int64_t start_pos, const KVView& dst) const {
  convert(src, start_pos, dst, nullptr);
}

void LinearAdapter::convert(const KVView& src, int64_t start_pos, const KVView& dst,
                            void* cuda_stream) const {
  convert_dispatch(src, start_pos, dst, nullptr, start_pos, cuda_stream);
}

void LinearAdapter::convert(const KVView& src, int64_t start_pos, const KVView& dst,
                            const std::vector<int64_t>& alignment, int64_t target_start_pos,
                            void* cuda_stream) const {
  convert_dispatch(src, start_pos, dst, &alignment, target_start_pos, cuda_stream);
}

void LinearAdapter::convert_dispatch(const KVView& src, int64_t start_pos, const KVView& dst,
                                     const std::vector<int64_t>* alignment,
                                     int64_t target_start_pos, void* cuda_stream) const {
  KVB_CHECK(src.device() == dst.device(),
            "source_kv and target_kv must be on one device, got "
                << (src.device().type == DeviceType::kCUDA ? "cuda:" : "cpu:") << src.device().index
                << " and " << (dst.device().type == DeviceType::kCUDA ? "cuda:" : "cpu:")
                << dst.device().index);
  if (src.device().type == DeviceType::kCUDA) {
    detail::convert_cuda(*impl_, src, start_pos, dst, cuda_stream, alignment, target_start_pos);
    return;
  }
  convert_impl<float>(*impl_, src, start_pos, dst, alignment, target_start_pos);
}

void LinearAdapter::convert_reference(const KVView& src, int64_t start_pos,
                                      const KVView& dst) const {
  convert_impl<double>(*impl_, src, start_pos, dst, nullptr, start_pos);
}

void LinearAdapter::convert_reference(const KVView& src, int64_t start_pos, const KVView& dst,
                                      const std::vector<int64_t>& alignment,
                                      int64_t target_start_pos) const {
  convert_impl<double>(*impl_, src, start_pos, dst, &alignment, target_start_pos);
}

}  // namespace kvbridge
