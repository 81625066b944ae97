// The CUDA path of LinearAdapter::convert (convert_cuda.cpp; convert_cuda_stub.cpp in builds
// without CUDA). Internal: the public contract is LinearAdapter::convert in adapter.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "kvbridge/kv_view.h"
#include "kvbridge/model_spec.h"
#include "src/adapter/adapter_impl.h"

namespace kvbridge::detail {

/// Converts CUDA views `src` -> `dst` (same device, checked by the caller) on `cuda_stream`
/// (a cudaStream_t; nullptr: the legacy default stream). alignment: nullptr, or the source token
/// of each target token (LinearAdapter::convert with an alignment), target token j then at
/// target_start_pos + j.
void convert_cuda(const LinearAdapter::Impl& a, const KVView& src, int64_t start_pos,
                  const KVView& dst, void* cuda_stream, const std::vector<int64_t>* alignment,
                  int64_t target_start_pos);

/// Device scratch the CUDA path may hold per concurrent convert call, in bytes (default 512 MiB,
/// adapter.h documents it); tokens are processed in blocks that fit. Tests lower it to exercise
/// the blocking.
std::atomic<int64_t>& cuda_scratch_budget();
inline constexpr int64_t kDefaultCudaScratchBudget = int64_t{512} << 20;
/// cuBLAS workspace per concurrent call (cublasSetWorkspace), on top of the scratch.
inline constexpr int64_t kCudaCublasWorkspaceBytes = int64_t{32} << 20;

/// Scratch bytes per token of a block: the features of `used_source_layers` source layers in the
/// GEMM input type (the source dtype), one target layer's float32 GEMM output and the RoPE
/// tables, one per distinct frequency set of each model (detail::LayerInvFreq::num_sets(); 1 for
/// a spec without per-layer attention).
int64_t cuda_scratch_bytes_per_token(const ModelSpec& source, const ModelSpec& target,
                                     int64_t used_source_layers, int64_t source_rope_sets = 1,
                                     int64_t target_rope_sets = 1);
/// Tokens per block for a call of `tokens` tokens (> 0): the fewest blocks that fit `budget`,
/// balanced in size; at least 1 token per block whatever the budget.
int64_t cuda_block_tokens(int64_t tokens, int64_t bytes_per_token, int64_t budget);

}  // namespace kvbridge::detail
