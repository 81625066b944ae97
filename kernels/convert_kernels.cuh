// Launchers of the device kernels of LinearAdapter::convert's CUDA path (host-callable; the
// kernels themselves live in convert_kernels.cu). Every launcher enqueues on `stream`, checks the
// launch with KVB_CUDA_CHECK_LAUNCH and returns without waiting. Pointers are device memory of
// the current device. Each launcher is the one dtype dispatch point of its operation.
//
// Index conventions: kernels/convert_elements.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/convert_elements.cuh"
#include "kvbridge/dtype.h"
#include "kvbridge/kv_view.h"

namespace kvbridge::cuda {

/// table[t * half + i] = rope_entry(pos0, offsets, t, inv_freq[i]): (cos, sin) of the angle at
/// position pos0 + t, or pos0 + offsets[t] with offsets (device memory, `tokens` entries).
/// inv_freq: `half` float64 values.
void launch_rope_table(const double* inv_freq, int64_t half, int64_t pos0, const int64_t* offsets,
                       int64_t tokens, CosSin* table, cudaStream_t stream);

/// Gathers `tokens` token rows of one source layer: row t of planes `key` and `value` ([tokens,
/// heads, dim], element strides, `dtype`), or row index[t] with an index (device memory,
/// `tokens` entries, each a token of the planes), into the dense rows out[t * ld + column] (see
/// convert_elements.cuh), in the same dtype, which is the GEMM input type. With `table`
/// (launch_rope_table of the source RoPE at those rows' positions) keys are un-rotated in float32
/// first; nullptr copies them.
void launch_gather(const KVPlane& key, const KVPlane& value, DType dtype, const int64_t* index,
                   int64_t tokens, int64_t heads, int64_t dim, bool interleaved,
                   const CosSin* table, void* out, int64_t ld, cudaStream_t stream);

/// The fused epilogue of one target layer: for tokens [0, tokens), x = y[t * ld + column] +
/// bias[column] (float32), keys rotated with `table` (the target RoPE; nullptr: none), rounded to
/// `dtype` (nearest even) and written to the strided planes `key` / `value`. Only the viewed
/// elements are written.
void launch_epilogue(const float* y, int64_t ld, const float* bias, const CosSin* table,
                     bool interleaved, int64_t tokens, int64_t heads, int64_t dim, DType dtype,
                     const KVPlane& key, const KVPlane& value, cudaStream_t stream);

}  // namespace kvbridge::cuda
