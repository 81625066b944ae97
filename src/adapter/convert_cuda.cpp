// Host side of the CUDA convert path: per-device weights, workspaces and the enqueue sequence.
//
// Per block of tokens, on the caller's stream:
//   1. RoPE tables (cos, sin) for the block's positions, source and target (float64 angles);
//   2. one gather per used source layer: its keys (un-rotated) and values, in the GEMM input
//      type, into one row-major feature block [tokens, U * 2 * sw] holding the U used source
//      layers side by side in ascending order;
//   3. per target layer j: Y [tokens, 2 * tw] (float32) = features of its source layers x W_j,
//      where W_j = [W_key | W_value] concatenates both maps' columns (they share the features), so
//      one GEMM yields keys and values; then the fused epilogue (bias, target RoPE on keys, cast,
//      strided scatter into dst).
// Several source layers per target layer: a gathered block is built once per call and every
// source layer is gathered (and un-rotated) once, however many target layers use it. The layers
// of target j that sit in consecutive slots of the block form one column block of it, so a
// single GEMM over k = run * 2 * sw covers them (one GEMM for "all layers" or any window of
// consecutive layers); the runs of a non-contiguous set accumulate into Y with beta = 1.
//
// GEMM precision: inputs in the source dtype, float32 accumulation (CUBLAS_COMPUTE_32F) and
// float32 output. float32 caches: float32 features and weights, no TF32. bfloat16 caches:
// bfloat16 features and weights. float16 caches: float16 features, and weights stored as
// float16 after dividing each target layer's weights by a power of two 2^e (max |w| / 2^e in
// [2^13, 2^14)), which the GEMM's alpha multiplies back exactly, so weights outside float16's
// range neither overflow nor flush to zero.
#include "src/adapter/convert_cuda.h"

#include <cuda_runtime_api.h>
#include <library_types.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/convert_kernels.cuh"
#include "kernels/cuda_check.cuh"
#include "kvbridge/error.h"
#include "kvbridge/kvbridge.h"
#include "src/adapter/cublas.h"
#include "src/adapter/cuda_device.h"
#include "src/adapter/numeric.h"

namespace kvbridge {
namespace {

using cuda::align_up;
using cuda::check_device_pointers;
using cuda::device_alloc;
using cuda::DeviceGuard;
using cuda::DevicePtr;
using cuda::QuietDeviceGuard;
constexpr int64_t kAlign = cuda::kOperandAlignBytes;

struct EventDestroy {
  void operator()(cudaEvent_t e) const noexcept { (void)cudaEventDestroy(e); }
};
using EventPtr = std::unique_ptr<CUevent_st, EventDestroy>;
struct StreamDestroy {
  void operator()(cudaStream_t s) const noexcept { (void)cudaStreamDestroy(s); }
};
using StreamPtr = std::unique_ptr<CUstream_st, StreamDestroy>;
struct HandleDestroy {
  void operator()(cuda::CublasHandle h) const noexcept {
    if (const cuda::Cublas* b = cuda::cublas_if_loaded()) (void)b->destroy(h);
  }
};
using HandlePtr = std::unique_ptr<cuda::CublasContext, HandleDestroy>;

cudaDataType cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return CUDA_R_32F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// One call's scratch and cuBLAS state. A workspace serves one call at a time; `done` is recorded
// on that call's stream when it has enqueued everything, and the next call that takes the
// workspace makes its own stream wait for it (stream-ordered reuse, no host wait).
struct Workspace {
  HandlePtr handle;
  DevicePtr blas_workspace;
  DevicePtr scratch;
  int64_t scratch_bytes = 0;
  EventPtr done;
  bool used = false;
};

// Target layer j's GEMMs: rows [weight_row, weight_row + layers * 2 sw) of W_j times the features
// of block slots [slot, slot + layers).
struct GemmRun {
  int64_t weight_row = 0, slot = 0, layers = 0;
};
struct TargetPlan {
  int64_t weight_offset = 0;  // elements into DeviceState::weights
  float alpha = 1.f;          // undoes the float16 weight scaling
  std::vector<GemmRun> runs;
};

}  // namespace

// Everything one device holds for one adapter.
struct DeviceState {
  int device = 0;
  std::vector<int64_t> used;  // source layers that feed any target layer, ascending
  std::vector<TargetPlan> targets;
  DevicePtr weights;  // per target layer [F_j, 2 tw] row-major, source dtype
  DevicePtr bias;     // [target layers, 2 tw] float32
  // float64 [sets, head_dim / 2]: each model's distinct frequency sets (LayerInvFreq::sets).
  DevicePtr source_inv_freq, target_inv_freq;
  std::mutex pool_mutex;
  std::vector<std::unique_ptr<Workspace>> idle;

