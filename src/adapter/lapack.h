// float64 BLAS-3 and LAPACK calls on row-major matrices, for the fitter's normal equations.
//
// Backed by the system BLAS/LAPACK found at configure time (OpenBLAS on Debian: blocked, AVX-512
// kernels, OpenMP threads). Called from inside an OpenMP parallel region, the OpenMP build of
// OpenBLAS runs single-threaded, so callers parallelise either across independent calls or
// inside one large call, never both. OpenBLAS picks its kernels when it loads: where it takes the
// CPU for a Prescott (Debian's 0.3.21 does so for CPUs newer than itself) these run several times
// slower, so python/kvbridge/_openblas.py sets OPENBLAS_CORETYPE before the library loads.
#pragma once

#include <cstdint>
#include <vector>

namespace kvbridge::detail::lapack {

/// C [m, n] = alpha * op(A) * op(B) + beta * C, all row-major with leading dimensions (row
/// strides) lda, ldb, ldc; op(A) is [m, k] (A^T when trans_a), op(B) [k, n].
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc);

/// Upper triangle of the row-major C [n, n] = alpha * op(A) * op(A)^T + beta * C: op(A) = A^T
/// with A [k, n] when trans, else A [n, k]; A row-major with row stride lda. The strict lower
/// triangle of C is not touched.
void syrk_upper(bool trans, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
                double beta, double* c, int64_t ldc);

/// Eigendecomposition of the symmetric [n, n] matrix in `a` (row-major, contiguous; only the upper
/// triangle is read) by divide and conquer (LAPACK dsyevd). On return `a` holds the eigenvectors
/// as rows (row i belongs to eigenvalue i) and `w` the eigenvalues, ascending. Throws
/// InvalidArgument for n beyond LAPACK's 32-bit workspace sizes, Unavailable if it fails to
/// converge.
void syevd(int64_t n, double* a, std::vector<double>& w);

/// Cholesky factor of the symmetric positive definite [n, n] matrix in `a` (row-major, row stride
/// lda; only the lower triangle is read): on return the lower triangle holds L with A = L L^T
/// (LAPACK dpotrf), the strict upper triangle is untouched. Returns false when A is not
/// numerically positive definite.
bool potrf_lower(int64_t n, double* a, int64_t lda);

/// Solves op(L) X = B in place for X [n, m] (B row-major with row stride ldb), L the row-major
/// lower-triangular [n, n] matrix at `l` (row stride ldl; its strict upper triangle is not read),
/// op(L) = L^T when trans (LAPACK dtrsm).
void trsm_lower(bool trans, int64_t n, int64_t m, const double* l, int64_t ldl, double* b,
                int64_t ldb);

}  // namespace kvbridge::detail::lapack
