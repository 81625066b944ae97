// The fitter's device products: float64 cuBLAS SYRK / GEMM into device-resident accumulators.
//
// Accumulators are row-major on the host; cuBLAS is column-major, so every product is issued on
// the transposed problem: the row-major C [m, n] += A^T B is the column-major C^T [n, m] +=
// B^T' A' with B' [n, k] (ld ldb) and A' [m, k] (ld lda) the same bytes read column-major, i.e.
// dgemm(N, T, n, m, k, B, A); the row-major upper triangle of A^T A is the column-major lower
// triangle, i.e. dsyrk(lower, N, m, k, A).
#include "src/adapter/fitter_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <functional>

#include "kernels/cuda_check.cuh"
#include "kvbridge/dtype.h"
#include "kvbridge/error.h"
#include "kvbridge/version.h"
#include "src/adapter/cublas.h"
#include "src/adapter/cuda_device.h"

namespace kvbridge::detail {
namespace {

using cuda::align_up;
using cuda::device_alloc;
using cuda::DeviceGuard;
using cuda::DevicePtr;
using cuda::QuietDeviceGuard;
constexpr int64_t kAlignDoubles = cuda::kOperandAlignBytes / 8;

void check_int(int64_t v, const char* what) {
  KVB_CHECK(v <= INT_MAX, "AdapterFitter (CUDA): " << what << " " << v
                                                   << " exceeds cuBLAS' int range");
}

// The device's products: cuBLAS float64 on one stream; uploads stream-ordered after the products
// that read the staging before them.
class CublasProducts final : public ColumnMajorProducts {
 public:
  CublasProducts(const cuda::Cublas& blas, cuda::CublasHandle handle, cudaStream_t stream)
      : blas_(blas), handle_(handle), stream_(stream) {}
  void upload(double* dst, const double* src, int64_t count) override {
    // From pageable memory: staged before the call returns.
    KVB_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(count) * 8,
                                   cudaMemcpyHostToDevice, stream_));
  }
  void syrk_lower(int n, int k, const double* a, int lda, double* c, int ldc) override {
    KVB_CUDA_CHECK(blas_.dsyrk(handle_, cuda::kCublasFillLower, cuda::kCublasOpN, n, k, &one_, a,
                               lda, &one_, c, ldc));
  }
  void gemm_nt(int m, int n, int k, const double* a, int lda, const double* b, int ldb, double* c,
               int ldc) override {
    KVB_CUDA_CHECK(blas_.dgemm(handle_, cuda::kCublasOpN, cuda::kCublasOpT, m, n, k, &one_, a,
                               lda, b, ldb, &one_, c, ldc));
  }

 private:
  const cuda::Cublas& blas_;
  cuda::CublasHandle handle_;
  cudaStream_t stream_;
  const double one_ = 1;
};

}  // namespace

