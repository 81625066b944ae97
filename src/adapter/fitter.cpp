#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"
#include "src/adapter/adapter_impl.h"
#include "src/adapter/fitter_cuda.h"
#include "src/adapter/lapack.h"
#include "src/adapter/numeric.h"
#include "src/adapter/parallel.h"

namespace kvbridge {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VecD = Eigen::VectorXd;

namespace {

// Target outputs are projected on this many seeded Gaussian directions in the probe pass: enough
// to rank source layers, and it keeps the probe's cross products small.
constexpr int64_t kProbeSketchWidth = 32;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Un-rotated (if asked, with that layer's own frequencies) K then V of one layer, as float64
// rows [tokens, 2 * heads * dim].
MatD unrotated_rows(const ModelSpec& spec, const detail::LayerInvFreq& inv_freq, bool rope_aware,
                    const KVView& kv, int64_t layer, int64_t start_pos) {
  const int64_t T = kv.tokens(), W = spec.num_kv_heads * spec.head_dim;
  std::vector<float> buf(static_cast<size_t>(T * 2 * W));
  for (int kind = 0; kind < 2; ++kind)
    detail::load_plane(kv.plane(layer, static_cast<KVView::Kind>(kind)), kv.dtype(), T,
                       spec.num_kv_heads, spec.head_dim, buf.data() + kind * W, 2 * W);
  MatD out = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
                 buf.data(), T, 2 * W)
                 .cast<double>();
  KVB_CHECK(out.allFinite(), "layer " << layer << " of the KV holds NaN or infinite values");
  if (rope_aware)
    detail::apply_rope(spec, inv_freq[layer], start_pos, /*inverse=*/true, T, spec.num_kv_heads,
                       out.data(), 2 * W);
  return out;
}

struct MapFit {
  double r2 = -std::numeric_limits<double>::infinity();
  double ridge = 0;
  MatD weights;  // [F, O], only when solved
  VecD bias;     // [O]
};

// What ridge fits of any output need from one feature set: the eigenbasis of the training
// covariance and the held-out covariance in that basis. One eigendecomposition serves every
// ridge strength and every output: W(r) = Q diag(1 / (lambda + r)) Q^T G.
struct RidgeBasis {
  double n = 0, nh = 0;  // training / held-out token counts
  VecD mu, sxh;          // training mean, held-out sum [F]
  MatD Qt;               // eigenvectors as rows [F, F] (Q^T)
  VecD lambda;           // eigenvalues, clamped at 0
  double scale = 1;      // mean feature variance: ridge strengths are relative to it
  MatD M;                // Q^T covh Q, covh the held-out scatter about the training mean
};

// xx and xxh are raw sums over tokens of x x^T (full symmetric), sx and sxh of x. Consumes xx
// and xxh (their storage is reused).
RidgeBasis make_basis(double n, const VecD& sx, MatD&& xx, double nh, const VecD& sxh,
                      MatD&& xxh) {
  RidgeBasis b;
  const int64_t F = sx.size();
  b.n = n;
  b.nh = nh;
  b.mu = sx / n;
  b.sxh = sxh;
  MatD& cov = xx;
  cov /= n;
  cov.noalias() -= b.mu * b.mu.transpose();
  b.scale = std::max(cov.trace() / static_cast<double>(F), 1e-300);
  MatD& covh = xxh;
  covh.noalias() -= b.mu * sxh.transpose();
  covh.noalias() -= sxh * b.mu.transpose();
  covh.noalias() += nh * b.mu * b.mu.transpose();
  std::vector<double> w;
  detail::lapack::syevd(F, cov.data(), w);
  b.Qt = std::move(cov);
  b.lambda = Eigen::Map<const VecD>(w.data(), F).cwiseMax(0.0);
  MatD t(F, F);
  detail::lapack::gemm(false, false, F, F, F, 1, b.Qt.data(), F, covh.data(), F, 0, t.data(), F);
  covh = MatD();
  b.M.resize(F, F);
  detail::lapack::gemm(false, true, F, F, F, 1, t.data(), F, b.Qt.data(), F, 0, b.M.data(), F);
  return b;
}

// Held-out scores of `maps` ridge maps of `width` outputs each on one basis: sy [maps * width]
// and xy [F, maps * width] are raw training sums, syh, xyh and yyh [maps] (sums of squares)
// held-out ones; map k owns columns [k * width, (k + 1) * width). Every ridge in `grid` is
// scored by held-out R² in closed form; keeps what solve_maps needs for the best one's weights.
struct MapScores {
  VecD mu_y;  // training mean of the outputs
  MatD P;     // Q^T G [F, maps * width], G the training cross-covariance
  std::vector<MapFit> fits;
};

MapScores score_maps(const RidgeBasis& b, const VecD& sy, const MatD& xy, const VecD& syh,
                     const MatD& xyh, const VecD& yyh, int64_t width,
                     const std::vector<double>& grid) {
  const int64_t F = b.mu.size(), C = xy.cols(), maps = C / width,
                A = static_cast<int64_t>(grid.size());
  MapScores s;
  s.mu_y = sy / b.n;
  MatD g = xy / b.n;
  g.noalias() -= b.mu * s.mu_y.transpose();
  s.P.resize(F, C);
  detail::lapack::gemm(false, false, F, C, F, 1, b.Qt.data(), F, g.data(), C, 0, s.P.data(), C);
  MatD& dh = g;  // held-out cross-scatter about the training means
  dh = xyh;
  dh.noalias() -= b.mu * syh.transpose();
  dh.noalias() -= b.sxh * s.mu_y.transpose();
  dh.noalias() += b.nh * b.mu * s.mu_y.transpose();
  MatD qdh(F, C);
  detail::lapack::gemm(false, false, F, C, F, 1, b.Qt.data(), F, dh.data(), C, 0, qdh.data(), C);
  MatD d(F, A);  // d(i, a) = 1 / (lambda_i + grid[a] * scale)
  for (int64_t a = 0; a < A; ++a)
    d.col(a) = (b.lambda.array() + grid[static_cast<size_t>(a)] * b.scale).inverse();
  MatD h(F, F), hd(F, A);
  for (int64_t k = 0; k < maps; ++k) {
    const auto pk = s.P.middleCols(k * width, width);
    const VecD u = pk.cwiseProduct(qdh.middleCols(k * width, width)).rowwise().sum();
    // H = M o (P_k P_k^T): the held-out quadratic term of every ridge in the eigenbasis.
    detail::lapack::syrk_upper(false, F, width, 1, s.P.data() + k * width, C, 0, h.data(), F);
    for (int64_t i = 0; i < F; ++i) {
      h(i, i) *= b.M(i, i);
      for (int64_t c = i + 1; c < F; ++c) h(c, i) = h(i, c) *= b.M(i, c);
    }
    detail::lapack::gemm(false, false, F, A, F, 1, h.data(), F, d.data(), A, 0, hd.data(), A);
    const auto mu_k = s.mu_y.segment(k * width, width);
    const auto syh_k = syh.segment(k * width, width);
    const double e = yyh[k] - 2 * mu_k.dot(syh_k) + b.nh * mu_k.squaredNorm();
    const double sst = std::max(yyh[k] - syh_k.squaredNorm() / b.nh, 1e-300);
    MapFit best;
    for (int64_t a = 0; a < A; ++a) {
      // >= 0 but for rounding, which could otherwise give an R² above 1 (refused on load).
      const double sse = std::max(e - 2 * d.col(a).dot(u) + d.col(a).dot(hd.col(a)), 0.0);
      const double r2 = 1 - sse / sst;
      if (r2 > best.r2) {
        best.r2 = r2;
        best.ridge = grid[static_cast<size_t>(a)];
      }
    }
    s.fits.push_back(std::move(best));
  }
  return s;
}

// The weights and biases of the scored maps at their chosen ridge strengths.
void solve_maps(const RidgeBasis& b, MapScores& s, int64_t width) {
  const int64_t F = b.mu.size();
  MatD dp(F, width);
  for (size_t k = 0; k < s.fits.size(); ++k) {
    MapFit& f = s.fits[k];
    const int64_t col = static_cast<int64_t>(k) * width;
    dp = (b.lambda.array() + f.ridge * b.scale).inverse().matrix().asDiagonal() *
         s.P.middleCols(col, width);
    f.weights.resize(F, width);
    detail::lapack::gemm(true, false, F, width, F, 1, b.Qt.data(), F, dp.data(), width, 0,
                         f.weights.data(), width);
    f.bias = s.mu_y.segment(col, width) - f.weights.transpose() * b.mu;
  }
}

MatD symmetric_from_upper(const MatD& upper) { return upper.selfadjointView<Eigen::Upper>(); }

// Which source layers feed which target layer, and the float64 blocks that takes: per source
// layer ("slot") its feature sums, per pair of slots that share a target layer their cross
// products, per (target layer, candidate) the features against that layer's outputs.
struct Plan {
  std::vector<std::vector<int64_t>> candidates;  // [target layer] -> source layers
  std::vector<int64_t> slots;                    // union of the candidates, ascending
  std::vector<int64_t> block_of;                 // [a * slots + b], a <= b -> block or -1
  std::vector<std::pair<int64_t, int64_t>> blocks;

