// Builds without CUDA: CUDA views cannot be converted, and no device state is ever created.
#include "kvbridge/error.h"
#include "src/adapter/convert_cuda.h"

namespace kvbridge {

void CudaCacheDeleter::operator()(CudaCache*) const noexcept {}

namespace detail {
void convert_cuda(const LinearAdapter::Impl&, const KVView& src, int64_t, const KVView&, void*,
                  const std::vector<int64_t>*, int64_t) {
  KVB_CHECK_AS(Unavailable, false,
               "LinearAdapter::convert: the KV views are on cuda:"
                   << src.device().index
                   << ", but this build of kvbridge has no CUDA path (configure with "
                      "-DKVBRIDGE_ENABLE_CUDA=ON)");
}
}  // namespace detail

}  // namespace kvbridge
