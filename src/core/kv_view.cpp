#include "kvbridge/kv_view.h"

#include <cstring>
#include <string>

#include "kvbridge/error.h"

namespace kvbridge {
namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

const char* device_name(const Device& d) { return d.type == DeviceType::kCPU ? "cpu" : "cuda"; }

void check_hf_tensor(const TensorView& t, const std::string& name, const TensorView& first) {
  KVB_CHECK(t.shape.size() == 4, name << ": expected 4 dims [batch, kv_heads, tokens, head_dim], got "
                                      << t.shape.size() << " dims " << shape_str(t.shape));
  KVB_CHECK(t.strides.size() == t.shape.size(),
            name << ": " << t.strides.size() << " strides for " << t.shape.size() << " dims");
  KVB_CHECK(t.shape[0] == 1, name << ": batch must be 1, got shape " << shape_str(t.shape));
  KVB_CHECK(t.shape == first.shape, name << ": shape " << shape_str(t.shape)
                                         << " differs from kv[0][0] " << shape_str(first.shape));
  KVB_CHECK(t.dtype == first.dtype, name << ": dtype " << dtype_name(t.dtype)
                                         << " differs from kv[0][0] " << dtype_name(first.dtype));
  KVB_CHECK(t.device == first.device, name << ": device " << device_name(t.device) << ":"
                                           << t.device.index << " differs from kv[0][0]");
  for (size_t i = 0; i < t.strides.size(); ++i) {
    KVB_CHECK(t.strides[i] >= 0, name << ": negative stride " << t.strides[i]);
  }
  KVB_CHECK(t.data != nullptr || t.shape[2] == 0, name << ": null data pointer");
}

}  // namespace

KVView KVView::contiguous(void* data, DType dtype, Device device, int64_t layers, int64_t tokens,
                          int64_t kv_heads, int64_t head_dim) {
  KVB_CHECK(layers > 0 && tokens >= 0 && kv_heads > 0 && head_dim > 0,
            "KVView::contiguous: bad geometry layers=" << layers << " tokens=" << tokens
                                                       << " kv_heads=" << kv_heads
                                                       << " head_dim=" << head_dim);
  KVB_CHECK(data != nullptr || tokens == 0, "KVView::contiguous: null data");
  const int64_t plane_elems = tokens * kv_heads * head_dim;
  const size_t es = dtype_size(dtype);
  std::vector<KVPlane> planes(2 * layers);
  for (int64_t p = 0; p < 2 * layers; ++p) {
    planes[p].data = static_cast<char*>(data) + p * plane_elems * static_cast<int64_t>(es);
    planes[p].token_stride = kv_heads * head_dim;
    planes[p].head_stride = head_dim;
    planes[p].dim_stride = 1;
  }
  return from_planes(std::move(planes), dtype, device, tokens, kv_heads, head_dim);
}

KVView KVView::from_hf_layers(const std::vector<TensorView>& keys,
                              const std::vector<TensorView>& values) {
  KVB_CHECK(!keys.empty(), "kv: expected at least one layer, got none");
  KVB_CHECK(keys.size() == values.size(),
            "kv: " << keys.size() << " key tensors but " << values.size() << " value tensors");
  const TensorView& first = keys[0];
  std::vector<KVPlane> planes;
  planes.reserve(2 * keys.size());
  for (size_t l = 0; l < keys.size(); ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      const TensorView& t = kind == 0 ? keys[l] : values[l];
      check_hf_tensor(t, "kv[" + std::to_string(l) + "][" + std::to_string(kind) + "]", first);
      planes.push_back(KVPlane{t.data, t.strides[2], t.strides[1], t.strides[3]});
    }
  }
  return from_planes(std::move(planes), first.dtype, first.device, first.shape[2], first.shape[1],
                     first.shape[3]);
}

KVView KVView::from_planes(std::vector<KVPlane> planes, DType dtype, Device device, int64_t tokens,
                           int64_t kv_heads, int64_t head_dim) {
  KVB_CHECK(!planes.empty() && planes.size() % 2 == 0,
            "KVView::from_planes: need 2 planes per layer, got " << planes.size());
  KVView v;
  v.planes_ = std::move(planes);
  v.dtype_ = dtype;
  v.device_ = device;
  v.tokens_ = tokens;
  v.kv_heads_ = kv_heads;
  v.head_dim_ = head_dim;
  return v;
}