  int64_t slot(int64_t layer) const {
    return std::lower_bound(slots.begin(), slots.end(), layer) - slots.begin();
  }
  int64_t block(int64_t a, int64_t b) const {
    return block_of[static_cast<size_t>(std::min(a, b) * static_cast<int64_t>(slots.size()) +
                                        std::max(a, b))];
  }
};

Plan make_plan(std::vector<std::vector<int64_t>> candidates) {
  Plan p;
  for (const auto& c : candidates) p.slots.insert(p.slots.end(), c.begin(), c.end());
  std::sort(p.slots.begin(), p.slots.end());
  p.slots.erase(std::unique(p.slots.begin(), p.slots.end()), p.slots.end());
  const int64_t S = static_cast<int64_t>(p.slots.size());
  p.block_of.assign(static_cast<size_t>(S * S), -1);
  for (const auto& c : candidates)
    for (int64_t l : c)
      for (int64_t m : c) {
        const int64_t a = p.slot(l), b = p.slot(m);
        if (a > b) continue;
        int64_t& k = p.block_of[static_cast<size_t>(a * S + b)];
        if (k < 0) {
          k = static_cast<int64_t>(p.blocks.size());
          p.blocks.emplace_back(a, b);
        }
      }
  p.candidates = std::move(candidates);
  return p;
}

// Bytes of the train and held-out accumulators a plan takes: layer_features Fl, 2 * outputs
// per target layer (keys and values).
double plan_bytes(const Plan& p, int64_t Fl, int64_t outputs) {
  double values = static_cast<double>(p.slots.size()) * Fl +
                  static_cast<double>(p.blocks.size()) * Fl * Fl;
  for (const auto& c : p.candidates)
    values += static_cast<double>(c.size()) * Fl * 2 * outputs + 2.0 * outputs + 2;
  return 2 * 8 * values;
}

// Raw sums over one token split for a plan (see Plan).
struct BlockMoments {
  int64_t n = 0;
  std::vector<VecD> sx;                  // [slot] -> [Fl]
  std::vector<MatD> xx;                  // [block] -> [Fl, Fl]; diagonal blocks upper only
  std::vector<VecD> sy;                  // [target layer] -> [2 * O], keys then values
  std::vector<std::array<double, 2>> yy;  // [target layer] -> sums of squares
  std::vector<std::vector<MatD>> xy;     // [target layer][candidate] -> [Fl, 2 * O]

