// Token ids from Python objects, for the bindings.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

#include "kvbridge/prefix_hash.h"

namespace kvbridge::python {

/// The token ids of a Python object as a TokenSpan:
///   - a list or tuple of ints (Python ints or anything with __index__, such as numpy integer
///     scalars; bools and floats are refused): converted here to u32, each id range-checked;
///   - a 1-D numpy array of an integer dtype: int64 and uint32 arrays that are C-contiguous are
///     read in place (the library checks int64 ids), any other integer dtype or stride is
///     converted here, each id range-checked;
///   - a 1-D dense CPU torch tensor of torch.int64 (read in place when contiguous) or
///     torch.int32 (converted here), once kvbridge._tensors has registered torch (tensors.h).
/// Anything else, or an array of another dtype, is a TypeError naming `tokens`; an array that is
/// not 1-D, or an id outside [0, 2^32), is an InvalidArgument naming it. The object must stay
/// alive while the span is used (the caller holds it for the call). Needs the GIL.
class PyTokens {
 public:
  explicit PyTokens(const pybind11::handle& tokens);
  PyTokens(const PyTokens&) = delete;
  PyTokens& operator=(const PyTokens&) = delete;

  TokenSpan span() const noexcept { return span_; }

 private:
  uint32_t* allocate(size_t n);

  std::unique_ptr<uint32_t[]> ids_;  // converted ids, when not read in place
  TokenSpan span_;
};

}  // namespace kvbridge::python