  DeviceState() = default;
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;
  ~DeviceState() {
    QuietDeviceGuard guard(device);
    // Every call that used the weights or a workspace recorded that workspace's event after its
    // work: once those events have completed nothing on the device reads this memory any more.
    for (auto& ws : idle)
      if (ws->used) (void)cudaEventSynchronize(ws->done.get());
    idle.clear();
    weights.reset();
    bias.reset();
    source_inv_freq.reset();
    target_inv_freq.reset();
  }
};

struct CudaCache {
  std::map<int, std::unique_ptr<DeviceState>> devices;
};

void CudaCacheDeleter::operator()(CudaCache* cache) const noexcept { delete cache; }

namespace detail {

std::atomic<int64_t>& cuda_scratch_budget() {
  static std::atomic<int64_t> budget{kDefaultCudaScratchBudget};
  return budget;
}

int64_t cuda_scratch_bytes_per_token(const ModelSpec& source, const ModelSpec& target,
                                     int64_t used_source_layers, int64_t source_rope_sets,
                                     int64_t target_rope_sets) {
  const int64_t sw = source.num_kv_heads * source.head_dim;
  const int64_t tw = target.num_kv_heads * target.head_dim;
  return used_source_layers * 2 * sw * static_cast<int64_t>(dtype_size(source.dtype)) +
         2 * tw * 4 +
         (source_rope_sets * (source.head_dim / 2) + target_rope_sets * (target.head_dim / 2)) * 8 +
         8;
}

int64_t cuda_block_tokens(int64_t tokens, int64_t bytes_per_token, int64_t budget) {
  const int64_t most = std::max<int64_t>(1, budget / std::max<int64_t>(bytes_per_token, 1));
  const int64_t blocks = (tokens + most - 1) / most;
  return (tokens + blocks - 1) / blocks;
}

}  // namespace detail

namespace {

// Weights for one device: W_j = [W_key | W_value] per target layer in the source dtype, biases,
// RoPE frequencies, and the GEMM plan. Copies through a private stream and waits for it, so the
// state is complete before any stream can use it.
std::unique_ptr<DeviceState> upload(const LinearAdapter::Impl& a, int device) {
  auto state = std::make_unique<DeviceState>();
  state->device = device;
  const int64_t sw = a.source_width(), tw = a.target_width();
  const DType gemm_type = a.source.dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(gemm_type));

  std::vector<bool> is_used(static_cast<size_t>(a.source.num_layers), false);
  for (const auto& layers : a.layers)
    for (int64_t l : layers) is_used[static_cast<size_t>(l)] = true;
  std::vector<int64_t> slot_of(static_cast<size_t>(a.source.num_layers), -1);
  for (int64_t l = 0; l < a.source.num_layers; ++l)
    if (is_used[static_cast<size_t>(l)]) {
      slot_of[static_cast<size_t>(l)] = static_cast<int64_t>(state->used.size());
      state->used.push_back(l);
    }

