// Closed-form ridge scoring and solving on an eigenbasis (see ridge.h).
#include "src/adapter/ridge.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "src/adapter/lapack.h"

namespace kvbridge::detail {

double layer_sd(double n, const VecD& sx, double raw_trace) {
  const double f = static_cast<double>(sx.size());
  const double second = raw_trace / n / f;
  const double var = second - (sx / n).squaredNorm() / f;
  return std::sqrt(std::max({var, 1e-14 * second, 1e-300}));
}

RidgeBasis make_basis(double n, const VecD& sx, MatD&& xx, double nh, const VecD& sxh,
                      MatD&& xxh, const VecD& sd) {
  RidgeBasis b;
  const int64_t F = sx.size();
  b.n = n;
  b.nh = nh;
  b.mu = sx / n;
  b.sxh = sxh;
  b.sd = sd;
  MatD& cov = xx;
  cov /= n;
  cov.noalias() -= b.mu * b.mu.transpose();
  MatD& covh = xxh;
  covh.noalias() -= b.mu * sxh.transpose();
  covh.noalias() -= sxh * b.mu.transpose();
  covh.noalias() += nh * b.mu * b.mu.transpose();
  const VecD inv = sd.cwiseInverse();
  cov = inv.asDiagonal() * cov * inv.asDiagonal();
  covh = inv.asDiagonal() * covh * inv.asDiagonal();
  std::vector<double> w;
  lapack::syevd(F, cov.data(), w);
  b.Qt = std::move(cov);
  b.lambda = Eigen::Map<const VecD>(w.data(), F).cwiseMax(0.0);
  MatD t(F, F);
  lapack::gemm(false, false, F, F, F, 1, b.Qt.data(), F, covh.data(), F, 0, t.data(), F);
  covh = MatD();
  b.M.resize(F, F);
  lapack::gemm(false, true, F, F, F, 1, t.data(), F, b.Qt.data(), F, 0, b.M.data(), F);
  return b;
}

MapScores score_centered(const RidgeBasis& b, const MatD& g, const MatD& dh, const VecD& e,
                         const VecD& sst, int64_t width, const std::vector<double>& grid) {
  const int64_t F = b.Qt.rows(), C = g.cols(), maps = C / width,
                A = static_cast<int64_t>(grid.size());
  MapScores s;
  s.P.resize(F, C);
  lapack::gemm(false, false, F, C, F, 1, b.Qt.data(), F, g.data(), C, 0, s.P.data(), C);
  MatD qdh(F, C);
  lapack::gemm(false, false, F, C, F, 1, b.Qt.data(), F, dh.data(), C, 0, qdh.data(), C);
  MatD d(F, A);  // d(i, a) = 1 / (lambda_i + grid[a])
  for (int64_t a = 0; a < A; ++a)
    d.col(a) = (b.lambda.array() + grid[static_cast<size_t>(a)]).inverse();
  MatD h(F, F), hd(F, A);
  for (int64_t k = 0; k < maps; ++k) {
    const auto pk = s.P.middleCols(k * width, width);
    const VecD u = pk.cwiseProduct(qdh.middleCols(k * width, width)).rowwise().sum();
    // H = M o (P_k P_k^T): the held-out quadratic term of every ridge in the eigenbasis.
    lapack::syrk_upper(false, F, width, 1, s.P.data() + k * width, C, 0, h.data(), F);
    for (int64_t i = 0; i < F; ++i) {
      h(i, i) *= b.M(i, i);
      for (int64_t c = i + 1; c < F; ++c) h(c, i) = h(i, c) *= b.M(i, c);
    }
    lapack::gemm(false, false, F, A, F, 1, h.data(), F, d.data(), A, 0, hd.data(), A);
    MapFit best;
    for (int64_t a = 0; a < A; ++a) {
      // >= 0 but for rounding, which could otherwise give an R² above 1 (refused on load).
      const double sse = std::max(e[k] - 2 * d.col(a).dot(u) + d.col(a).dot(hd.col(a)), 0.0);
      const double r2 = 1 - sse / sst[k];
      if (r2 > best.r2) {
        best.r2 = r2;
        best.ridge = grid[static_cast<size_t>(a)];
      }
    }
    s.fits.push_back(std::move(best));
  }
  return s;
}

void holdout_totals(const VecD& mu_y, const VecD& syh, const VecD& yyh, double nh,
                    int64_t width, VecD& e, VecD& sst) {
  const int64_t maps = yyh.size();
  e.resize(maps);
  sst.resize(maps);
  for (int64_t k = 0; k < maps; ++k) {
    const auto mu_k = mu_y.segment(k * width, width);
    const auto syh_k = syh.segment(k * width, width);
    e[k] = yyh[k] - 2 * mu_k.dot(syh_k) + nh * mu_k.squaredNorm();
    sst[k] = std::max(yyh[k] - syh_k.squaredNorm() / nh, 1e-300);
  }
}

MapScores score_maps(const RidgeBasis& b, const VecD& sy, const MatD& xy, const VecD& syh,
                     const MatD& xyh, const VecD& yyh, int64_t width,
                     const std::vector<double>& grid) {
  const VecD mu_y = sy / b.n;
  const VecD inv = b.sd.cwiseInverse();
  MatD g = xy / b.n;
  g.noalias() -= b.mu * mu_y.transpose();
  g = inv.asDiagonal() * g;
  MatD dh = xyh;  // held-out cross-scatter about the training means
  dh.noalias() -= b.mu * syh.transpose();
  dh.noalias() -= b.sxh * mu_y.transpose();
  dh.noalias() += b.nh * b.mu * mu_y.transpose();
  dh = inv.asDiagonal() * dh;
  VecD e, sst;
  holdout_totals(mu_y, syh, yyh, b.nh, width, e, sst);
  MapScores s = score_centered(b, g, dh, e, sst, width, grid);
  s.mu_y = mu_y;
  return s;
}

void solve_maps(const RidgeBasis& b, MapScores& s, int64_t width) {
  const int64_t F = b.mu.size();
  MatD dp(F, width);
  const VecD inv = b.sd.cwiseInverse();
  for (size_t k = 0; k < s.fits.size(); ++k) {
    MapFit& f = s.fits[k];
    const int64_t col = static_cast<int64_t>(k) * width;
    dp = (b.lambda.array() + f.ridge).inverse().matrix().asDiagonal() *
         s.P.middleCols(col, width);
    f.weights.resize(F, width);
    lapack::gemm(true, false, F, width, F, 1, b.Qt.data(), F, dp.data(), width, 0,
                         f.weights.data(), width);
    f.weights = inv.asDiagonal() * f.weights;
    f.bias = s.mu_y.segment(col, width) - f.weights.transpose() * b.mu;
  }
}

}  // namespace kvbridge::detail
