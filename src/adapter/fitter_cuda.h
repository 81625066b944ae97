// The CUDA side of AdapterFitter (fitter_cuda.cpp; fitter_cuda_stub.cpp in builds without CUDA).
// Internal: the public contract is AdapterFitter::add in adapter.h.
//
// Division of labour: the fitter builds its float64 features on the host with the one builder
// both paths share (un-rotation, layer slots, held-out split, probe sketch), and only the
// normal-equation products, which are almost all of add()'s work, run here, with cuBLAS, into
// float64 accumulators that stay on the device until fit() or next_pass() copies them back.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvbridge/kv_view.h"

namespace kvbridge::detail {

/// A view's elements copied into host memory: `view` has the source view's geometry, dtype and
/// strides and points into `bytes` (one span per plane, covering its viewed elements).
struct HostKVCopy {
  std::vector<std::vector<unsigned char>> bytes;
  KVView view;  // a CPU view
};

/// Copies a CUDA view to the host (synchronous copies on the legacy default stream, so work
/// enqueued on blocking streams before the call is waited for). Throws Unavailable when this
/// build has no CUDA path or no device is present, InvalidArgument when the device index does
/// not exist or a plane is not device (or managed) memory of the view's device.
HostKVCopy fitter_copy_to_host(const KVView& view, const char* what);

/// One product accumulated into a row-major float64 matrix C [m, n] (host accumulator `host`):
/// C += A^T B over rows [first, first + rows) of the call's features, A the columns
/// [a_col, a_col + m) of X, B the columns [b_col, b_col + n) of Y (b_from_y) or of X.
/// symmetric: m == n, B == A, and only the upper triangle of C is updated.
struct FitterProduct {
  bool symmetric = false;
  bool b_from_y = false;
  int64_t first = 0, rows = 0;
  int64_t a_col = 0, b_col = 0, m = 0, n = 0;
  double* host = nullptr;
};

/// A host accumulator the device mirrors: `elements` doubles at `host`.
struct FitterAccumulator {
  double* host = nullptr;
  int64_t elements = 0;
};

class FitterDevice;
struct FitterDeviceDeleter {
  void operator()(FitterDevice* device) const noexcept;
};
using FitterDevicePtr = std::unique_ptr<FitterDevice, FitterDeviceDeleter>;

/// Device staging for a call's features: X and Y rows are uploaded and multiplied in chunks of
/// at most this many bytes, so a long sample does not need its whole feature matrix on the device.
inline constexpr int64_t kFitterDeviceStagingBytes = int64_t{1} << 30;

/// Zeroed float64 accumulators on cuda:device, one per entry of `accumulators` (same sizes), for
/// one pass of a fitter. Throws Unavailable when the memory cannot be allocated or cuBLAS cannot
/// be loaded.
FitterDevicePtr fitter_device_create(int device, const std::vector<FitterAccumulator>& accumulators);

/// Makes sure the staging can take a call of `rows` rows of x [rows, ldx] and y [rows, ldy]
/// (allocating it if not), so that the only failures left to fitter_device_accumulate are CUDA
/// failures while it adds. Throws InvalidArgument for sizes beyond cuBLAS' int range, Unavailable
/// when the memory cannot be allocated.
void fitter_device_reserve(FitterDevice& device, int64_t ldx, int64_t ldy, int64_t rows);

/// Adds the products of one call: x [rows, ldx] and y [rows, ldy] are the call's host features
/// (row-major float64); every product's `host` must be one of the accumulators the device was
/// created with. Returns when the products are complete. Throws Unavailable on a CUDA or cuBLAS
/// failure, after which the accumulators may hold part of the call.
void fitter_device_accumulate(FitterDevice& device, const double* x, int64_t ldx, const double* y,
                              int64_t ldy, int64_t rows, const std::vector<FitterProduct>& products);

/// What the chunked product loop needs from the device (an interface so that tests can check the
/// loop's row chunks, offsets and transposes against a plain column-major reference on the CPU).
/// Column-major BLAS semantics, accumulating (alpha = beta = 1).
class ColumnMajorProducts {
 public:
  virtual ~ColumnMajorProducts() = default;
  /// count doubles from host `src` to device `dst`.
  virtual void upload(double* dst, const double* src, int64_t count) = 0;
  /// Lower triangle of C [n, n] += A A^T, A [n, k] (ld lda).
  virtual void syrk_lower(int n, int k, const double* a, int lda, double* c, int ldc) = 0;
  /// C [m, n] += A B^T, A [m, k] (ld lda), B [n, k] (ld ldb).
  virtual void gemm_nt(int m, int n, int k, const double* a, int lda, const double* b, int ldb,
                       double* c, int ldc) = 0;
};

/// The loop of fitter_device_accumulate: rows [c0, c0 + chunk) of x and y are uploaded to
/// staging_x [chunk, ldx] and staging_y [chunk, ldy], then every product that meets those rows
/// adds their part into its accumulator, at accumulators + offset_of(product.host).
void accumulate_in_chunks(ColumnMajorProducts& blas, const double* x, int64_t ldx, const double* y,
                          int64_t ldy, int64_t rows, const std::vector<FitterProduct>& products,
                          int64_t chunk, double* staging_x, double* staging_y,
                          double* accumulators,
                          const std::vector<std::pair<const double*, int64_t>>& offsets);

/// Copies every device accumulator over its host accumulator.
void fitter_device_download(const FitterDevice& device);

/// Device bytes the accumulators take (not counting the staging).
int64_t fitter_device_bytes(const FitterDevice& device) noexcept;

}  // namespace kvbridge::detail