  int64_t total = 0;  // elements
  for (int64_t j = 0; j < a.target.num_layers; ++j) {
    const auto& layers = a.layers[static_cast<size_t>(j)];
    KVB_CHECK(!layers.empty(), "adapter: target layer " << j << " has no source layers");
    TargetPlan p;
    p.weight_offset = total;
    for (size_t s = 0; s < layers.size(); ++s) {
      const int64_t slot = slot_of[static_cast<size_t>(layers[s])];
      if (!p.runs.empty() && p.runs.back().slot + p.runs.back().layers == slot) {
        ++p.runs.back().layers;
      } else {
        p.runs.push_back(GemmRun{static_cast<int64_t>(s) * 2 * sw, slot, 1});
      }
    }
    if (gemm_type == DType::kFloat16) {
      float max_abs = 0.f;
      for (int kind = 0; kind < 2; ++kind)
        for (float w : a.weights[static_cast<size_t>(j)][static_cast<size_t>(kind)])
          max_abs = std::max(max_abs, std::fabs(w));
      if (max_abs > 0.f && std::isfinite(max_abs)) {
        int e = 0;
        (void)std::frexp(max_abs, &e);  // max_abs < 2^e
        p.alpha = std::ldexp(1.f, std::max(e - 14, -126));
      }
    }
    const int64_t features = static_cast<int64_t>(layers.size()) * 2 * sw;
    total += align_up(features * 2 * tw, kAlign / es);
    state->targets.push_back(std::move(p));
  }

  DeviceGuard guard(device);
  cudaStream_t raw = nullptr;
  KVB_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  const StreamPtr stream(raw);
  state->weights = device_alloc(total * es);
  std::vector<unsigned char> staging;
  for (int64_t j = 0; j < a.target.num_layers; ++j) {
    const TargetPlan& p = state->targets[static_cast<size_t>(j)];
    const auto& wk = a.weights[static_cast<size_t>(j)][0];
    const auto& wv = a.weights[static_cast<size_t>(j)][1];
    const int64_t features = static_cast<int64_t>(wk.size()) / tw;
    staging.resize(static_cast<size_t>(features * 2 * tw * es));
    for (int64_t f = 0; f < features; ++f)
      for (int64_t c = 0; c < 2 * tw; ++c) {
        const float w = c < tw ? wk[static_cast<size_t>(f * tw + c)]
                               : wv[static_cast<size_t>(f * tw + c - tw)];
        unsigned char* out = staging.data() + (f * 2 * tw + c) * es;
        if (gemm_type == DType::kFloat32) {
          std::memcpy(out, &w, 4);
        } else {
          const uint16_t bits = gemm_type == DType::kBFloat16 ? detail::float_to_bf16(w)
                                                              : detail::float_to_fp16(w / p.alpha);
          std::memcpy(out, &bits, 2);
        }
      }
    KVB_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(state->weights.get()) + p.weight_offset * es,
                                   staging.data(), staging.size(), cudaMemcpyHostToDevice,
                                   stream.get()));
    KVB_CUDA_CHECK(cudaStreamSynchronize(stream.get()));  // before `staging` is reused
  }

  std::vector<float> bias(static_cast<size_t>(a.target.num_layers * 2 * tw));
  for (int64_t j = 0; j < a.target.num_layers; ++j)
    for (int kind = 0; kind < 2; ++kind) {
      const auto& b = a.bias[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      std::copy(b.begin(), b.end(), bias.begin() + (j * 2 + kind) * tw);
    }
  state->bias = device_alloc(static_cast<int64_t>(bias.size()) * 4);
  // Each model's distinct frequency sets, one after another (set i at i * head_dim / 2).
  std::vector<double> source_freq, target_freq;
  for (const auto& set : a.source_inv_freq.sets)
    source_freq.insert(source_freq.end(), set.begin(), set.end());
  for (const auto& set : a.target_inv_freq.sets)
    target_freq.insert(target_freq.end(), set.begin(), set.end());
  state->source_inv_freq = device_alloc(static_cast<int64_t>(source_freq.size()) * 8);
  state->target_inv_freq = device_alloc(static_cast<int64_t>(target_freq.size()) * 8);
  KVB_CUDA_CHECK(cudaMemcpyAsync(state->bias.get(), bias.data(), bias.size() * 4,
                                 cudaMemcpyHostToDevice, stream.get()));
  KVB_CUDA_CHECK(cudaMemcpyAsync(state->source_inv_freq.get(), source_freq.data(),
                                 source_freq.size() * 8, cudaMemcpyHostToDevice, stream.get()));
  KVB_CUDA_CHECK(cudaMemcpyAsync(state->target_inv_freq.get(), target_freq.data(),
                                 target_freq.size() * 8, cudaMemcpyHostToDevice, stream.get()));
  KVB_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  return state;
}

