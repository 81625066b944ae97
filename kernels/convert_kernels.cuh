// Launchers of the device kernels of LinearAdapter::convert's CUDA path (host-callable; the
// kernels themselves live in convert_kernels.cu). Every launcher enqueues on `stream`, checks the
// launch with KVB_CUDA_CHECK_LAUNCH and returns without waiting. Pointers are device memory of
// the current device. Each launcher is the one dtype dispatch point of its operation.
//
// Index conventions shared with src/adapter/convert_cuda.cpp: a token row of a layer's features
// or GEMM output holds keys then values, each [heads, head_dim] flattened, so column
// kind * heads * dim + h * dim + d is element d of head h of the keys (kind 0) or values (kind 1).
// RoPE pairs follow src/adapter/numeric.cpp: (i, i + dim/2) for the half style, (2i, 2i + 1) for
// the interleaved one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvbridge/dtype.h"
#include "kvbridge/kv_view.h"

namespace kvbridge::cuda {

/// table[t * half + i] = (cos, sin) of (pos0 + t) * inv_freq[i], the angle and both functions in
/// float64, rounded to float32 (as the CPU path does). inv_freq: `half` float64 values.
void launch_rope_table(const double* inv_freq, int64_t half, int64_t pos0, int64_t tokens,
                       float2* table, cudaStream_t stream);

/// Gathers tokens [0, tokens) of one source layer: planes `key` and `value` ([tokens, heads, dim],
/// element strides, `dtype`) into the dense rows out[t * ld + column] (see the header comment), in
/// the same dtype, which is the GEMM input type. With `table` (launch_rope_table of the source
/// RoPE at the block's positions) keys are un-rotated in float32 first; nullptr copies them.
void launch_gather(const KVPlane& key, const KVPlane& value, DType dtype, int64_t tokens,
                   int64_t heads, int64_t dim, bool interleaved, const float2* table, void* out,
                   int64_t ld, cudaStream_t stream);

/// The fused epilogue of one target layer: for tokens [0, tokens), x = y[t * ld + column] +
/// bias[column] (float32), keys rotated with `table` (the target RoPE; nullptr: none), rounded to
/// `dtype` (nearest even) and written to the strided planes `key` / `value`. Only the viewed
/// elements are written.
void launch_epilogue(const float* y, int64_t ld, const float* bias, const float2* table,
                     bool interleaved, int64_t tokens, int64_t heads, int64_t dim, DType dtype,
                     const KVPlane& key, const KVPlane& value, cudaStream_t stream);

}  // namespace kvbridge::cuda
