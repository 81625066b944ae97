// The per-ISA builds of the CPU GEMM against a float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvbridge/error.h"
#include "src/adapter/gemm.h"

namespace kvbridge {
namespace {

struct Case {
  int64_t m, n, k;
};

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
  std::normal_distribution<float> normal;
  // Sizes around and across the kernels' register-block edges, plus degenerate ones.
  for (const Case c : {Case{1, 1, 1}, Case{37, 29, 53}, Case{5, 130, 3}, Case{97, 17, 261},
                       Case{64, 64, 64}, Case{203, 129, 300}}) {
    for (bool accumulate : {false, true}) {
      // Leading dimensions larger than the logical widths: strided rows.
      const int64_t lda = c.k + 3, ldb = c.n + 5, ldc = c.n + 2;
      std::vector<float> a(static_cast<size_t>(c.m * lda)), b(static_cast<size_t>(c.k * ldb)),
          cmat(static_cast<size_t>(c.m * ldc));
      for (float& v : a) v = normal(rng);
      for (float& v : b) v = normal(rng);
      for (float& v : cmat) v = normal(rng);
      const std::vector<float> c0 = cmat;
      detail::gemm_f32_isa(isa, c.m, c.n, c.k, a.data(), lda, b.data(), ldb, cmat.data(), ldc,
                           accumulate);
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
          const size_t at = static_cast<size_t>(i * ldc + j);
          if (j >= c.n) {  // padding between rows is never written
            ASSERT_EQ(cmat[at], c0[at]) << isa << " wrote padding at " << i << "," << j;
            continue;
          }
          double ref = accumulate ? c0[at] : 0.0, abs_sum = std::fabs(ref);
          for (int64_t p = 0; p < c.k; ++p) {
            const double term = static_cast<double>(a[static_cast<size_t>(i * lda + p)]) *
                                b[static_cast<size_t>(p * ldb + j)];
            ref += term;
            abs_sum += std::fabs(term);
          }
          // float32 accumulation error bound: k * eps * sum |terms| (loose by design).
          const double tol = 2.0 * static_cast<double>(c.k + 1) * 1.2e-7 * abs_sum + 1e-30;
          ASSERT_NEAR(cmat[at], ref, tol)
              << isa << " m=" << c.m << " n=" << c.n << " k=" << c.k << " acc=" << accumulate;
        }
      }
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

}  // namespace
}  // namespace kvbridge