DeviceState& device_state(const LinearAdapter::Impl& a, int device) {
  std::lock_guard<std::mutex> lock(a.cuda_mutex);
  if (!a.cuda_cache) a.cuda_cache.reset(new CudaCache);
  std::unique_ptr<DeviceState>& slot = a.cuda_cache->devices[device];
  if (!slot) slot = upload(a, device);  // on failure the slot stays empty and the next call retries
  return *slot;
}

// Takes a workspace of `state` with at least `scratch_bytes` of scratch for one call on `stream`
// and gives it back, with its event recorded on `stream`, when the call is done enqueueing.
class WorkspaceLease {
 public:
  // Growth at least doubles (up to `most_bytes`), so inputs that grow a little at a time do not
  // reallocate on every call.
  WorkspaceLease(DeviceState& state, int64_t scratch_bytes, int64_t most_bytes,
                 cudaStream_t stream)
      : state_(state), stream_(stream) {
    {
      std::lock_guard<std::mutex> lock(state.pool_mutex);
      if (!state.idle.empty()) {
        ws_ = std::move(state.idle.back());
        state.idle.pop_back();
      }
    }
    if (!ws_) {
      ws_ = std::make_unique<Workspace>();
      cuda::CublasHandle handle = nullptr;
      KVB_CUDA_CHECK(cuda::cublas().create(&handle));
      ws_->handle.reset(handle);
      ws_->blas_workspace = device_alloc(detail::kCudaCublasWorkspaceBytes);
      cudaEvent_t event = nullptr;
      KVB_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
      ws_->done.reset(event);
    }
    if (ws_->used) KVB_CUDA_CHECK(cudaStreamWaitEvent(stream, ws_->done.get(), 0));
    if (ws_->scratch_bytes < scratch_bytes) {
      // Growing: the old buffer may still be in use by the previous call's stream.
      if (ws_->used) KVB_CUDA_CHECK(cudaEventSynchronize(ws_->done.get()));
      const int64_t bytes =
          std::max(scratch_bytes, std::min(2 * ws_->scratch_bytes, most_bytes));
      ws_->scratch.reset();
      ws_->scratch_bytes = 0;
      ws_->scratch = device_alloc(bytes);
      ws_->scratch_bytes = bytes;
    }
  }
  ~WorkspaceLease() {
    // A workspace whose event cannot be recorded cannot be reused safely: it is freed instead.
    if (cudaEventRecord(ws_->done.get(), stream_) != cudaSuccess) return;
    ws_->used = true;
    std::lock_guard<std::mutex> lock(state_.pool_mutex);
    state_.idle.push_back(std::move(ws_));
  }
  WorkspaceLease(const WorkspaceLease&) = delete;
  WorkspaceLease& operator=(const WorkspaceLease&) = delete;

  Workspace& operator*() const { return *ws_; }

 private:
  DeviceState& state_;
  cudaStream_t stream_;
  std::unique_ptr<Workspace> ws_;
};

void check_int(int64_t v, const char* what) {
  KVB_CHECK(v <= INT_MAX, "CUDA convert: " << what << " " << v << " exceeds cuBLAS' int range");
}

}  // namespace