  void init(const Plan& p, int64_t Fl, int64_t outputs) {
    sx.assign(p.slots.size(), VecD::Zero(Fl));
    xx.assign(p.blocks.size(), MatD::Zero(Fl, Fl));
    sy.assign(p.candidates.size(), VecD::Zero(2 * outputs));
    yy.assign(p.candidates.size(), {0.0, 0.0});
    xy.clear();
    for (const auto& c : p.candidates) xy.emplace_back(c.size(), MatD::Zero(Fl, 2 * outputs));
  }
};

// Raw sums over one token split for the probe pass: each source layer alone, against every
// target map's outputs projected on `sketch_width` seeded Gaussian directions.
struct ProbeMoments {
  int64_t n = 0;
  std::vector<VecD> sx;  // [source layer] -> [Fl]
  std::vector<MatD> xx;  // [source layer] -> [Fl, Fl], upper triangle
  std::vector<MatD> xz;  // [source layer] -> [Fl, 2 * target layers * width], map (j, kind) at
                         // columns (2 j + kind) * width
  VecD sz;               // [2 * target layers * width]
  VecD zz;               // [2 * target layers]: sums of squares per map

  void init(int64_t source_layers, int64_t Fl, int64_t maps, int64_t width) {
    sx.assign(static_cast<size_t>(source_layers), VecD::Zero(Fl));
    xx.assign(static_cast<size_t>(source_layers), MatD::Zero(Fl, Fl));
    xz.assign(static_cast<size_t>(source_layers), MatD::Zero(Fl, maps * width));
    sz = VecD::Zero(maps * width);
    zz = VecD::Zero(maps);
  }
  static double bytes(int64_t source_layers, int64_t Fl, int64_t maps, int64_t width) {
    const double L = static_cast<double>(source_layers);
    return 2 * 8 * (L * Fl + L * Fl * Fl + L * Fl * maps * width + maps * width + maps);
  }
};

// Seeded Gaussian sketch [outputs, width] / sqrt(width), the same on every platform.
MatD gaussian_sketch(int64_t outputs, int64_t width, uint64_t seed) {
  MatD r(outputs, width);
  uint64_t state = splitmix64(seed ^ 0x6b76627269646765ull);
  const double two_pi = 6.28318530717958647692;
  for (int64_t i = 0; i < r.size(); ++i) {
    state = splitmix64(state);
    const double u1 = (static_cast<double>(state >> 11) + 0.5) * 0x1.0p-53;
    state = splitmix64(state);
    const double u2 = static_cast<double>(state >> 11) * 0x1.0p-53;
    r.data()[i] = std::sqrt(-2 * std::log(u1)) * std::cos(two_pi * u2);
  }
  return r / std::sqrt(static_cast<double>(width));
}

}  // namespace

void check_pair(const ModelSpec& source, const ModelSpec& target, const KVView& src,
                const KVView& dst, const char* src_name, const char* dst_name, bool same_tokens) {
  src.check_matches(source, src_name);
  dst.check_matches(target, dst_name);
  KVB_CHECK(!same_tokens || src.tokens() == dst.tokens(),
            dst_name << " holds " << dst.tokens() << " tokens but " << src_name << " holds "
                     << src.tokens());
  KVB_CHECK(src.device().type == DeviceType::kCPU && dst.device().type == DeviceType::kCPU,
            src_name << " and " << dst_name << " must be CPU views here");
}


struct AdapterFitter::Impl {
  ModelSpec source, target;
  FitOptions options;
  detail::LayerInvFreq source_inv_freq, target_inv_freq;
  int64_t layer_features = 0;  // Fl = 2 * source kv_heads * head_dim
  int64_t outputs = 0;         // O = target kv_heads * head_dim
  int passes = 1, pass = 0;
  uint64_t tokens_seen = 0;    // restarts each pass, so passes over the same data split alike
  // Probe pass (pass 0 of 2): every source layer alone against sketched target outputs.
  int64_t sketch_width = 0;
  MatD sketch;  // [O, sketch_width]
  // mutable: in a CUDA fitter the cross products accumulate on the device, and these host
  // matrices are a copy that fit() refreshes from it (the sums and counts are always here).
  mutable ProbeMoments probe_train, probe_held;
  // Final pass: the plan's blocks.
  Plan plan;
  mutable BlockMoments train, held;
  // Where the samples live: set by the first add(); a fitter takes all of them from one device.
  std::optional<Device> sample_device;
  // This pass's device accumulators of a CUDA fitter, created by its first add() of the pass.
  detail::FitterDevicePtr device_products;
  bool device_failed = false;  // a CUDA failure inside add() left them incomplete

  bool probing() const { return passes == 2 && pass == 0; }

  // The current pass's cross-product accumulators, in a fixed order.
  std::vector<detail::FitterAccumulator> product_accumulators() const {
    std::vector<detail::FitterAccumulator> out;
    const auto add = [&](MatD& a) { out.push_back({a.data(), static_cast<int64_t>(a.size())}); };
    for (ProbeMoments* p : {&probe_train, &probe_held}) {
      for (MatD& a : p->xx) add(a);
      for (MatD& a : p->xz) add(a);
    }
    for (BlockMoments* b : {&train, &held}) {
      for (MatD& a : b->xx) add(a);
      for (auto& per_layer : b->xy)
        for (MatD& a : per_layer) add(a);
    }
    return out;
  }

  // Brings a CUDA fitter's device products into the host accumulators (fit() and next_pass()
  // solve on the host).
  void sync_from_device() const {
    KVB_CHECK_AS(Unavailable, !device_failed,
                 "AdapterFitter: a CUDA failure during add() left the accumulators incomplete; "
                 "start a new fitter");
    if (device_products) detail::fitter_device_download(*device_products);
  }
  int64_t maps() const { return 2 * target.num_layers; }

  double probe_bytes() const {
    return ProbeMoments::bytes(source.num_layers, layer_features, maps(), sketch_width);
  }

  void start_final_pass(Plan p) {
    device_products.reset();  // the probe's device accumulators go first too
    // The probe's accumulators go first, so the two passes' never coexist.
    probe_train = ProbeMoments();
    probe_held = ProbeMoments();
    sketch = MatD();
    plan = std::move(p);
    train.init(plan, layer_features, outputs);
    held.init(plan, layer_features, outputs);
    tokens_seen = 0;
  }

