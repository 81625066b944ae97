// The per-ISA builds of the CPU GEMM against a float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvbridge/error.h"
#include "src/adapter/gemm.h"
#include "src/core/dtype_convert.h"

namespace kvbridge {
namespace {

struct Case {
  int64_t m, n, k;
};

// C += A * B (or C = A * B) on seeded normal data, with leading dimensions larger than the
// logical widths (strided rows).
struct Problem {
  Case c;
  int64_t lda, ldb, ldc;
  std::vector<float> a, b, cmat, c0;  // c0: C before the call
  Problem(Case shape, std::mt19937_64& rng)
      : c(shape), lda(shape.k + 3), ldb(shape.n + 5), ldc(shape.n + 2),
        a(static_cast<size_t>(shape.m * lda)), b(static_cast<size_t>(shape.k * ldb)),
        cmat(static_cast<size_t>(shape.m * ldc)) {
    std::normal_distribution<float> normal;
    for (float& v : a) v = normal(rng);
    for (float& v : b) v = normal(rng);
    for (float& v : cmat) v = normal(rng);
    c0 = cmat;
  }

  // Every element of C against the float64 sum of the products of round(A) and round(B) (the
  // kernel's inputs), within float32 accumulation error: k * eps * sum |terms| (loose by
  // design); the padding between rows never written.
  void expect_reference(bool accumulate, float (*round)(float), const std::string& what) const {
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < ldc; ++j) {
        const size_t at = static_cast<size_t>(i * ldc + j);
        if (j >= c.n) {
          ASSERT_EQ(cmat[at], c0[at]) << what << " wrote padding at " << i << "," << j;
          continue;
        }
        double ref = accumulate ? c0[at] : 0.0, abs_sum = std::fabs(ref);
        for (int64_t p = 0; p < c.k; ++p) {
          const double term = static_cast<double>(round(a[static_cast<size_t>(i * lda + p)])) *
                              round(b[static_cast<size_t>(p * ldb + j)]);
          ref += term;
          abs_sum += std::fabs(term);
        }
        const double tol = 2.0 * static_cast<double>(c.k + 1) * 1.2e-7 * abs_sum + 1e-30;
        ASSERT_NEAR(cmat[at], ref, tol) << what << " m=" << c.m << " n=" << c.n << " k=" << c.k
                                        << " acc=" << accumulate << " at " << i << "," << j;
      }
    }
  }
};

float exact(float v) { return v; }
float to_bf16(float v) { return detail::bf16_to_float(detail::float_to_bf16(v)); }

class GemmIsa : public ::testing::TestWithParam<const char*> {};