namespace detail {

void convert_cuda(const LinearAdapter::Impl& a, const KVView& src, int64_t start_pos,
                  const KVView& dst, void* cuda_stream, const std::vector<int64_t>* alignment,
                  int64_t target_start_pos) {
  const int device = src.device().index;
  const int devices = cuda_device_count();
  KVB_CHECK_AS(Unavailable, devices > 0,
               "LinearAdapter::convert: the KV views are on cuda:"
                   << device << ", but no CUDA device is available (no driver or no GPU)");
  KVB_CHECK(device >= 0 && device < devices,
            "LinearAdapter::convert: cuda:" << device << " does not exist (" << devices
                                            << " devices)");
  src.check_matches(a.source, "source_kv");
  dst.check_matches(a.target, "target_kv");
  KVB_CHECK(alignment || src.tokens() == dst.tokens(),
            "target_kv holds " << dst.tokens() << " tokens but source_kv holds " << src.tokens());
  detail::check_convert_positions(src, start_pos, dst, alignment, target_start_pos);
  if (!alignment) target_start_pos = start_pos;
  const int64_t T = dst.tokens();
  if (T == 0) return;

  const int64_t sw = a.source_width(), tw = a.target_width();
  const int64_t half_s = a.source.head_dim / 2, half_t = a.target.head_dim / 2;
  const bool rope = a.report.rope_aware;
  const DType gemm_type = a.source.dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(gemm_type));
  const auto stream = static_cast<cudaStream_t>(cuda_stream);

  DeviceGuard guard(device);
  check_device_pointers(src, device, "source_kv");
  check_device_pointers(dst, device, "target_kv");
  const cuda::Cublas& blas = cuda::cublas();
  DeviceState& state = device_state(a, device);

  const int64_t used = static_cast<int64_t>(state.used.size());
  const int64_t ldf = used * 2 * sw;  // feature row length
  const int64_t source_sets = a.source_inv_freq.num_sets(),
                target_sets = a.target_inv_freq.num_sets();
  const int64_t per_token =
      cuda_scratch_bytes_per_token(a.source, a.target, used, source_sets, target_sets);
  const int64_t budget = cuda_scratch_budget().load();
  const int64_t block = cuda_block_tokens(T, per_token, budget);
  check_int(2 * tw, "2 * target width");
  check_int(ldf, "feature row length");
  check_int(block, "tokens per block");

  const int64_t features_bytes = align_up(block * ldf * es, kAlign);
  const int64_t y_bytes = align_up(block * 2 * tw * 4, kAlign);
  // One table of `block` rows per frequency set: set i's at i * block * half entries.
  const int64_t source_table_bytes = align_up(source_sets * block * half_s * 8, kAlign);
  const int64_t target_table_bytes = align_up(target_sets * block * half_t * 8, kAlign);
  const int64_t index_bytes = align_up(block * 8, kAlign);
  const int64_t scratch_bytes =
      features_bytes + y_bytes + source_table_bytes + target_table_bytes + index_bytes;
  WorkspaceLease lease(state, scratch_bytes, std::max(budget + 4 * kAlign, scratch_bytes), stream);
  Workspace& ws = *lease;
  char* scratch = static_cast<char*>(ws.scratch.get());
  char* features = scratch;
  auto* y = reinterpret_cast<float*>(scratch + features_bytes);
  auto* source_table = reinterpret_cast<cuda::CosSin*>(scratch + features_bytes + y_bytes);
  auto* target_table =
      reinterpret_cast<cuda::CosSin*>(scratch + features_bytes + y_bytes + source_table_bytes);
  auto* index = reinterpret_cast<int64_t*>(scratch + features_bytes + y_bytes +
                                           source_table_bytes + target_table_bytes);
  const char* weights = static_cast<const char*>(state.weights.get());
  const float* bias = static_cast<const float*>(state.bias.get());

  // setStream resets the workspace to cuBLAS' default pool, so the workspace is set after it.
  KVB_CUDA_CHECK(blas.set_stream(ws.handle.get(), stream));
  KVB_CUDA_CHECK(blas.set_workspace(ws.handle.get(), ws.blas_workspace.get(),
                                    static_cast<size_t>(kCudaCublasWorkspaceBytes)));
  const bool source_interleaved = a.source.rope_style == RopeStyle::kInterleaved;
  const bool target_interleaved = a.target.rope_style == RopeStyle::kInterleaved;
  const cudaDataType in_type = cuda_type(gemm_type);