  // The training and held-out sums of the features of source layers S (ascending, a subset of
  // one target layer's candidates), gathered from the plan's blocks.
  struct SetSums {
    VecD sx, sxh;
    MatD xx, xxh;  // full symmetric
  };
  SetSums gather(const std::vector<int64_t>& S) const {
    const int64_t Fl = layer_features, F = static_cast<int64_t>(S.size()) * Fl;
    SetSums g{VecD(F), VecD(F), MatD(F, F), MatD(F, F)};
    for (size_t a = 0; a < S.size(); ++a) {
      const int64_t sa = plan.slot(S[a]), ra = static_cast<int64_t>(a) * Fl;
      g.sx.segment(ra, Fl) = train.sx[static_cast<size_t>(sa)];
      g.sxh.segment(ra, Fl) = held.sx[static_cast<size_t>(sa)];
      for (size_t b = a; b < S.size(); ++b) {
        const int64_t rb = static_cast<int64_t>(b) * Fl;
        const size_t k = static_cast<size_t>(plan.block(sa, plan.slot(S[b])));
        if (a == b) {
          g.xx.block(ra, ra, Fl, Fl) = symmetric_from_upper(train.xx[k]);
          g.xxh.block(ra, ra, Fl, Fl) = symmetric_from_upper(held.xx[k]);
        } else {  // S ascending, so slot a < slot b: the block is X_a^T X_b
          g.xx.block(ra, rb, Fl, Fl) = train.xx[k];
          g.xx.block(rb, ra, Fl, Fl) = train.xx[k].transpose();
          g.xxh.block(ra, rb, Fl, Fl) = held.xx[k];
          g.xxh.block(rb, ra, Fl, Fl) = held.xx[k].transpose();
        }
      }
    }
    return g;
  }

  RidgeBasis basis(const std::vector<int64_t>& S) const {
    SetSums g = gather(S);
    return make_basis(static_cast<double>(train.n), g.sx, std::move(g.xx),
                      static_cast<double>(held.n), g.sxh, std::move(g.xxh));
  }

  // Target layer j's K and V maps (columns [0, O) and [O, 2 O)) on the basis of layers S.
  MapScores score(int64_t j, const std::vector<int64_t>& S, const RidgeBasis& b) const {
    const int64_t Fl = layer_features, O = outputs, F = static_cast<int64_t>(S.size()) * Fl;
    const size_t jj = static_cast<size_t>(j);
    const auto& C = plan.candidates[jj];
    MatD xy(F, 2 * O), xyh(F, 2 * O);
    for (size_t a = 0; a < S.size(); ++a) {
      const size_t ca = static_cast<size_t>(std::find(C.begin(), C.end(), S[a]) - C.begin());
      xy.middleRows(static_cast<int64_t>(a) * Fl, Fl) = train.xy[jj][ca];
      xyh.middleRows(static_cast<int64_t>(a) * Fl, Fl) = held.xy[jj][ca];
    }
    const VecD yyh = Eigen::Vector2d(held.yy[jj][0], held.yy[jj][1]);
    return score_maps(b, train.sy[jj], xy, held.sy[jj], xyh, yyh, O, options.ridge_grid);
  }

  // A target layer's maps from one set of source layers, with float32 weights as the adapter
  // keeps them.
  struct Choice {
    std::vector<int64_t> layers;
    std::array<MapFit, 2> fits;  // K, V: ridge and held-out R² (weights moved out)
    std::array<std::vector<float>, 2> weights, bias;
    double score = -std::numeric_limits<double>::infinity();  // mean held-out R² of K and V
    int64_t rank = -1;  // position among the trials it won against; -1: none yet
  };

  // One selection round: trials[j] lists target layer j's candidate sets, in order of preference
  // on ties. Every distinct set is factorised once (sets that several target layers try are
  // shared); independent sets run on separate threads. Returns per target layer the trial with
  // the best score (the first of equal ones), with its weights; rank -1 where it had none.
  std::vector<Choice> best_of(const std::vector<std::vector<std::vector<int64_t>>>& trials) const {
    std::map<std::vector<int64_t>, std::vector<std::pair<int64_t, int64_t>>> users;
    for (size_t j = 0; j < trials.size(); ++j)
      for (size_t i = 0; i < trials[j].size(); ++i)
        users[trials[j][i]].emplace_back(static_cast<int64_t>(j), static_cast<int64_t>(i));
    std::vector<const std::pair<const std::vector<int64_t>,
                                std::vector<std::pair<int64_t, int64_t>>>*>
        sets;
    for (const auto& e : users) sets.push_back(&e);
    std::vector<Choice> best(trials.size());
    std::mutex mutex;
    const auto order = [](double score) { return std::isnan(score) ? -HUGE_VAL : score; };
    const auto beats = [&](int64_t j, double score, int64_t rank) {
      const Choice& b = best[static_cast<size_t>(j)];
      return b.rank < 0 || order(score) > order(b.score) ||
             (order(score) == order(b.score) && rank < b.rank);
    };
    const auto consider = [&](const std::vector<int64_t>& S, const RidgeBasis& b, int64_t j,
                              int64_t rank) {
      MapScores s = score(j, S, b);
      const double sc = 0.5 * (s.fits[0].r2 + s.fits[1].r2);
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (!beats(j, sc, rank)) return;
      }
      solve_maps(b, s, outputs);
      Choice c;
      c.layers = S;
      c.score = sc;
      c.rank = rank;
      for (size_t kind = 0; kind < 2; ++kind) {
        MapFit& f = s.fits[kind];
        c.weights[kind].resize(static_cast<size_t>(f.weights.size()));
        Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
            c.weights[kind].data(), f.weights.rows(), f.weights.cols()) = f.weights.cast<float>();
        c.bias[kind].resize(static_cast<size_t>(f.bias.size()));
        Eigen::Map<Eigen::VectorXf>(c.bias[kind].data(), f.bias.size()) = f.bias.cast<float>();
        f.weights = MatD();
        f.bias = VecD();
        c.fits[kind] = std::move(f);
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (beats(j, sc, rank)) best[static_cast<size_t>(j)] = std::move(c);
    };
    if (sets.size() == 1) {  // one factorisation on every thread, then its users in parallel
      const RidgeBasis b = basis(sets[0]->first);
      const auto& u = sets[0]->second;
      detail::parallel_for(static_cast<int64_t>(u.size()), [&](int64_t i) {
        consider(sets[0]->first, b, u[static_cast<size_t>(i)].first,
                 u[static_cast<size_t>(i)].second);
      });
    } else {
      detail::parallel_for(static_cast<int64_t>(sets.size()), [&](int64_t i) {
        const auto& [S, u] = *sets[static_cast<size_t>(i)];
        const RidgeBasis b = basis(S);
        for (const auto& [j, rank] : u) consider(S, b, j, rank);
      });
    }
    return best;
  }

