// The avx2 build of the float32 GEMM (ISA flags set for this file in CMakeLists.txt).
#define KVB_GEMM_ISA avx2
#include "src/adapter/gemm_kernel.inc"
