// The avx512 build of the float32 GEMM (ISA flags set for this file in CMakeLists.txt).
#define KVB_GEMM_ISA avx512
#include "src/adapter/gemm_kernel.inc"
