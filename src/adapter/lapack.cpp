#include "src/adapter/lapack.h"

#include <limits>

#include "kvbridge/error.h"

// Fortran BLAS / LAPACK entry points (LP64: 32-bit INTEGER), column-major. A row-major matrix is
// the column-major matrix of its transpose, which the wrappers below account for.
extern "C" {
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc);
void dsyrk_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* beta, double* c, const int* ldc);
void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda,
             double* w, double* work, const int* lwork, int* iwork, const int* liwork, int* info);
void dpotrf_(const char* uplo, const int* n, double* a, const int* lda, int* info);
void dtrsm_(const char* side, const char* uplo, const char* transa, const char* diag, const int* m,
            const int* n, const double* alpha, const double* a, const int* lda, double* b,
            const int* ldb);
}

namespace kvbridge::detail::lapack {
namespace {

int to_int(int64_t v, const char* what) {
  KVB_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(),
            what << " " << v << " is beyond the 32-bit sizes of this BLAS/LAPACK");
  return static_cast<int>(v);
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
  const int M = to_int(n, "gemm size"), N = to_int(m, "gemm size"), K = to_int(k, "gemm size");
  const int la = to_int(lda, "leading dimension"), lb = to_int(ldb, "leading dimension"),
            lc = to_int(ldc, "leading dimension");
  const char tb = trans_b ? 'T' : 'N', ta = trans_a ? 'T' : 'N';
  dgemm_(&tb, &ta, &M, &N, &K, &alpha, b, &lb, a, &la, &beta, c, &lc);
}

void syrk_upper(bool trans, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
                double beta, double* c, int64_t ldc) {
  if (n == 0) return;
  // Row-major A is the column-major A^T, and the row-major upper triangle the column-major lower
  // one: A^T A (A [k, n]) is column-major "N", A A^T (A [n, k]) column-major "T".
  const int N = to_int(n, "syrk size"), K = to_int(k, "syrk size");
  const int la = to_int(lda, "leading dimension"), lc = to_int(ldc, "leading dimension");
  dsyrk_("L", trans ? "N" : "T", &N, &K, &alpha, a, &la, &beta, c, &lc);
}

void syevd(int64_t n, double* a, std::vector<double>& w) {
  w.resize(static_cast<size_t>(n));
  if (n == 0) return;
  // dsyevd's workspace is 1 + 6n + 2n^2 doubles, counted in a 32-bit INTEGER.
  KVB_CHECK(2 * n * n + 6 * n + 1 <= std::numeric_limits<int>::max(),
            "an eigendecomposition of size " << n
                                             << " is beyond LAPACK's 32-bit workspace sizes");
  const int N = static_cast<int>(n);
  int info = 0, lwork = -1, liwork = -1, iwork_query = 0;
  double work_query = 0;
  // A symmetric row-major matrix is its own column-major matrix; row-major upper = column-major
  // lower. The eigenvectors come back as columns of a column-major matrix, i.e. as rows here.
  dsyevd_("V", "L", &N, a, &N, w.data(), &work_query, &lwork, &iwork_query, &liwork, &info);
  KVB_CHECK_AS(Unavailable, info == 0, "dsyevd workspace query failed (info " << info << ")");
  lwork = static_cast<int>(work_query);
  liwork = iwork_query;
  std::vector<double> work(static_cast<size_t>(lwork));
  std::vector<int> iwork(static_cast<size_t>(liwork));
  dsyevd_("V", "L", &N, a, &N, w.data(), work.data(), &lwork, iwork.data(), &liwork, &info);
  KVB_CHECK_AS(Unavailable, info == 0,
               "the eigendecomposition (dsyevd) of size " << n << " failed (info " << info << ")");
}

bool potrf_lower(int64_t n, double* a, int64_t lda) {
  if (n == 0) return true;
  // The row-major lower triangle is the column-major upper one: A = U^T U there, U = L^T.
  const int N = to_int(n, "potrf size"), la = to_int(lda, "leading dimension");
  int info = 0;
  dpotrf_("U", &N, a, &la, &info);
  KVB_CHECK_AS(Unavailable, info >= 0, "dpotrf: bad argument " << -info);
  return info == 0;
}

void trsm_lower(bool trans, int64_t n, int64_t m, const double* l, int64_t ldl, double* b,
                int64_t ldb) {
  if (n == 0 || m == 0) return;
  // Column-major, B^T [m, n] and U = L^T: L X = B is X^T U = B^T, L^T X = B is X^T U^T = B^T.
  const int M = to_int(m, "trsm size"), N = to_int(n, "trsm size");
  const int ll = to_int(ldl, "leading dimension"), lb = to_int(ldb, "leading dimension");
  const double one = 1;
  dtrsm_("R", "U", trans ? "T" : "N", "N", &M, &N, &one, l, &ll, b, &lb);
}

}  // namespace kvbridge::detail::lapack
