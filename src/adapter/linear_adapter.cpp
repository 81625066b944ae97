#include <Eigen/Dense>

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

// The conversion in arithmetic type T: un-rotate each used source layer once, then per target
// layer sum the GEMMs of its source layers, add the bias, rotate and store.
template <typename T>
void convert_impl(const LinearAdapter::Impl& a, const KVView& src, int64_t start_pos,
                  const KVView& dst) {
  check_pair(a.source, a.target, src, dst, "source_kv", "target_kv");
  const int64_t T_ = src.tokens();
  detail::check_positions(start_pos, T_);
  if (T_ == 0) return;
  const int64_t sw = a.source_width(), tw = a.target_width();
  const bool rope = a.report.rope_aware;

  std::vector<RowMat<T>> features(static_cast<size_t>(a.source.num_layers));
  std::vector<float> buf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(T_ * 2 * sw));
  for (const auto& layers : a.layers)
    for (int64_t l : layers) {
      RowMat<T>& x = features[static_cast<size_t>(l)];
      if (x.size()) continue;
      // float: gather straight into the feature matrix; double: through a float buffer.
      float* gathered = buf.data();
      if constexpr (std::is_same_v<T, float>) {
        x.resize(T_, 2 * sw);
        gathered = x.data();
      }
      for (int kind = 0; kind < 2; ++kind)
        detail::load_plane(src.plane(l, static_cast<KVView::Kind>(kind)), src.dtype(), T_,
                           a.source.num_kv_heads, a.source.head_dim, gathered + kind * sw,
                           2 * sw);
      if constexpr (!std::is_same_v<T, float>)
        x = Eigen::Map<RowMat<float>>(buf.data(), T_, 2 * sw).cast<T>();
      if (rope)
        detail::apply_rope(a.source, a.source_inv_freq, start_pos, /*inverse=*/true, T_,
                           a.source.num_kv_heads, x.data(), 2 * sw);
    }

  RowMat<T> y(T_, tw);
  RowMat<float> out(T_, tw);
  for (int64_t j = 0; j < a.target.num_layers; ++j) {
    const auto& layers = a.layers[static_cast<size_t>(j)];
    for (int kind = 0; kind < 2; ++kind) {
      const auto& w = a.weights[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      const auto& b = a.bias[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      y.rowwise() = Eigen::Map<const Eigen::Matrix<float, 1, Eigen::Dynamic>>(b.data(), tw)
                        .template cast<T>();
      for (size_t s = 0; s < layers.size(); ++s) {
        const Eigen::Map<const RowMat<float>> ws(w.data() + static_cast<int64_t>(s) * 2 * sw * tw,
                                                 2 * sw, tw);
        if constexpr (std::is_same_v<T, float>) {
          const RowMat<float>& x = features[static_cast<size_t>(layers[s])];
          detail::gemm_f32(T_, tw, 2 * sw, x.data(), 2 * sw, ws.data(), tw, y.data(), tw,
                           /*accumulate=*/true);
        } else {
          y.noalias() += features[static_cast<size_t>(layers[s])] * ws.template cast<T>();
        }
      }
      if (rope && kind == 0)
        detail::apply_rope(a.target, a.target_inv_freq, start_pos, /*inverse=*/false, T_,
                           a.target.num_kv_heads, y.data(), tw);
      out = y.template cast<float>();
      detail::store_plane(out.data(), tw, dst.dtype(), T_, a.target.num_kv_heads,
                          a.target.head_dim, dst.plane(j, static_cast<KVView::Kind>(kind)));
    }
  }
}
}  // namespace

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
  KVB_CHECK(src.device() == dst.device(),
            "source_kv and target_kv must be on one device, got "
                << (src.device().type == DeviceType::kCUDA ? "cuda:" : "cpu:") << src.device().index
                << " and " << (dst.device().type == DeviceType::kCUDA ? "cuda:" : "cpu:")
                << dst.device().index);
  if (src.device().type == DeviceType::kCUDA) {
    detail::convert_cuda(*impl_, src, start_pos, dst, cuda_stream);
    return;
  }
  convert_impl<float>(*impl_, src, start_pos, dst);
}

void LinearAdapter::convert_reference(const KVView& src, int64_t start_pos,
                                      const KVView& dst) const {
  convert_impl<double>(*impl_, src, start_pos, dst);
}

}  // namespace kvbridge
