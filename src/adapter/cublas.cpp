#include "src/adapter/cublas.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "kvbridge/error.h"

namespace kvbridge::cuda {
namespace {

std::atomic<const Cublas*> g_loaded{nullptr};

template <typename Fn>
void resolve(void* lib, const char* name, Fn& fn, const std::string& path) {
  void* sym = dlsym(lib, name);
  KVB_CHECK_AS(Unavailable, sym != nullptr,
               "cuBLAS: " << path << " has no entry point " << name << " (need cuBLAS 13)");
  fn = reinterpret_cast<Fn>(sym);
}

Cublas load() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("KVBRIDGE_CUBLAS"); env && *env) {
    candidates.push_back(env);
  } else {
    candidates.push_back(kCublasSoname);
#ifdef KVBRIDGE_CUDA_LIBRARY_DIR
    candidates.push_back(std::string(KVBRIDGE_CUDA_LIBRARY_DIR) + "/" + kCublasSoname);
#endif
    candidates.push_back(std::string("/usr/local/cuda/lib64/") + kCublasSoname);
  }
  std::ostringstream tried;
  for (const std::string& path : candidates) {
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* why = dlerror();
      tried << "\n  " << path << ": " << (why ? why : "not loadable");
      continue;
    }
    Cublas b;
    b.path = path;
    resolve(lib, "cublasCreate_v2", b.create, path);
    resolve(lib, "cublasDestroy_v2", b.destroy, path);
    resolve(lib, "cublasSetStream_v2", b.set_stream, path);
    resolve(lib, "cublasSetWorkspace_v2", b.set_workspace, path);
    resolve(lib, "cublasGemmEx", b.gemm_ex, path);
    resolve(lib, "cublasDgemm_v2", b.dgemm, path);
    resolve(lib, "cublasDsyrk_v2", b.dsyrk, path);
    resolve(lib, "cublasGetStatusString", b.status_string, path);
    return b;  // never dlclose'd: handles may outlive any one caller
  }
  KVB_CHECK_AS(Unavailable, false,
               "cuBLAS (" << kCublasSoname << ") cannot be loaded; the CUDA path (convert, fitting) needs it. "
                          << "Install cuBLAS 13 (e.g. pip install nvidia-cublas) or set "
                          << "KVBRIDGE_CUBLAS to the library's path. Tried:" << tried.str());
  return {};
}

}  // namespace

const Cublas& cublas() {
  // A function-local static is initialised once, thread-safely; if load() throws, the next call
  // runs it again.
  static const Cublas library = load();
  g_loaded.store(&library, std::memory_order_release);
  return library;
}

const Cublas* cublas_if_loaded() noexcept { return g_loaded.load(std::memory_order_acquire); }

void check(CublasStatus status, const char* call, const char* file, int line) {
  if (status == kCublasSuccess) return;
  const Cublas* b = cublas_if_loaded();
  const char* text = b ? b->status_string(status) : nullptr;
  std::ostringstream msg;
  msg << "cuBLAS error " << static_cast<int>(status) << " (" << (text ? text : "unknown status")
      << ") from " << call;
  throw Unavailable(msg.str(), file, line);
}

}  // namespace kvbridge::cuda