int64_t KVView::bytes() const noexcept {
  return static_cast<int64_t>(planes_.size()) * tokens_ * kv_heads_ * head_dim_ *
         static_cast<int64_t>(dtype_size(dtype_));
}

KVView KVView::slice_tokens(int64_t begin, int64_t count) const {
  KVB_CHECK(begin >= 0 && count >= 0 && begin + count <= tokens_,
            "slice_tokens: [" << begin << ", " << begin + count << ") is outside [0, " << tokens_
                              << ")");
  KVView v = *this;
  const int64_t es = static_cast<int64_t>(dtype_size(dtype_));
  for (KVPlane& p : v.planes_) p.data = static_cast<char*>(p.data) + begin * p.token_stride * es;
  v.tokens_ = count;
  return v;
}

void KVView::check_matches(const ModelSpec& spec, const char* what) const {
  KVB_CHECK(num_layers() == spec.num_layers,
            what << ": " << num_layers() << " layers, but spec '" << spec.name << "' has "
                 << spec.num_layers);
  KVB_CHECK(kv_heads_ == spec.num_kv_heads, what << ": " << kv_heads_ << " kv_heads, but spec '"
                                                 << spec.name << "' has " << spec.num_kv_heads);
  KVB_CHECK(head_dim_ == spec.head_dim, what << ": head_dim " << head_dim_ << ", but spec '"
                                             << spec.name << "' has " << spec.head_dim);
  KVB_CHECK(dtype_ == spec.dtype, what << ": dtype " << dtype_name(dtype_) << ", but spec '"
                                       << spec.name << "' has " << dtype_name(spec.dtype));
}

void copy_kv(const KVView& src, const KVView& dst) {
  KVB_CHECK(src.num_layers() == dst.num_layers() && src.tokens() == dst.tokens() &&
                src.kv_heads() == dst.kv_heads() && src.head_dim() == dst.head_dim(),
            "copy_kv: geometry differs (layers " << src.num_layers() << "/" << dst.num_layers()
                                                 << ", tokens " << src.tokens() << "/"
                                                 << dst.tokens() << ")");
  KVB_CHECK(src.dtype() == dst.dtype(), "copy_kv: dtype " << dtype_name(src.dtype()) << " vs "
                                                          << dtype_name(dst.dtype()));
  KVB_CHECK(src.device().type == DeviceType::kCPU && dst.device().type == DeviceType::kCPU,
            "copy_kv: both views must be on the CPU");
  const int64_t T = src.tokens(), H = src.kv_heads(), D = src.head_dim();
  const int64_t es = static_cast<int64_t>(dtype_size(src.dtype()));
  if (T == 0) return;
  for (int64_t layer = 0; layer < src.num_layers(); ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const KVPlane& s = src.plane(layer, static_cast<KVView::Kind>(kind));
      const KVPlane& d = dst.plane(layer, static_cast<KVView::Kind>(kind));
      const char* sp = static_cast<const char*>(s.data);
      char* dp = static_cast<char*>(d.data);
      const bool dims_dense = (s.dim_stride == 1 && d.dim_stride == 1) || D == 1;
      const bool heads_dense = dims_dense && ((s.head_stride == D && d.head_stride == D) || H == 1);
      const bool tokens_dense =
          heads_dense && ((s.token_stride == H * D && d.token_stride == H * D) || T == 1);
      if (tokens_dense) {
        std::memcpy(dp, sp, static_cast<size_t>(T * H * D * es));
      } else if (heads_dense) {
        for (int64_t t = 0; t < T; ++t) {
          std::memcpy(dp + t * d.token_stride * es, sp + t * s.token_stride * es,
                      static_cast<size_t>(H * D * es));
        }
      } else if (dims_dense) {
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t h = 0; h < H; ++h) {
            std::memcpy(dp + (t * d.token_stride + h * d.head_stride) * es,
                        sp + (t * s.token_stride + h * s.head_stride) * es,
                        static_cast<size_t>(D * es));
          }
        }
      } else {
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t h = 0; h < H; ++h) {
            for (int64_t i = 0; i < D; ++i) {
              std::memcpy(dp + (t * d.token_stride + h * d.head_stride + i * d.dim_stride) * es,
                          sp + (t * s.token_stride + h * s.head_stride + i * s.dim_stride) * es,
                          static_cast<size_t>(es));
            }
          }
        }
      }
    }
  }
}

}  // namespace kvbridge
