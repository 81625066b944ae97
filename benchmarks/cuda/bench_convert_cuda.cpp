// CUDA convert against the same cuBLAS GEMMs alone, in the same process, with CUDA events.
//
// Both models have the shape --layers x --heads x --head-dim (default 32 x 8 x 128, bfloat16),
// with a random adapter whose target layer j draws on S consecutive source layers (cases
// S = 1 and S = 4 by default). For each case it times, interleaved, --iters times after
// --warmup calls (medians reported):
//   (a) fused: LinearAdapter::convert on HF-layout device tensors [1, heads, tokens, dim] per
//       layer (gathers with RoPE un-rotation, the GEMMs, fused bias/RoPE/cast/scatter epilogue);
//   (b) gemms: the GEMM calls convert makes (same shapes, strides, types, token blocks, handle
//       settings), on pre-made device buffers, nothing else.
// It prints the ratio (target: fused <= 1.25 x gemms) and TFLOP/s of the GEMM FLOPs
// (2 * tokens * features * 2 * target width per target layer) for both, then checks the first
// and last --check-tokens tokens of the result against the CPU convert: exit status 1 when the
// largest error per plane exceeds the bfloat16 tolerance 2e-2 of that plane's largest value (or
// anything is not finite), 2 for bad arguments or setup failures.
//
//   kvbridge_cuda_bench [--tokens 4096] [--layers 32] [--heads 8] [--head-dim 128]
//                       [--sources 1,4] [--iters 20] [--warmup 3] [--check-tokens 256]
//                       [--start-pos 0]
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "kvbridge/kvbridge.h"
#include "src/adapter/convert_cuda.h"
#include "src/adapter/cublas.h"
#include "src/adapter/numeric.h"
#include "tests/cuda/random_adapter.h"