HostKVCopy fitter_copy_to_host(const KVView& view, const char* what) {
  const int device = view.device().index;
  const int devices = cuda_device_count();
  KVB_CHECK_AS(Unavailable, devices > 0,
               "AdapterFitter::add: " << what << " is on cuda:" << device
                                      << ", but no CUDA device is available (no driver or no GPU)");
  KVB_CHECK(device >= 0 && device < devices,
            "AdapterFitter::add: " << what << " is on cuda:" << device << ", which does not exist ("
                                   << devices << " devices)");
  DeviceGuard current(device);
  const int64_t es = static_cast<int64_t>(dtype_size(view.dtype()));
  const int64_t counts[3] = {view.tokens(), view.kv_heads(), view.head_dim()};
  // Every plane is checked before anything is copied, so a bad view costs no transfer.
  cuda::check_device_pointers(view, device, what);
  HostKVCopy out;
  out.bytes.reserve(static_cast<size_t>(2 * view.num_layers()));
  std::vector<KVPlane> planes;
  for (int64_t l = 0; l < view.num_layers(); ++l)
    for (int kind = 0; kind < 2; ++kind) {
      const KVPlane& p = view.plane(l, static_cast<KVView::Kind>(kind));
      // The plane's viewed elements span [lo, hi] elements around its base pointer.
      const int64_t strides[3] = {p.token_stride, p.head_stride, p.dim_stride};
      int64_t lo = 0, hi = 0;
      for (int axis = 0; axis < 3; ++axis) {
        const int64_t reach = std::max<int64_t>(counts[axis] - 1, 0) * strides[axis];
        (reach < 0 ? lo : hi) += reach;
      }
      const int64_t bytes = (hi - lo + 1) * es;
      out.bytes.emplace_back(static_cast<size_t>(bytes));
      unsigned char* buffer = out.bytes.back().data();
      KVB_CUDA_CHECK(cudaMemcpy(buffer, static_cast<const unsigned char*>(p.data) + lo * es,
                                static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
      planes.push_back(KVPlane{buffer - lo * es, p.token_stride, p.head_stride, p.dim_stride});
    }
  out.view = KVView::from_planes(std::move(planes), view.dtype(), Device{}, view.tokens(),
                                 view.kv_heads(), view.head_dim());
  return out;
}

class FitterDevice {
 public:
  int device = 0;
  cudaStream_t stream = nullptr;
  cuda::CublasHandle handle = nullptr;
  DevicePtr accumulators;  // every accumulator in one allocation
  int64_t accumulator_elements = 0;
  std::vector<FitterAccumulator> host;
  std::vector<int64_t> offsets;             // [accumulator] -> element offset
  std::vector<std::pair<const double*, int64_t>> offset;  // host accumulator -> offset, sorted
  DevicePtr staging;                        // a chunk of X rows, then of Y rows
  int64_t staging_bytes = 0;

  ~FitterDevice() {
    QuietDeviceGuard current(device);
    if (stream) (void)cudaStreamSynchronize(stream);
    if (handle)
      if (const cuda::Cublas* b = cuda::cublas_if_loaded()) (void)b->destroy(handle);
    if (stream) (void)cudaStreamDestroy(stream);
    accumulators.reset();
    staging.reset();
  }
};

void accumulate_in_chunks(ColumnMajorProducts& blas, const double* x, int64_t ldx, const double* y,
                          int64_t ldy, int64_t rows, const std::vector<FitterProduct>& products,
                          int64_t chunk, double* staging_x, double* staging_y,
                          double* accumulators,
                          const std::vector<std::pair<const double*, int64_t>>& offsets) {
  const auto by_address = [](const std::pair<const double*, int64_t>& e, const double* host) {
    return std::less<const double*>()(e.first, host);
  };
  for (const FitterProduct& p : products) {
    check_int(p.m, "product rows");
    check_int(p.n, "product columns");
  }
  const auto offset_of = [&](const double* host) {
    const auto it = std::lower_bound(offsets.begin(), offsets.end(), host, by_address);
    KVB_CHECK(it != offsets.end() && it->first == host,
              "AdapterFitter (CUDA): a product names no accumulator");
    return it->second;
  };
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
    const int64_t nc = std::min(chunk, rows - c0);
    blas.upload(staging_x, x + c0 * ldx, nc * ldx);
    if (ldy > 0) blas.upload(staging_y, y + c0 * ldy, nc * ldy);
    for (const FitterProduct& p : products) {
      const int64_t r0 = std::max(p.first, c0), r1 = std::min(p.first + p.rows, c0 + nc);
      if (r0 >= r1) continue;
      double* c = accumulators + offset_of(p.host);
      const int k = static_cast<int>(r1 - r0);
      // Row-major [rows, ld] blocks read column-major are [ld, rows]: A' = A^T, B' = B^T.
      const double* a = staging_x + (r0 - c0) * ldx + p.a_col;
      if (p.symmetric) {
        blas.syrk_lower(static_cast<int>(p.m), k, a, static_cast<int>(ldx), c,
                        static_cast<int>(p.m));
      } else {
        const int64_t ldb = p.b_from_y ? ldy : ldx;
        const double* b = (p.b_from_y ? staging_y : staging_x) + (r0 - c0) * ldb + p.b_col;
        blas.gemm_nt(static_cast<int>(p.n), static_cast<int>(p.m), k, b, static_cast<int>(ldb),
                     a, static_cast<int>(ldx), c, static_cast<int>(p.n));
      }
    }
  }
}

void FitterDeviceDeleter::operator()(FitterDevice* device) const noexcept { delete device; }

FitterDevicePtr fitter_device_create(int device,
                                     const std::vector<FitterAccumulator>& accumulators) {
  const cuda::Cublas& blas = cuda::cublas();
  DeviceGuard current(device);
  FitterDevicePtr d(new FitterDevice);
  d->device = device;
  d->host = accumulators;
  for (const FitterAccumulator& a : accumulators) {
    d->offsets.push_back(d->accumulator_elements);
    d->offset.emplace_back(a.host, d->accumulator_elements);
    d->accumulator_elements += align_up(a.elements, kAlignDoubles);
  }
  std::sort(d->offset.begin(), d->offset.end(), [](const auto& a, const auto& b) {
    return std::less<const double*>()(a.first, b.first);
  });
  KVB_CUDA_CHECK(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking));
  KVB_CUDA_CHECK(blas.create(&d->handle));
  KVB_CUDA_CHECK(blas.set_stream(d->handle, d->stream));
  d->accumulators = device_alloc(d->accumulator_elements * 8);
  KVB_CUDA_CHECK(cudaMemsetAsync(d->accumulators.get(), 0,
                                 static_cast<size_t>(d->accumulator_elements * 8), d->stream));
  KVB_CUDA_CHECK(cudaStreamSynchronize(d->stream));
  return d;
}

