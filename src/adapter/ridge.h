// Closed-form ridge regression with the strength chosen by held-out R², for the fitter: one
// eigendecomposition of a feature set's covariance scores every ridge strength of every output
// map (src/adapter/fitter.cpp builds the sums these take and decides which feature sets to try).
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvbridge::detail {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VecD = Eigen::VectorXd;

// One map's ridge fit: the held-out R² and ridge strength chosen, and (once solved, solve_maps)
// its weights and bias.
struct MapFit {
  double r2 = -std::numeric_limits<double>::infinity();
  double ridge = 0;
  MatD weights;  // [F, O], only when solved
  VecD bias;     // [O]
};

// What ridge fits of any output need from one feature set: the eigenbasis of the training
// covariance and the held-out covariance in that basis, both of the standardised features (each
// feature divided by its sd entry: every source layer scaled to mean variance 1, so that ridge
// strengths are relative to each layer's own variance). One eigendecomposition serves every
// ridge strength and every output: W(r) = Q diag(1 / (lambda + r)) Q^T G.
struct RidgeBasis {
  double n = 0, nh = 0;  // training / held-out token counts
  VecD mu, sxh;          // training mean, held-out sum [F] (of the features as they are)
  VecD sd;               // per feature: the divisor that standardises it [F]
  MatD Qt;               // eigenvectors as rows [F, F] (Q^T)
  VecD lambda;           // eigenvalues, clamped at 0
  MatD M;                // Q^T covh Q, covh the held-out scatter about the training mean
};

// A source layer's divisor: the square root of its mean feature variance, floored relative to
// the mean raw second moment so that a constant layer does not blow up rounding noise.
double layer_sd(double n, const VecD& sx, double raw_trace);

// xx and xxh are raw sums over tokens of x x^T (full symmetric), sx and sxh of x. Consumes xx
// and xxh (their storage is reused).
RidgeBasis make_basis(double n, const VecD& sx, MatD&& xx, double nh, const VecD& sxh,
                      MatD&& xxh, const VecD& sd);

// The maps of one basis as score_centered scored them, with what solve_maps needs for their
// weights.
struct MapScores {
  VecD mu_y;  // training mean of the outputs
  MatD P;     // Q^T G [F, maps * width], G the standardised training cross-covariance
  std::vector<MapFit> fits;
};

// Held-out scores of ridge maps on one basis, every ridge in `grid` by held-out R² in closed
// form. Map k owns columns [k * width, (k + 1) * width) of the centred, standardised training
// cross-covariance g [F, maps * width] and held-out cross-scatter dh (about the training means);
// e[k] is its held-out sum of squares about the prediction without features and sst[k] the one
// about the held-out mean. Keeps what solve_maps needs for the best one's weights.
MapScores score_centered(const RidgeBasis& b, const MatD& g, const MatD& dh, const VecD& e,
                         const VecD& sst, int64_t width, const std::vector<double>& grid);

// The held-out sums of squares of `maps` maps of `width` outputs about the training mean mu_y
// (e) and about their own mean (sst), from the raw held-out sums syh and sums of squares yyh.
void holdout_totals(const VecD& mu_y, const VecD& syh, const VecD& yyh, double nh,
                    int64_t width, VecD& e, VecD& sst);

// score_centered from raw sums: sy [maps * width] and xy [F, maps * width] training sums, syh,
// xyh and yyh [maps] (sums of squares) held-out ones.
MapScores score_maps(const RidgeBasis& b, const VecD& sy, const MatD& xy, const VecD& syh,
                     const MatD& xyh, const VecD& yyh, int64_t width,
                     const std::vector<double>& grid);

// The weights and biases of the scored maps at their chosen ridge strengths, for the features as
// they are (not standardised).
void solve_maps(const RidgeBasis& b, MapScores& s, int64_t width);

}  // namespace kvbridge::detail
