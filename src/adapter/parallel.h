// Coarse-grained OpenMP parallelism of the adapter (fitter products, convert token blocks).
// Only for translation units compiled with OpenMP (the library's own sources).
#pragma once

#include <cstdint>
#include <exception>

namespace kvbridge::detail {

/// Runs body(i) for i in [0, n) on the OpenMP threads, one call per thread at a time (BLAS and
/// Eigen calls inside then run single-threaded: parallelism across independent pieces of work,
/// which keeps every core busy without fine-grained synchronisation). Rethrows the first
/// exception afterwards.
template <class Body>
void parallel_for(int64_t n, const Body& body) {
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (int64_t i = 0; i < n; ++i) {
    try {
      body(i);
    } catch (...) {
#pragma omp critical(kvbridge_parallel_for_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kvbridge::detail