namespace {
// Rows per chunk: as many as the staging holds, at least one.
int64_t chunk_rows(int64_t ldx, int64_t ldy, int64_t rows) {
  return std::max<int64_t>(
      1, std::min(rows, kFitterDeviceStagingBytes / (8 * std::max<int64_t>(ldx + ldy, 1))));
}
int64_t staging_x_elements(int64_t chunk, int64_t ldx) {
  return align_up(chunk * ldx, kAlignDoubles);
}
}  // namespace

void fitter_device_reserve(FitterDevice& d, int64_t ldx, int64_t ldy, int64_t rows) {
  check_int(ldx, "feature row length");
  check_int(ldy, "output row length");
  const int64_t chunk = chunk_rows(ldx, ldy, rows);
  check_int(chunk, "rows per chunk");
  const int64_t need = 8 * (staging_x_elements(chunk, ldx) + chunk * ldy);
  if (d.staging_bytes >= need) return;
  DeviceGuard current(d.device);
  d.staging.reset();  // every earlier use completed: accumulate waits for its stream
  d.staging_bytes = 0;
  d.staging = device_alloc(need);
  d.staging_bytes = need;
}

void fitter_device_accumulate(FitterDevice& d, const double* x, int64_t ldx, const double* y,
                              int64_t ldy, int64_t rows, const std::vector<FitterProduct>& products) {
  if (rows == 0 || products.empty()) return;
  fitter_device_reserve(d, ldx, ldy, rows);
  const cuda::Cublas& blas = cuda::cublas();
  DeviceGuard current(d.device);
  // Rows go up in chunks that fit the staging; every product runs once per chunk its rows meet.
  const int64_t chunk = chunk_rows(ldx, ldy, rows);
  double* dx = static_cast<double*>(d.staging.get());
  CublasProducts device_blas(blas, d.handle, d.stream);
  accumulate_in_chunks(device_blas, x, ldx, y, ldy, rows, products, chunk, dx,
                       dx + staging_x_elements(chunk, ldx),
                       static_cast<double*>(d.accumulators.get()), d.offset);
  KVB_CUDA_CHECK(cudaStreamSynchronize(d.stream));
}

void fitter_device_download(const FitterDevice& d) {
  DeviceGuard current(d.device);
  KVB_CUDA_CHECK(cudaStreamSynchronize(d.stream));
  const double* acc = static_cast<const double*>(d.accumulators.get());
  for (size_t i = 0; i < d.host.size(); ++i)
    KVB_CUDA_CHECK(cudaMemcpy(d.host[i].host, acc + d.offsets[i],
                              static_cast<size_t>(d.host[i].elements * 8),
                              cudaMemcpyDeviceToHost));
}

int64_t fitter_device_bytes(const FitterDevice& d) noexcept { return d.accumulator_elements * 8; }

}  // namespace kvbridge::detail