  // The layers and maps fit() uses for every target layer.
  std::vector<Choice> select() const {
    const int64_t Lt = target.num_layers;
    std::vector<std::vector<std::vector<int64_t>>> trials(static_cast<size_t>(Lt));
    if (options.selection != FitOptions::Selection::kAuto) {
      for (int64_t j = 0; j < Lt; ++j)
        trials[static_cast<size_t>(j)] = {plan.candidates[static_cast<size_t>(j)]};
      return best_of(trials);
    }
    // Greedy forward selection on held-out R², never on in-sample fit (which only rises), run
    // for all target layers a round at a time so that shared sets are factorised once.
    std::vector<Choice> chosen(static_cast<size_t>(Lt));
    std::vector<bool> open(static_cast<size_t>(Lt), true);
    for (;;) {
      bool any = false;
      for (int64_t j = 0; j < Lt; ++j) {
        const size_t jj = static_cast<size_t>(j);
        trials[jj].clear();
        const auto& have = chosen[jj].layers;
        if (!open[jj] || static_cast<int64_t>(have.size()) >= options.max_source_layers) {
          open[jj] = false;
          continue;
        }
        for (int64_t l : plan.candidates[jj]) {
          if (std::find(have.begin(), have.end(), l) != have.end()) continue;
          std::vector<int64_t> trial = have;
          trial.insert(std::lower_bound(trial.begin(), trial.end(), l), l);
          trials[jj].push_back(std::move(trial));
        }
        if (trials[jj].empty())
          open[jj] = false;
        else
          any = true;
      }
      if (!any) break;
      std::vector<Choice> best = best_of(trials);
      for (size_t jj = 0; jj < trials.size(); ++jj) {
        if (trials[jj].empty()) continue;
        if (!chosen[jj].layers.empty() && best[jj].score < chosen[jj].score + 1e-4)
          open[jj] = false;
        else
          chosen[jj] = std::move(best[jj]);
      }
    }
    return chosen;
  }

  // Held-out R² (mean of K and V, on the sketched outputs) of every source layer alone for
  // every target layer: score[j][l]. One factorisation per source layer, layers in parallel.
  std::vector<std::vector<double>> probe_scores() const {
    const int64_t Ls = source.num_layers, Lt = target.num_layers;
    std::vector<std::vector<double>> score(static_cast<size_t>(Lt),
                                           std::vector<double>(static_cast<size_t>(Ls)));
    detail::parallel_for(Ls, [&](int64_t l) {
      const size_t ll = static_cast<size_t>(l);
      const RidgeBasis b = make_basis(
          static_cast<double>(probe_train.n), probe_train.sx[ll],
          symmetric_from_upper(probe_train.xx[ll]), static_cast<double>(probe_held.n),
          probe_held.sx[ll], symmetric_from_upper(probe_held.xx[ll]));
      const MapScores s = score_maps(b, probe_train.sz, probe_train.xz[ll], probe_held.sz,
                                     probe_held.xz[ll], probe_held.zz, sketch_width,
                                     options.ridge_grid);
      for (int64_t j = 0; j < Lt; ++j)
        score[static_cast<size_t>(j)][ll] = 0.5 * (s.fits[static_cast<size_t>(2 * j)].r2 +
                                                   s.fits[static_cast<size_t>(2 * j + 1)].r2);
    });
    return score;
  }
};