TEST_P(GemmIsa, MatchesFloat64ReferenceOnStridedOddSizes) {
  const char* isa = GetParam();
  std::vector<float> probe(1, 1.0f), out(1, 0.0f);
  try {
    detail::gemm_f32_isa(isa, 1, 1, 1, probe.data(), 1, probe.data(), 1, out.data(), 1, false);
  } catch (const Unavailable&) {
    GTEST_SKIP() << "this CPU cannot run the " << isa << " kernel";
  }
  std::mt19937_64 rng(7);
  // Sizes around and across the kernels' register-block edges, plus degenerate ones.
  for (const Case c : {Case{1, 1, 1}, Case{37, 29, 53}, Case{5, 130, 3}, Case{97, 17, 261},
                       Case{64, 64, 64}, Case{203, 129, 300}}) {
    for (bool accumulate : {false, true}) {
      Problem p(c, rng);
      detail::gemm_f32_isa(isa, c.m, c.n, c.k, p.a.data(), p.lda, p.b.data(), p.ldb,
                           p.cmat.data(), p.ldc, accumulate);
      p.expect_reference(accumulate, exact, isa);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllBuilds, GemmIsa, ::testing::Values("generic", "avx2", "avx512"),
                         [](const auto& info) { return std::string(info.param); });

TEST(GemmDispatch, NamesAKernelThisCpuRuns) {
  const std::string chosen = detail::gemm_isa();
  ASSERT_TRUE(chosen == "generic" || chosen == "avx2" || chosen == "avx512") << chosen;
  std::vector<float> one(1, 2.0f), out(1, 0.0f);
  EXPECT_NO_THROW(
      detail::gemm_f32_isa(chosen.c_str(), 1, 1, 1, one.data(), 1, one.data(), 1, out.data(), 1,
                           false));
  EXPECT_EQ(out[0], 4.0f);
}

TEST(GemmDispatch, UnknownKernelIsInvalidArgument) {
  std::vector<float> one(1, 1.0f), out(1, 0.0f);
  EXPECT_THROW(detail::gemm_f32_isa("sse9", 1, 1, 1, one.data(), 1, one.data(), 1, out.data(), 1,
                                    false),
               InvalidArgument);
}

// Whether the named bfloat16 kernel runs here: a 1 x 1 product, Unavailable otherwise.
bool bf16_kernel_runs(const char* kernel) {
  std::vector<float> one(1, 1.0f), out(1, 0.0f);
  try {
    const detail::Bf16PackedB packed = detail::pack_b_bf16(one.data(), 1, 1, 1);
    detail::Bf16TiledA tiled;
    detail::tile_a_bf16(1, 1, one.data(), 1, tiled);
    detail::gemm_bf16_kernel(kernel, tiled, packed, out.data(), 1);
  } catch (const Unavailable&) {
    return false;
  }
  return true;
}

class GemmBf16 : public testing::TestWithParam<const char*> {};

// C += bf16(A) * bf16(B) against float64 products of the same rounded values: only the float32
// accumulation may differ. Sizes cross the 16-row, 16-column and 32-deep tile edges, the AMX
// kernel's 2 x 2 tile blocks and the AVX-512 kernel's 8 x 32 blocks; strided A and C; C's
// padding between rows must stay untouched.
TEST_P(GemmBf16, MatchesFloat64ReferenceOfRoundedInputsOnStridedOddSizes) {
  if (!bf16_kernel_runs(GetParam())) GTEST_SKIP() << "this CPU does not run " << GetParam();
  std::mt19937_64 rng(11);
  for (const Case c : {Case{1, 1, 1}, Case{37, 29, 53}, Case{16, 16, 32}, Case{33, 48, 64},
                       Case{5, 130, 3}, Case{97, 17, 261}, Case{9, 33, 31},
                       Case{203, 256, 1024}}) {
    Problem p(c, rng);
    const detail::Bf16PackedB packed = detail::pack_b_bf16(p.b.data(), p.ldb, c.k, c.n);
    detail::Bf16TiledA tiled;
    detail::tile_a_bf16(c.m, c.k, p.a.data(), p.lda, tiled);
    detail::gemm_bf16_kernel(GetParam(), tiled, packed, p.cmat.data(), p.ldc);
    p.expect_reference(/*accumulate=*/true, to_bf16, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, GemmBf16, testing::Values("amx-bf16", "avx512-bf16"),
                         [](const testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param[0] == 'a' && info.param[1] == 'm'
                                                  ? "amx"
                                                  : "avx512");
                         });

TEST(GemmBf16Dispatch, UnavailableWithoutAKernelAndBadShapesRefused) {
  std::vector<float> one(6, 1.0f), out(4, 0.0f);
  const detail::Bf16PackedB packed = detail::pack_b_bf16(one.data(), 2, 2, 2);
  EXPECT_THROW(detail::pack_b_bf16(one.data(), 1, 2, 2), InvalidArgument);
  detail::Bf16TiledA tiled;
  EXPECT_THROW(detail::gemm_bf16_kernel("sse9-bf16", tiled, packed, out.data(), 2),
               InvalidArgument);
  if (detail::bf16_gemm_kernel() == nullptr) {
    if (!bf16_kernel_runs("avx512-bf16"))
      EXPECT_THROW(detail::tile_a_bf16(2, 2, one.data(), 2, tiled), Unavailable);
    EXPECT_THROW(detail::gemm_bf16(tiled, packed, out.data(), 2), Unavailable);
    return;
  }
  EXPECT_THROW(detail::tile_a_bf16(2, 2, one.data(), 1, tiled), InvalidArgument);
  detail::tile_a_bf16(2, 3, one.data(), 3, tiled);
  EXPECT_THROW(detail::gemm_bf16(tiled, packed, out.data(), 2), InvalidArgument);  // k 3 vs 2
  detail::tile_a_bf16(2, 2, one.data(), 2, tiled);
  EXPECT_THROW(detail::gemm_bf16(tiled, packed, out.data(), 1), InvalidArgument);
  detail::gemm_bf16(tiled, packed, out.data(), 2);
  EXPECT_EQ(out, std::vector<float>(4, 2.0f));
}

}  // namespace
}  // namespace kvbridge