  for (int64_t t0 = 0; t0 < T; t0 += block) {
    const int64_t tb = std::min(block, T - t0);
    // Without an alignment the block's source rows are tokens t0.. of src; with one, rows
    // alignment[t0 + t] of the whole of src, their indices copied into the scratch first (from
    // pageable memory: staged before cudaMemcpyAsync returns, so the vector may change after).
    const int64_t* rows = nullptr;
    if (alignment) {
      KVB_CUDA_CHECK(cudaMemcpyAsync(index, alignment->data() + t0,
                                     static_cast<size_t>(tb) * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream));
      rows = index;
    }
    const KVView s = rows ? src : src.slice_tokens(t0, tb), d = dst.slice_tokens(t0, tb);
    if (rope) {
      for (int64_t i = 0; i < source_sets; ++i)
        cuda::launch_rope_table(static_cast<const double*>(state.source_inv_freq.get()) +
                                    i * half_s,
                                half_s, rows ? start_pos : start_pos + t0, rows, tb,
                                source_table + i * block * half_s, stream);
      for (int64_t i = 0; i < target_sets; ++i)
        cuda::launch_rope_table(static_cast<const double*>(state.target_inv_freq.get()) +
                                    i * half_t,
                                half_t, target_start_pos + t0, nullptr, tb,
                                target_table + i * block * half_t, stream);
    }
    for (int64_t u = 0; u < used; ++u) {
      const int64_t l = state.used[static_cast<size_t>(u)];
      cuda::launch_gather(s.plane(l, KVView::kKey), s.plane(l, KVView::kValue), gemm_type, rows,
                          tb, a.source.num_kv_heads, a.source.head_dim, source_interleaved,
                          rope ? source_table + static_cast<int64_t>(a.source_inv_freq.set(l)) *
                                                    block * half_s
                               : nullptr,
                          features + u * 2 * sw * es, ldf, stream);
    }
    for (int64_t j = 0; j < a.target.num_layers; ++j) {
      const TargetPlan& p = state.targets[static_cast<size_t>(j)];
      for (size_t r = 0; r < p.runs.size(); ++r) {
        const GemmRun& run = p.runs[r];
        const float alpha = p.alpha, beta = r == 0 ? 0.f : 1.f;  // beta 0: Y is not read
        const int64_t k = run.layers * 2 * sw;
        check_int(k, "GEMM depth");
        // Column-major view of the row-major operands: Y^T [2tw, tb] = W^T [2tw, k] X^T [k, tb].
        KVB_CUDA_CHECK(blas.gemm_ex(
            ws.handle.get(), cuda::kCublasOpN, cuda::kCublasOpN, static_cast<int>(2 * tw),
            static_cast<int>(tb), static_cast<int>(k), &alpha,
            weights + (p.weight_offset + run.weight_row * 2 * tw) * es, in_type,
            static_cast<int>(2 * tw), features + run.slot * 2 * sw * es, in_type,
            static_cast<int>(ldf), &beta, y, CUDA_R_32F, static_cast<int>(2 * tw),
            cuda::kCublasCompute32F, cuda::kCublasGemmDefault));
      }
      const cuda::CosSin* table =
          rope ? target_table + static_cast<int64_t>(a.target_inv_freq.set(j)) * block * half_t
               : nullptr;
      cuda::launch_epilogue(y, 2 * tw, bias + j * 2 * tw, table,
                            target_interleaved, tb, a.target.num_kv_heads, a.target.head_dim,
                            a.target.dtype, d.plane(j, KVView::kKey), d.plane(j, KVView::kValue),
                            stream);
    }
  }
}

}  // namespace detail
}  // namespace kvbridge