AdapterFitter::AdapterFitter(const ModelSpec& source, const ModelSpec& target,
                             const FitOptions& options)
    : impl_(std::make_unique<Impl>()) {
  source.validate();
  target.validate();
  if (!options.alignment_policy.empty()) (void)parse_align_policy(options.alignment_policy);
  KVB_CHECK(options.holdout > 0 && options.holdout <= 0.5,
            "holdout must be in (0, 0.5], got " << options.holdout);
  KVB_CHECK(!options.ridge_grid.empty(), "ridge_grid must not be empty");
  for (double r : options.ridge_grid)
    KVB_CHECK(std::isfinite(r) && r > 0, "ridge values must be finite and > 0, got " << r);
  KVB_CHECK(options.max_source_layers >= 1,
            "max_source_layers must be >= 1, got " << options.max_source_layers);
  Impl& m = *impl_;
  m.source = source;
  m.target = target;
  m.options = options;
  m.source_inv_freq = detail::layer_inv_freq(source);
  m.target_inv_freq = detail::layer_inv_freq(target);
  m.layer_features = 2 * source.num_kv_heads * source.head_dim;
  m.outputs = target.num_kv_heads * target.head_dim;
  std::vector<std::vector<int64_t>> candidates(static_cast<size_t>(target.num_layers));
  if (options.selection == FitOptions::Selection::kExplicit) {
    KVB_CHECK(static_cast<int64_t>(options.source_layers.size()) == target.num_layers,
              "source_layers: need one list per target layer (" << target.num_layers << "), got "
                                                                << options.source_layers.size());
    for (size_t j = 0; j < options.source_layers.size(); ++j) {
      auto list = options.source_layers[j];
      KVB_CHECK(!list.empty(), "source_layers[" << j << "] is empty");
      std::sort(list.begin(), list.end());
      KVB_CHECK(std::adjacent_find(list.begin(), list.end()) == list.end(),
                "source_layers[" << j << "] repeats a layer");
      for (int64_t l : list)
        KVB_CHECK(l >= 0 && l < source.num_layers, "source_layers[" << j << "]: layer " << l
                                                                    << " is outside [0, "
                                                                    << source.num_layers << ")");
      candidates[j] = list;
    }
    m.options.source_layers = candidates;
  } else {
    for (auto& c : candidates)
      for (int64_t l = 0; l < source.num_layers; ++l) c.push_back(l);
  }
  Plan plan = make_plan(std::move(candidates));
  const double budget = static_cast<double>(options.max_memory_bytes);
  const double need = plan_bytes(plan, m.layer_features, m.outputs);
  if (need <= budget) {
    m.start_final_pass(std::move(plan));
    return;
  }
  const double mib = 1 << 20;
  KVB_CHECK(options.selection == FitOptions::Selection::kAuto,
            "the fitter's accumulators would take "
                << need / mib << " MiB, over max_memory_bytes " << budget / mib
                << " MiB; list fewer source layers per target layer (selection kExplicit), use "
                   "selection kAuto, or raise max_memory_bytes");
  m.sketch_width = std::min<int64_t>(m.outputs, kProbeSketchWidth);
  KVB_CHECK(m.probe_bytes() <= budget,
            "selection kAuto: accumulators for all source layers would take "
                << need / mib << " MiB and the probe pass that narrows them down "
                << m.probe_bytes() / mib << " MiB, both over max_memory_bytes " << budget / mib
                << " MiB");
  m.passes = 2;
  m.sketch = gaussian_sketch(m.outputs, m.sketch_width, options.seed);
  m.probe_train.init(source.num_layers, m.layer_features, m.maps(), m.sketch_width);
  m.probe_held.init(source.num_layers, m.layer_features, m.maps(), m.sketch_width);
}

AdapterFitter::~AdapterFitter() = default;

int AdapterFitter::passes() const noexcept { return impl_->passes; }
int AdapterFitter::pass() const noexcept { return impl_->pass; }

int64_t AdapterFitter::train_tokens() const noexcept {
  return impl_->probing() ? impl_->probe_train.n : impl_->train.n;
}
int64_t AdapterFitter::holdout_tokens() const noexcept {
  return impl_->probing() ? impl_->probe_held.n : impl_->held.n;
}
int64_t AdapterFitter::memory_bytes() const noexcept {
  const Impl& m = *impl_;
  return static_cast<int64_t>(m.probing() ? m.probe_bytes()
                                          : plan_bytes(m.plan, m.layer_features, m.outputs));
}

std::vector<std::vector<int64_t>> AdapterFitter::candidate_layers() const {
  KVB_CHECK(!impl_->probing(), "candidate_layers: known after the probe pass (next_pass())");
  return impl_->plan.candidates;
}

void AdapterFitter::add(const KVView& src, const KVView& tgt, int64_t start_pos) {
  add_impl(src, tgt, start_pos, nullptr);
}

void AdapterFitter::add(const KVView& src, const KVView& tgt, int64_t start_pos,
                        const std::vector<int64_t>& alignment) {
  add_impl(src, tgt, start_pos, &alignment);
}

namespace {

std::string device_name(const Device& d) {
  return d.type == DeviceType::kCUDA ? "cuda:" + std::to_string(d.index) : std::string("cpu");
}

}  // namespace

