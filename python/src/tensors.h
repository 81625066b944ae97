// Torch tensors read from C++ without importing torch: a tensor's data_ptr(), shape, stride(),
// dtype, layout and device are read through its Python attributes. This saves the per-call cost
// of building a kvbridge TensorView object per tensor in Python (most of a small put's time).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"

namespace kvbridge::python {

/// Registers torch's objects the readers compare against: `tensor_type` (torch.Tensor),
/// `strided` (torch.strided) and `dtypes`, a dict {torch dtype: kvbridge dtype name}; and
/// torch.empty (`empty`, which makes an empty CPU tensor per KV dtype here, for new_empty) and
/// torch.empty_like (`empty_like`), which new_cpu_kv allocates with.
/// kvbridge._tensors calls it once at import; until then every reader returns false.
void register_torch(const pybind11::handle& tensor_type, const pybind11::handle& strided,
                    const pybind11::dict& dtypes, const pybind11::handle& empty,
                    const pybind11::handle& empty_like);

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

/// A fresh legacy KV tuple for `tokens` tokens of `spec`: one (key, value) pair per layer of
/// new, independent, uninitialized, contiguous CPU torch tensors [1, num_kv_heads, tokens,
/// head_dim] of the torch dtype registered for spec.dtype, on the CPU whatever torch's default
/// device (Tensor.new_empty of an empty CPU tensor for the first, torch.empty_like of it for the
/// others: the cheapest allocations torch offers from here). *dst is their view, for writing
/// them. Throws Error when torch is not registered, has no dtype registered for spec.dtype, or
/// (under a torch mode) made a tensor that is not a CPU one with data. Needs the GIL.
pybind11::tuple new_cpu_kv(const ModelSpec& spec, int64_t tokens, KVView* dst);

/// Copies of fewer bytes than this run with the GIL held: releasing and taking it back costs
/// more than they do. Larger ones release it so that other threads run meanwhile.
constexpr int64_t kReleaseGilBytes = int64_t{256} << 10;

/// Runs copy(), which moves `bytes` bytes, with the GIL released when bytes >= kReleaseGilBytes.
/// Called with the GIL held.
template <class Copy>
void copy_releasing_gil_if_large(int64_t bytes, Copy&& copy) {
  if (bytes < kReleaseGilBytes) {
    std::forward<Copy>(copy)();
  } else {
    pybind11::gil_scoped_release release;
    std::forward<Copy>(copy)();
  }
}

}  // namespace kvbridge::python
