// Builds without CUDA: CUDA views cannot be fitted on, and no device state is ever created.
#include "kvbridge/error.h"
#include "src/adapter/fitter_cuda.h"

namespace kvbridge::detail {

HostKVCopy fitter_copy_to_host(const KVView& view, const char* what) {
  KVB_CHECK_AS(Unavailable, false,
               "AdapterFitter::add: " << what << " is on cuda:" << view.device().index
                                      << ", but this build of kvbridge has no CUDA path "
                                         "(configure with -DKVBRIDGE_ENABLE_CUDA=ON)");
  return {};
}

// Unreachable: without fitter_copy_to_host no CUDA sample gets this far.
FitterDevicePtr fitter_device_create(int, const std::vector<FitterAccumulator>&) {
  KVB_CHECK_AS(Unavailable, false, "AdapterFitter: this build of kvbridge has no CUDA path");
  return {};
}
void fitter_device_reserve(FitterDevice&, int64_t, int64_t, int64_t) {
  KVB_CHECK_AS(Unavailable, false, "AdapterFitter: this build of kvbridge has no CUDA path");
}
void fitter_device_accumulate(FitterDevice&, const double*, int64_t, const double*, int64_t,
                              int64_t, const std::vector<FitterProduct>&) {
  KVB_CHECK_AS(Unavailable, false, "AdapterFitter: this build of kvbridge has no CUDA path");
}
void fitter_device_download(const FitterDevice&) {}
int64_t fitter_device_bytes(const FitterDevice&) noexcept { return 0; }
void FitterDeviceDeleter::operator()(FitterDevice*) const noexcept {}

}  // namespace kvbridge::detail