namespace kvbridge {
namespace {

struct Options {
  int64_t tokens = 4096, layers = 32, heads = 8, head_dim = 128;
  std::vector<int64_t> sources = {1, 4};
  int iters = 20, warmup = 3;
  int64_t check_tokens = 256, start_pos = 0;
};

[[noreturn]] void usage(const char* why, int status = 2) {
  std::fprintf(status ? stderr : stdout,
               "kvbridge_cuda_bench: %s\nusage: kvbridge_cuda_bench [--tokens N] [--layers N] "
               "[--heads N] [--head-dim N] [--sources 1,4] [--iters N] [--warmup N] "
               "[--check-tokens N] [--start-pos N]\n",
               why);
  std::exit(status);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") usage("CUDA convert vs cuBLAS GEMMs alone", 0);
    if (i + 1 >= argc) usage(("missing value for " + arg).c_str());
    const std::string value = argv[++i];
    char* end = nullptr;
    const long long n = std::strtoll(value.c_str(), &end, 10);
    const bool number = end && *end == '\0';
    if (arg == "--sources") {
      o.sources.clear();
      size_t pos = 0;
      while (pos <= value.size()) {
        const size_t comma = std::min(value.find(',', pos), value.size());
        o.sources.push_back(std::atoll(value.substr(pos, comma - pos).c_str()));
        pos = comma + 1;
      }
      continue;
    }
    if (!number || n < 0) usage(("bad value for " + arg + ": " + value).c_str());
    if (arg == "--tokens") o.tokens = n;
    else if (arg == "--layers") o.layers = n;
    else if (arg == "--heads") o.heads = n;
    else if (arg == "--head-dim") o.head_dim = n;
    else if (arg == "--iters") o.iters = static_cast<int>(n);
    else if (arg == "--warmup") o.warmup = static_cast<int>(n);
    else if (arg == "--check-tokens") o.check_tokens = n;
    else if (arg == "--start-pos") o.start_pos = n;
    else usage(("unknown option " + arg).c_str());
  }
  if (o.tokens < 1 || o.layers < 1 || o.heads < 1 || o.head_dim < 2 || o.head_dim % 2 ||
      o.iters < 1)
    usage("tokens, layers, heads, iters must be >= 1 and head_dim even");
  for (int64_t s : o.sources)
    if (s < 1 || s > o.layers) usage("each --sources value must be in [1, layers]");
  o.check_tokens = std::min(o.check_tokens, o.tokens);
  return o;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error %s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}
#define CUDA_OK(expr) cuda_ok((expr), #expr)

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { CUDA_OK(cudaMalloc(&ptr, std::max<size_t>(bytes, 1))); }
  ~DeviceBuffer() { (void)cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Uniform in [-scale, scale), rounded to bfloat16.
std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, float scale) {
  testing::UniformStream rng(seed);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = detail::float_to_bf16(scale * rng.next());
  return v;
}

// Per-layer HF tensors [1, heads, tokens, dim] (planes in one buffer, layer-major, K then V).
KVView hf_view(void* base, const ModelSpec& s, int64_t tokens, Device device) {
  std::vector<KVPlane> planes;
  const int64_t plane = s.num_kv_heads * tokens * s.head_dim;
  for (int64_t p = 0; p < 2 * s.num_layers; ++p)
    planes.push_back(KVPlane{static_cast<uint16_t*>(base) + p * plane, s.head_dim,
                             tokens * s.head_dim, 1});
  return KVView::from_planes(std::move(planes), s.dtype, device, tokens, s.num_kv_heads,
                             s.head_dim);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Largest |got - want| and |got - want| / max |want| over the planes of two CPU views.
struct Errors {
  double max_abs = 0, max_scaled = 0;
  bool finite = true;
};
Errors compare(const KVView& got, const KVView& want) {
  const int64_t T = want.tokens(), H = want.kv_heads(), D = want.head_dim();
  std::vector<float> a(static_cast<size_t>(T * H * D)), b(a.size());
  Errors e;
  for (int64_t l = 0; l < want.num_layers(); ++l)
    for (int k = 0; k < 2; ++k) {
      detail::load_plane(got.plane(l, static_cast<KVView::Kind>(k)), got.dtype(), T, H, D,
                         a.data(), H * D);
      detail::load_plane(want.plane(l, static_cast<KVView::Kind>(k)), want.dtype(), T, H, D,
                         b.data(), H * D);
      double scale = 0, worst = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        if (!std::isfinite(a[i]) || !std::isfinite(b[i])) e.finite = false;
        scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
        worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
      }
      e.max_abs = std::max(e.max_abs, worst);
      e.max_scaled = std::max(e.max_scaled, scale > 0 ? worst / scale : INFINITY);
    }
  return e;
}

// Returns false on a result mismatch.
bool run_case(const Options& o, int64_t sources) {
  const ModelSpec src = [&] {
    ModelSpec s;
    s.name = "bench-src";
    s.num_layers = o.layers;
    s.num_kv_heads = o.heads;
    s.head_dim = o.head_dim;
    s.dtype = DType::kBFloat16;
    s.rope_base = 10000.0;
    return s;
  }();
  ModelSpec tgt = src;
  tgt.name = "bench-tgt";
  tgt.rope_base = 500000.0;
  tgt.rope_scaling = RopeScaling{RopeScaling::Type::kLlama3, 8.0, 1.0, 4.0, 8192};
  std::vector<std::vector<int64_t>> layer_map;
  for (int64_t j = 0; j < o.layers; ++j) {
    const int64_t first = std::min(j, o.layers - sources);
    std::vector<int64_t> l;
    for (int64_t s = 0; s < sources; ++s) l.push_back(first + s);
    layer_map.push_back(l);
  }
  const int64_t T = o.tokens, sw = o.heads * o.head_dim, tw = sw;
  const int64_t used = o.layers;  // every source layer feeds some target layer
  const int64_t features = sources * 2 * sw;
  const double flops = 2.0 * static_cast<double>(T) * static_cast<double>(features) *
                       static_cast<double>(2 * tw) * static_cast<double>(o.layers);
  std::printf("\n== %lld source layer(s) per target layer: %lld layers x %lld heads x %lld dim, "
              "%lld tokens, bfloat16; GEMM work %.3f TFLOP per convert\n",
              static_cast<long long>(sources), static_cast<long long>(o.layers),
              static_cast<long long>(o.heads), static_cast<long long>(o.head_dim),
              static_cast<long long>(T), flops * 1e-12);

  auto t_setup = std::chrono::steady_clock::now();
  const LinearAdapter adapter = testing::make_random_adapter(src, tgt, layer_map, true, 42);
  const size_t kv_elems = static_cast<size_t>(2 * o.layers * o.heads * T * o.head_dim);
  const std::vector<uint16_t> host_src = random_bf16(kv_elems, 7, 2.f);
  DeviceBuffer d_src(kv_elems * 2), d_dst(kv_elems * 2);
  CUDA_OK(cudaMemcpy(d_src.ptr, host_src.data(), kv_elems * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(d_dst.ptr, 0xff, kv_elems * 2));  // NaN: anything not written shows
  const Device cuda{DeviceType::kCUDA, 0};
  const KVView src_view = hf_view(d_src.ptr, src, T, cuda);
  const KVView dst_view = hf_view(d_dst.ptr, tgt, T, cuda);

  // The GEMMs alone: convert's plan (token blocks, one GEMM per target layer over a column block
  // of the [block, used * 2 * sw] feature matrix), on buffers of random values.
  const int64_t block = detail::cuda_block_tokens(
      T, detail::cuda_scratch_bytes_per_token(src, tgt, used), detail::cuda_scratch_budget());
  const int64_t ldf = used * 2 * sw;
  DeviceBuffer d_features(static_cast<size_t>(block * ldf * 2));
  DeviceBuffer d_weights(static_cast<size_t>(o.layers * features * 2 * tw * 2));
  DeviceBuffer d_y(static_cast<size_t>(block * 2 * tw * 4));
  DeviceBuffer d_blas_ws(static_cast<size_t>(detail::kCudaCublasWorkspaceBytes));
  {
    const auto f = random_bf16(static_cast<size_t>(block * ldf), 8, 2.f);
    CUDA_OK(cudaMemcpy(d_features.ptr, f.data(), f.size() * 2, cudaMemcpyHostToDevice));
    const auto w = random_bf16(static_cast<size_t>(o.layers * features * 2 * tw), 9,
                               std::sqrt(3.f / static_cast<float>(features)));
    CUDA_OK(cudaMemcpy(d_weights.ptr, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  }
  const cuda::Cublas& blas = cuda::cublas();
  cuda::CublasHandle handle = nullptr;
  KVB_CUDA_CHECK(blas.create(&handle));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  KVB_CUDA_CHECK(blas.set_stream(handle, stream));
  KVB_CUDA_CHECK(blas.set_workspace(handle, d_blas_ws.ptr,
                                    static_cast<size_t>(detail::kCudaCublasWorkspaceBytes)));
  auto gemms = [&] {
    const float alpha = 1.f, beta = 0.f;
    for (int64_t t0 = 0; t0 < T; t0 += block) {
      const int64_t tb = std::min(block, T - t0);
      for (int64_t j = 0; j < o.layers; ++j) {
        const int64_t slot = layer_map[static_cast<size_t>(j)][0];
        KVB_CUDA_CHECK(blas.gemm_ex(
            handle, cuda::kCublasOpN, cuda::kCublasOpN, static_cast<int>(2 * tw),
            static_cast<int>(tb), static_cast<int>(features), &alpha,
            static_cast<const uint16_t*>(d_weights.ptr) + j * features * 2 * tw, CUDA_R_16BF,
            static_cast<int>(2 * tw), static_cast<const uint16_t*>(d_features.ptr) + slot * 2 * sw,
            CUDA_R_16BF, static_cast<int>(ldf), &beta, d_y.ptr, CUDA_R_32F,
            static_cast<int>(2 * tw), cuda::kCublasCompute32F, cuda::kCublasGemmDefault));
      }
    }
  };
  auto fused = [&] { adapter.convert(src_view, o.start_pos, dst_view, stream); };
  auto t_warm = std::chrono::steady_clock::now();
  fused();  // first use: uploads the weights
  CUDA_OK(cudaStreamSynchronize(stream));
  const double first_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_warm).count();
  for (int i = 0; i < o.warmup; ++i) {
    fused();
    gemms();
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  std::printf("setup %.1f s (adapter file, random data); first convert incl. weight upload %.1f ms;"
              " tokens per block %lld\n",
              std::chrono::duration<double>(t_warm - t_setup).count(), first_ms,
              static_cast<long long>(block));

  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  auto time_ms = [&](auto&& work) {
    CUDA_OK(cudaEventRecord(e0, stream));
    work();
    CUDA_OK(cudaEventRecord(e1, stream));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    return static_cast<double>(ms);
  };
  std::vector<double> fused_ms, gemm_ms;
  for (int i = 0; i < o.iters; ++i) {  // interleaved, so drifting clocks hit both
    fused_ms.push_back(time_ms(fused));
    gemm_ms.push_back(time_ms(gemms));
  }
  const double f = median(fused_ms), g = median(gemm_ms);
  std::printf("%-34s %10s %10s %10s\n", "", "median ms", "min ms", "TFLOP/s");
  std::printf("%-34s %10.3f %10.3f %10.1f\n", "(a) fused convert", f,
              *std::min_element(fused_ms.begin(), fused_ms.end()), flops / (f * 1e-3) * 1e-12);
  std::printf("%-34s %10.3f %10.3f %10.1f\n", "(b) same cuBLAS GEMMs alone", g,
              *std::min_element(gemm_ms.begin(), gemm_ms.end()), flops / (g * 1e-3) * 1e-12);
  std::printf("ratio fused / GEMMs alone: %.3f (target <= 1.25: %s)\n", f / g,
              f / g <= 1.25 ? "met" : "MISSED");

  // Check against the CPU convert on the first and the last check_tokens tokens.
  std::vector<uint16_t> host_dst(kv_elems);
  CUDA_OK(cudaMemcpy(host_dst.data(), d_dst.ptr, kv_elems * 2, cudaMemcpyDeviceToHost));
  const KVView got_all = hf_view(host_dst.data(), tgt, T, Device{});
  const KVView src_all = hf_view(const_cast<uint16_t*>(host_src.data()), src, T, Device{});
  const int64_t C = o.check_tokens;
  Errors worst;
  auto t_cpu = std::chrono::steady_clock::now();
  for (int64_t begin : {int64_t{0}, T - C}) {
    std::vector<uint16_t> ref(static_cast<size_t>(2 * o.layers * C * tw));
    const KVView ref_view = KVView::contiguous(ref.data(), tgt.dtype, Device{}, o.layers, C,
                                               o.heads, o.head_dim);
    adapter.convert(src_all.slice_tokens(begin, C), o.start_pos + begin, ref_view);
    const Errors e = compare(got_all.slice_tokens(begin, C), ref_view);
    worst.max_abs = std::max(worst.max_abs, e.max_abs);
    worst.max_scaled = std::max(worst.max_scaled, e.max_scaled);
    worst.finite = worst.finite && e.finite;
  }
  const double tol = 2e-2;
  const bool ok = worst.finite && worst.max_scaled <= tol;
  std::printf("check vs CPU convert, tokens [0, %lld) and [%lld, %lld) (CPU %.1f s): "
              "max abs err %.4g, max err / plane max %.4g (bf16 tolerance %.0e), finite %s: %s\n",
              static_cast<long long>(C), static_cast<long long>(T - C), static_cast<long long>(T),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t_cpu).count(),
              worst.max_abs, worst.max_scaled, tol, worst.finite ? "yes" : "NO",
              ok ? "ok" : "MISMATCH");

  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
  KVB_CUDA_CHECK(blas.destroy(handle));
  CUDA_OK(cudaStreamDestroy(stream));
  return ok;
}

}  // namespace
}  // namespace kvbridge

int main(int argc, char** argv) {
  using namespace kvbridge;
  const Options o = parse(argc, argv);
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "kvbridge_cuda_bench: no CUDA device\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  int runtime = 0, driver = 0;
  CUDA_OK(cudaRuntimeGetVersion(&runtime));
  CUDA_OK(cudaDriverGetVersion(&driver));
  try {
    const cuda::Cublas& blas = cuda::cublas();
    std::printf("device 0: %s, %d SMs, %.1f GiB; CUDA runtime %d, driver %d; cuBLAS from %s; "
                "kvbridge %s\n",
                prop.name, prop.multiProcessorCount,
                static_cast<double>(prop.totalGlobalMem) / (1 << 30), runtime, driver,
                blas.path.c_str(), version());
    bool ok = true;
    for (int64_t s : o.sources) ok = run_case(o, s) && ok;
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvbridge_cuda_bench: %s\n", e.what());
    return 2;
  }
}