void AdapterFitter::add_impl(const KVView& src, const KVView& tgt, int64_t start_pos,
                             const std::vector<int64_t>* alignment) {
  Impl& m = *impl_;
  src.check_matches(m.source, "source_kv");
  tgt.check_matches(m.target, "target_kv");
  KVB_CHECK(alignment || src.tokens() == tgt.tokens(),
            "target_kv holds " << tgt.tokens() << " tokens but source_kv holds " << src.tokens());
  KVB_CHECK(src.device() == tgt.device(), "source_kv and target_kv must be on one device, got "
                                              << device_name(src.device()) << " and "
                                              << device_name(tgt.device()));
  const bool on_cuda = src.device().type == DeviceType::kCUDA;
  KVB_CHECK(!m.sample_device || *m.sample_device == src.device(),
            "AdapterFitter::add: this fitter's samples are on "
                << device_name(*m.sample_device) << ", this one is on "
                << device_name(src.device())
                << "; one fitter takes all its samples from one device (CPU or one CUDA device)");
  KVB_CHECK_AS(Unavailable, !m.device_failed,
               "AdapterFitter::add: a CUDA failure during an earlier add() left the accumulators "
               "incomplete; start a new fitter");
  detail::check_positions(start_pos, std::max(src.tokens(), tgt.tokens()));
  // With an alignment the samples are the target tokens that have a source token: target row
  // j with the source row alignment[j] (un-rotated at its own source position).
  std::vector<int64_t> src_rows, tgt_rows;
  if (alignment) {
    check_alignment(*alignment, src.tokens(), tgt.tokens(), /*allow_missing=*/true);
    for (size_t j = 0; j < alignment->size(); ++j)
      if ((*alignment)[j] != kNoSource) {
        src_rows.push_back((*alignment)[j]);
        tgt_rows.push_back(static_cast<int64_t>(j));
      }
  }
  const int64_t T = alignment ? static_cast<int64_t>(tgt_rows.size()) : src.tokens();
  if (T == 0) return;
  KVB_CHECK(T <= std::numeric_limits<int>::max(),
            "add: " << T << " tokens in one sample; add at most 2^31 - 1 at a time");
  // CUDA views are read into host memory, so one feature builder (below) serves both paths;
  // only the products, nearly all of the work, then run on the device.
  detail::HostKVCopy src_copy, tgt_copy;
  if (on_cuda) {
    src_copy = detail::fitter_copy_to_host(src, "source_kv");
    tgt_copy = detail::fitter_copy_to_host(tgt, "target_kv");
  }
  const KVView& source_kv = on_cuda ? src_copy.view : src;
  const KVView& target_kv = on_cuda ? tgt_copy.view : tgt;
  const auto pick = [&](MatD rows, const std::vector<int64_t>& index) -> MatD {
    if (!alignment) return rows;
    return rows(index, Eigen::all);
  };
  const int64_t Fl = m.layer_features, O = m.outputs, Lt = m.target.num_layers;
  const bool probing = m.probing();
  std::vector<int64_t> layers;
  if (probing) {
    for (int64_t l = 0; l < m.source.num_layers; ++l) layers.push_back(l);
  } else {
    layers = m.plan.slots;
  }
  // The held-out split first: training rows go to the top of X and Y, held-out rows below, so
  // each part is one contiguous block of rows for the products.
  std::vector<int64_t> dest(static_cast<size_t>(T));
  int64_t n_train = 0;
  {
    std::vector<int> is_held(static_cast<size_t>(T));
    for (size_t t = 0; t < is_held.size(); ++t) {
      const uint64_t h = splitmix64(m.options.seed ^ splitmix64(m.tokens_seen + t));
      is_held[t] = static_cast<double>(h >> 11) * 0x1.0p-53 < m.options.holdout;
      n_train += 1 - is_held[t];
    }
    int64_t next[2] = {0, n_train};
    for (size_t t = 0; t < is_held.size(); ++t) dest[t] = next[is_held[t]]++;
  }
  // Everything is computed before anything is accumulated, so a bad sample changes nothing.
  // One layer per task, each writing its own columns: with CUDA views the products are fast
  // enough that a serial builder would dominate add().
  const int64_t S = static_cast<int64_t>(layers.size());
  MatD X(T, S * Fl);
  MatD Y(T, Lt * 2 * O);  // target layer j's keys then values at columns j * 2O
  detail::parallel_for(S + Lt, [&](int64_t i) {
    if (i < S)
      X(dest, Eigen::seqN(i * Fl, Fl)) =
          pick(unrotated_rows(m.source, m.source_inv_freq, m.options.rope_aware, source_kv,
                              layers[static_cast<size_t>(i)], start_pos),
               src_rows);
    else
      Y(dest, Eigen::seqN((i - S) * 2 * O, 2 * O)) =
          pick(unrotated_rows(m.target, m.target_inv_freq, m.options.rope_aware, target_kv, i - S,
                              start_pos),
               tgt_rows);
  });
  src_copy = detail::HostKVCopy();
  tgt_copy = detail::HostKVCopy();
  if (probing) {
    const int64_t r = m.sketch_width;
    MatD Z(T, m.maps() * r);
    for (int64_t map = 0; map < m.maps(); ++map)
      detail::lapack::gemm(false, false, T, r, O, 1, Y.data() + map * O, Y.cols(),
                           m.sketch.data(), r, 0, Z.data() + map * r, Z.cols());
    Y = std::move(Z);
  }

  // The cross products of the two parts (train rows, then held-out rows), each one BLAS call.
  std::vector<detail::FitterProduct> products;
  for (int part = 0; part < 2; ++part) {
    const int64_t first = part ? n_train : 0, rows = part ? T - n_train : n_train;
    if (rows == 0) continue;
    const auto product = [&](bool symmetric, bool b_from_y, int64_t a_col, int64_t b_col,
                             int64_t m_rows, int64_t n_cols, MatD& acc) {
      products.push_back(
          {symmetric, b_from_y, first, rows, a_col, b_col, m_rows, n_cols, acc.data()});
    };
    if (probing) {
      ProbeMoments& acc = part ? m.probe_held : m.probe_train;
      for (size_t l = 0; l < layers.size(); ++l) {
        const int64_t col = static_cast<int64_t>(l) * Fl;
        product(true, false, col, col, Fl, Fl, acc.xx[l]);
        product(false, true, col, 0, Fl, acc.xz[l].cols(), acc.xz[l]);
      }
      continue;
    }
    BlockMoments& acc = part ? m.held : m.train;
    for (size_t k = 0; k < m.plan.blocks.size(); ++k) {
      const int64_t a = m.plan.blocks[k].first, b = m.plan.blocks[k].second;
      product(a == b, false, a * Fl, b * Fl, Fl, Fl, acc.xx[k]);
    }
    for (int64_t j = 0; j < Lt; ++j) {
      const size_t jj = static_cast<size_t>(j);
      const auto& C = m.plan.candidates[jj];
      for (size_t c = 0; c < C.size(); ++c)
        product(false, true, m.plan.slot(C[c]) * Fl, j * 2 * O, Fl, 2 * O, acc.xy[jj][c]);
    }
  }
  const int64_t ldx = X.cols(), ldy = Y.cols();
  if (on_cuda) {
    // Allocations first: failing there leaves the fitter as it was.
    if (!m.device_products)
      m.device_products =
          detail::fitter_device_create(src.device().index, m.product_accumulators());
    detail::fitter_device_reserve(*m.device_products, ldx, ldy, T);
    try {
      detail::fitter_device_accumulate(*m.device_products, X.data(), ldx, Y.data(), ldy, T,
                                       products);
    } catch (...) {
      m.device_failed = true;
      throw;
    }
  } else {
    // Independent products run in parallel across threads, each a single-threaded BLAS call.
    detail::parallel_for(static_cast<int64_t>(products.size()), [&](int64_t i) {
      const detail::FitterProduct& p = products[static_cast<size_t>(i)];
      const double* a = X.data() + p.first * ldx + p.a_col;
      if (p.symmetric) {
        detail::lapack::syrk_upper(true, p.m, p.rows, 1, a, ldx, 1, p.host, p.m);
      } else {
        const double* b = (p.b_from_y ? Y.data() + p.first * ldy : X.data() + p.first * ldx) +
                          p.b_col;
        detail::lapack::gemm(true, false, p.m, p.n, p.rows, 1, a, ldx, b, p.b_from_y ? ldy : ldx,
                             1, p.host, p.n);
      }
    });
  }

  // The sums are cheap and always kept on the host; last, so a failed device call leaves the
  // counts as they were.
  m.sample_device = src.device();
  m.tokens_seen += static_cast<uint64_t>(T);
  for (int part = 0; part < 2; ++part) {
    const int64_t first = part ? n_train : 0, rows = part ? T - n_train : n_train;
    if (rows == 0) continue;
    const auto Xs = X.middleRows(first, rows);
    const auto Ys = Y.middleRows(first, rows);
    if (probing) {
      ProbeMoments& acc = part ? m.probe_held : m.probe_train;
      const int64_t r = m.sketch_width;
      acc.n += rows;
      acc.sz += Ys.colwise().sum().transpose();
      for (int64_t map = 0; map < m.maps(); ++map)
        acc.zz[map] += Ys.middleCols(map * r, r).squaredNorm();
      for (size_t l = 0; l < layers.size(); ++l)
        acc.sx[l] += Xs.middleCols(static_cast<int64_t>(l) * Fl, Fl).colwise().sum().transpose();
      continue;
    }
    BlockMoments& acc = part ? m.held : m.train;
    acc.n += rows;
    for (size_t s = 0; s < layers.size(); ++s)
      acc.sx[s] += Xs.middleCols(static_cast<int64_t>(s) * Fl, Fl).colwise().sum().transpose();
    for (int64_t j = 0; j < Lt; ++j) {
      const size_t jj = static_cast<size_t>(j);
      const auto Yj = Ys.middleCols(j * 2 * O, 2 * O);
      acc.sy[jj] += Yj.colwise().sum().transpose();
      acc.yy[jj][0] += Yj.leftCols(O).squaredNorm();
      acc.yy[jj][1] += Yj.rightCols(O).squaredNorm();
    }
  }
}

