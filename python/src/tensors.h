// Torch tensors read from C++ without importing torch: a tensor's data_ptr(), shape, stride(),
// dtype, layout and device are read through its Python attributes. This saves the per-call cost
// of building a kvbridge TensorView object per tensor in Python (most of a small put's time).
#pragma once

#include <pybind11/pybind11.h>

#include <vector>

#include "kvbridge/kv_view.h"

namespace kvbridge::python {

/// Registers torch's objects the readers compare against: `tensor_type` (torch.Tensor),
/// `strided` (torch.strided) and `dtypes`, a dict {torch dtype: kvbridge dtype name}.
/// kvbridge._tensors calls it once at import; until then every reader returns false.
void register_torch(const pybind11::handle& tensor_type, const pybind11::handle& strided,
                    const pybind11::dict& dtypes);

/// The views of the (key, value) pairs of a legacy KV tuple `kv`: true and *keys / *values
/// filled (one per layer, the tensors' own memory, which the caller keeps alive while the views
/// are used) when kv is a non-empty tuple or list of 2-tuples or 2-lists of dense CPU torch
/// tensors of a registered dtype. False, with nothing raised, for anything else (transformers
/// caches, device or meta tensors, other dtypes, wrong containers): the caller then takes the
/// general path, which checks, copies to the CPU and names what is wrong. Needs the GIL.
bool cpu_pair_views(const pybind11::handle& kv, std::vector<TensorView>* keys,
                    std::vector<TensorView>* values);

/// One tensor's view under the same conditions as cpu_pair_views (false: not such a tensor).
bool cpu_tensor_view(const pybind11::handle& tensor, TensorView* view);

/// A torch tensor's data pointer, 1-D length and element stride when `tensor` is a dense 1-D
/// CPU tensor of torch.int64 / torch.int32; *element_size is 8 or 4. False otherwise (not a
/// torch tensor, or another kind: the caller converts it the general way). Needs the GIL.
bool cpu_int_vector(const pybind11::handle& tensor, const void** data, size_t* size,
                    int64_t* stride, int* element_size);

}  // namespace kvbridge::python