void AdapterFitter::next_pass() {
  Impl& m = *impl_;
  KVB_CHECK(m.probing(), "next_pass: this fitter " << (m.passes == 1 ? "has a single pass"
                                                                       : "is in its last pass"));
  KVB_CHECK(m.probe_train.n >= 2 && m.probe_held.n >= 2,
            "next_pass: the probe pass needs at least 2 training and 2 held-out tokens, has "
                << m.probe_train.n << " and " << m.probe_held.n);
  m.sync_from_device();
  const auto score = m.probe_scores();
  const int64_t Ls = m.source.num_layers, Lt = m.target.num_layers;
  std::vector<std::vector<int64_t>> order(static_cast<size_t>(Lt));
  for (int64_t j = 0; j < Lt; ++j) {
    auto& o = order[static_cast<size_t>(j)];
    for (int64_t l = 0; l < Ls; ++l) o.push_back(l);
    const auto& s = score[static_cast<size_t>(j)];
    std::stable_sort(o.begin(), o.end(), [&](int64_t a, int64_t b) {
      return s[static_cast<size_t>(a)] > s[static_cast<size_t>(b)];
    });
  }
  // Round-robin by rank: every target layer gets its best source layer before any gets a
  // second; a target layer whose next candidate does not fit takes no more.
  const double budget = static_cast<double>(m.options.max_memory_bytes);
  const int64_t most = std::min(m.options.max_source_layers, Ls);
  std::vector<std::vector<int64_t>> candidates(static_cast<size_t>(Lt));
  std::vector<bool> full(static_cast<size_t>(Lt), false);
  for (int64_t rank = 0; rank < most; ++rank)
    for (int64_t j = 0; j < Lt; ++j) {
      const size_t jj = static_cast<size_t>(j);
      if (full[jj]) continue;
      auto trial = candidates;
      trial[jj].push_back(order[jj][static_cast<size_t>(rank)]);
      if (plan_bytes(make_plan(trial), m.layer_features, m.outputs) <= budget)
        candidates = std::move(trial);
      else
        full[jj] = true;
    }
  for (int64_t j = 0; j < Lt; ++j)
    KVB_CHECK(!candidates[static_cast<size_t>(j)].empty(),
              "max_memory_bytes " << budget / (1 << 20)
                                  << " MiB cannot hold one source layer for every target layer");
  for (auto& c : candidates) std::sort(c.begin(), c.end());
  m.start_final_pass(make_plan(std::move(candidates)));
  m.pass = 1;
}

LinearAdapter AdapterFitter::fit() const {
  const Impl& m = *impl_;
  KVB_CHECK(!m.probing(),
            "fit: the fitter is in its probe pass (pass 1 of 2, which selects candidate source "
            "layers); call next_pass() and add the samples again first");
  KVB_CHECK(m.train.n >= 2 && m.held.n >= 2,
            "fit: need at least 2 training and 2 held-out tokens, have " << m.train.n << " and "
                                                                         << m.held.n);
  auto out = std::make_unique<LinearAdapter::Impl>();
  out->source = m.source;
  out->target = m.target;
  out->source_inv_freq = m.source_inv_freq;
  out->target_inv_freq = m.target_inv_freq;
  out->report.train_tokens = m.train.n;
  out->report.holdout_tokens = m.held.n;
  out->report.rope_aware = m.options.rope_aware;
  out->report.alignment_policy = m.options.alignment_policy;
  m.sync_from_device();
  std::vector<Impl::Choice> chosen = m.select();
  for (Impl::Choice& c : chosen) {
    out->layers.push_back(c.layers);
    LayerFit lf;
    lf.source_layers = c.layers;
    lf.r2_key = c.fits[0].r2;
    lf.r2_value = c.fits[1].r2;
    lf.ridge_key = c.fits[0].ridge;
    lf.ridge_value = c.fits[1].ridge;
    out->report.layers.push_back(lf);
    out->weights.push_back(std::move(c.weights));
    out->bias.push_back(std::move(c.bias));
  }
  return LinearAdapter(std::move(out));
}

}  // namespace kvbridge
