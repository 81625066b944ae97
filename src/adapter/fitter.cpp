#include <Eigen/Dense>
#include <algorithm>
#include <array>
#include <atomic>
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
#include "src/adapter/ridge.h"

namespace kvbridge {

using detail::holdout_totals;
using detail::layer_sd;
using detail::make_basis;
using detail::MapFit;
using detail::MapScores;
using detail::MatD;
using detail::RidgeBasis;
using detail::score_centered;
using detail::score_maps;
using detail::solve_maps;
using detail::VecD;

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

// fit()'s progress: work planned and done (1e9 flops, estimated) and the caller's callback, called
// one at a time. A callback that throws stops the other threads at their next check().
class Progress {
 public:
  struct Stopped {};
  explicit Progress(const FitProgressCallback* callback) : callback_(callback) {}
  void plan(double work) {
    std::lock_guard<std::mutex> lock(mutex_);
    total_ += work;
  }
  // `work` finished; `dropped` planned work that will not be done after all.
  void step(double work, double dropped, int64_t target_layer, int64_t source_layers) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ += work;
    total_ = std::max(total_ - dropped, done_);
    if (!callback_ || !*callback_ || error_) return;
    try {
      (*callback_)(FitProgress{done_, total_, target_layer, source_layers});
    } catch (...) {
      error_ = std::current_exception();
      stopped_ = true;
      throw Stopped();
    }
  }
  void check() const {
    if (stopped_) throw Stopped();
  }
  // After a failure: the callback's exception where one stopped the work.
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  const FitProgressCallback* callback_;
  std::mutex mutex_;
  double done_ = 0, total_ = 0;
  std::atomic<bool> stopped_{false};
  std::exception_ptr error_;
};

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
// Raw sums over one token split for the token codes' term (FitOptions::target_token_codes): the
// codes' features z [Dz] of the paired target tokens against themselves, against each plan
// slot's features and against every target output. Its count is the split's BlockMoments::n.
struct TokenMoments {
  VecD sz;               // [Dz]
  MatD zz;               // [Dz, Dz], upper triangle only
  std::vector<MatD> zx;  // [slot] -> [Dz, Fl]
  MatD zy;               // [Dz, Lt * 2 * O]

  void init(int64_t Dz, size_t slots, int64_t Fl, int64_t outputs_all) {
    sz = VecD::Zero(Dz);
    zz = MatD::Zero(Dz, Dz);
    zx.assign(slots, MatD::Zero(Dz, Fl));
    zy = MatD::Zero(Dz, outputs_all);
  }
  static double bytes(int64_t Dz, size_t slots, int64_t Fl, int64_t outputs_all) {
    return 8.0 * static_cast<double>(Dz) *
           static_cast<double>(1 + Dz + static_cast<int64_t>(slots) * Fl + outputs_all);
  }
};

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
  // Final pass: the plan's blocks, and the token codes' sums when the fit has codes.
  Plan plan;
  mutable BlockMoments train, held;
  TokenMoments token_train, token_held;
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
    if (token_width() > 0) {
      token_train.init(token_width(), plan.slots.size(), layer_features, maps() * outputs);
      token_held.init(token_width(), plan.slots.size(), layer_features, maps() * outputs);
    }
    tokens_seen = 0;
  }

  // Dz: the width of one target token's codes' features (0 without codes).
  int64_t token_width() const {
    return options.target_token_codes.empty()
               ? 0
               : options.token_context * options.target_token_codes.dims;
  }
  double token_bytes(const Plan& p) const {
    return token_width() > 0 ? 2 * TokenMoments::bytes(token_width(), p.slots.size(),
                                                       layer_features, maps() * outputs)
                             : 0;
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

  // The divisor that standardises each slot's features (layer_sd), from the training sums.
  std::vector<double> slot_sd() const {
    std::vector<double> sd(plan.slots.size());
    for (size_t s = 0; s < sd.size(); ++s) {
      const int64_t a = static_cast<int64_t>(s);
      sd[s] = layer_sd(static_cast<double>(train.n), train.sx[s],
                       train.xx[static_cast<size_t>(plan.block(a, a))].trace());
    }
    return sd;
  }

  RidgeBasis basis(const std::vector<int64_t>& S, const std::vector<double>& sd) const {
    SetSums g = gather(S);
    const int64_t Fl = layer_features;
    VecD d(static_cast<int64_t>(S.size()) * Fl);
    for (size_t a = 0; a < S.size(); ++a)
      d.segment(static_cast<int64_t>(a) * Fl, Fl).setConstant(sd[static_cast<size_t>(plan.slot(S[a]))]);
    return make_basis(static_cast<double>(train.n), g.sx, std::move(g.xx),
                      static_cast<double>(held.n), g.sxh, std::move(g.xxh), d);
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
    std::vector<SelectionStep> steps;  // kAuto's path to it
  };

  static void keep_float(Choice& c, size_t kind, const MatD& weights, const VecD& bias) {
    c.weights[kind].resize(static_cast<size_t>(weights.size()));
    Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
        c.weights[kind].data(), weights.rows(), weights.cols()) = weights.cast<float>();
    c.bias[kind].resize(static_cast<size_t>(bias.size()));
    Eigen::Map<Eigen::VectorXf>(c.bias[kind].data(), bias.size()) = bias.cast<float>();
  }

  // One target layer's token codes' terms (token_terms), per map (0: K, 1: V).
  struct TokenFit {
    std::array<MatD, 2> wz, wx;  // [Dz, O] and the corrected source weights [F, O]; empty: none
    std::array<VecD, 2> bias;
    std::array<double, 2> ridge = {std::numeric_limits<double>::quiet_NaN(),
                                   std::numeric_limits<double>::quiet_NaN()};
    std::array<double, 2> r2_gain = {0, 0};
  };

  // The token codes' terms of target layer j's K and V maps (chosen set S, weights and biases
  // in c) from the codes' sums tt (training) and th (held-out), refitted jointly with the maps
  // at each map's chosen strength: the codes' weights at each strength of the grid (relative to
  // the codes' mean variance), the one with the least held-out error kept if it lowers it, and
  // the source weights corrected for it. By blocks (Frisch-Waugh): with A = C_xx + r_x D² the
  // maps' ridge matrix (D: each slot's sd, as the maps were fitted) and U = A^-1 C_xz, the
  // codes' weights solve (C_zz - C_zx U + r_z s I) W_z = C_zr, r the maps' training residual,
  // and the source weights become W - U W_z; on held-out tokens the prediction moves by
  // W_z^T (z - U^T x) + const.
  TokenFit token_terms(int64_t j, const std::vector<double>& sd, const Choice& c,
                       const TokenMoments& tt, const TokenMoments& th) const {
    const int64_t Dz = tt.sz.size(), Fl = layer_features, O = outputs;
    const int64_t F = static_cast<int64_t>(c.layers.size()) * Fl;
    const size_t jj = static_cast<size_t>(j);
    const double n = static_cast<double>(train.n), nh = static_cast<double>(held.n);
    TokenFit out;
    SetSums g = gather(c.layers);
    MatD xz(F, Dz), xzh(F, Dz), xyh(F, 2 * O);
    VecD d2(F);
    const auto& C = plan.candidates[jj];
    for (size_t a = 0; a < c.layers.size(); ++a) {
      const size_t slot = static_cast<size_t>(plan.slot(c.layers[a]));
      const size_t ca = static_cast<size_t>(std::find(C.begin(), C.end(), c.layers[a]) - C.begin());
      const int64_t r = static_cast<int64_t>(a) * Fl;
      xz.middleRows(r, Fl) = tt.zx[slot].transpose();
      xzh.middleRows(r, Fl) = th.zx[slot].transpose();
      xyh.middleRows(r, Fl) = held.xy[jj][ca];
      d2.segment(r, Fl).setConstant(sd[slot] * sd[slot]);
    }
    const VecD mu_x = g.sx / n, mu_z = tt.sz / n;
    MatD cxx = g.xx / n;
    cxx.noalias() -= mu_x * mu_x.transpose();
    MatD cxz = xz / n;
    cxz.noalias() -= mu_x * mu_z.transpose();
    MatD czz = symmetric_from_upper(tt.zz) / n;  // sums keep the upper triangle
    czz.noalias() -= mu_z * mu_z.transpose();
    const double scale = czz.trace() / static_cast<double>(Dz);
    if (!(scale > 0)) return out;
    namespace la = detail::lapack;
    // The products below are BLAS-3 calls: F reaches thousands (4,096 source features into
    // SmolLM2), and each target layer's terms run on one thread of the parallel loop.
    const auto product = [](bool trans, const MatD& x, const MatD& y, double alpha, double beta,
                            MatD& z) {  // z = alpha op(x) y + beta z
      const int64_t rows = trans ? x.cols() : x.rows(), inner = trans ? x.rows() : x.cols();
      if (beta == 0) z.resize(rows, y.cols());
      la::gemm(trans, false, rows, y.cols(), inner, alpha, x.data(), x.cols(), y.data(), y.cols(),
               beta, z.data(), z.cols());
    };
    for (size_t k = 0; k < 2; ++k) {
      MatD L = cxx;  // A, then its Cholesky factor
      L.diagonal() += c.fits[k].ridge * d2;
      if (!la::potrf_lower(F, L.data(), F)) continue;  // not positive definite in float64: no term
      MatD U = cxz;  // L^-1 C_xz, then U = A^-1 C_xz [F, Dz]
      la::trsm_lower(false, F, Dz, L.data(), F, U.data(), Dz);
      MatD s = czz;  // C_zz - C_zx A^-1 C_xz = C_zz - (L^-1 C_xz)^T (L^-1 C_xz)
      la::syrk_upper(true, Dz, F, -1, U.data(), Dz, 1, s.data(), Dz);
      s = symmetric_from_upper(s);
      la::trsm_lower(true, F, Dz, L.data(), F, U.data(), Dz);
      L = MatD();
      const MatD W = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic,
                                                    Eigen::RowMajor>>(c.weights[k].data(), F, O)
                         .cast<double>();
      const VecD b = Eigen::Map<const Eigen::VectorXf>(c.bias[k].data(), O).cast<double>();
      const int64_t col = j * 2 * O + static_cast<int64_t>(k) * O;
      const VecD mu_y = train.sy[jj].segment(static_cast<int64_t>(k) * O, O) / n;
      // Training: C_zr, the codes against the maps' residual r = y - W^T x - b.
      MatD czr = tt.zy.middleCols(col, O) / n;
      czr.noalias() -= mu_z * mu_y.transpose();
      product(true, xz, W, -1 / n, 1, czr);
      czr.noalias() += mu_z * (W.transpose() * mu_x).transpose();
      // Held-out: sums of r0 (the maps' residual), zhat = z - U^T x, zhat zhat^T, zhat r0^T.
      const VecD syh = held.sy[jj].segment(static_cast<int64_t>(k) * O, O);
      MatD xr = xyh.middleCols(static_cast<int64_t>(k) * O, O);  // sum x r0^T
      product(false, g.xxh, W, -1, 1, xr);
      xr.noalias() -= g.sxh * b.transpose();
      MatD hr = th.zy.middleCols(col, O);  // sum z r0^T, then zhat r0^T
      product(true, xzh, W, -1, 1, hr);
      hr.noalias() -= th.sz * b.transpose();
      product(true, U, xr, -1, 1, hr);
      const VecD sr = syh - W.transpose() * g.sxh - nh * b;
      MatD hh = symmetric_from_upper(th.zz);
      MatD uxz, xu;
      product(true, U, xzh, 1, 0, uxz);
      hh -= uxz + uxz.transpose();
      product(false, g.xxh, U, 1, 0, xu);
      product(true, U, xu, 1, 1, hh);
      const VecD sh = th.sz - U.transpose() * g.sxh;
      const VecD base = mu_y - W.transpose() * mu_x - b;  // the bias's move without a term
      const VecD u_mu = U.transpose() * mu_x - mu_z;
      double best = 0;  // the held-out error's change: a term must lower it
      MatD f, wz, hw;
      for (double r : options.ridge_grid) {
        f = s;
        f.diagonal().array() += r * scale;
        if (!la::potrf_lower(Dz, f.data(), Dz)) continue;
        wz = czr;  // [Dz, O]
        la::trsm_lower(false, Dz, O, f.data(), Dz, wz.data(), O);
        la::trsm_lower(true, Dz, O, f.data(), Dz, wz.data(), O);
        product(false, hh, wz, 1, 0, hw);
        // The new bias minus b: mu_y - (W - U wz)^T mu_x - wz^T mu_z - b.
        const VecD shift = base + wz.transpose() * u_mu;
        const double change = (wz.cwiseProduct(hw)).sum() + 2 * shift.dot(wz.transpose() * sh) +
                              nh * shift.squaredNorm() -
                              2 * ((wz.cwiseProduct(hr)).sum() + shift.dot(sr));
        if (change < best) {
          best = change;
          out.wz[k] = wz;
          out.bias[k] = shift + b;
          out.ridge[k] = r;
        }
      }
      if (out.wz[k].size() > 0) {
        out.wx[k] = W;
        product(false, U, out.wz[k], -1, 1, out.wx[k]);
      }
      const double sst = std::max(held.yy[jj][k] - syh.squaredNorm() / nh, 1e-300);
      out.r2_gain[k] = -best / sst;
    }
    return out;
  }

  // The basis [dims, r] the codes are compressed to (FitOptions::token_code_dims): the r
  // directions of code space that carry most of the full codes' terms `fits` make, by the
  // codes' training covariance C (of one context slot): with C^(1/2) W_(m,c) the terms of every
  // map m and slot c in whitened space, the top r eigenvectors B of sum W' W'^T; the basis is
  // C^(-1/2) B, so the compressed codes have identity covariance.
  MatD code_basis(const std::vector<TokenFit>& fits, int64_t r) const {
    const int64_t D = options.target_token_codes.dims, ctx = options.token_context;
    const double n = static_cast<double>(train.n);
    const VecD mu = token_train.sz.head(D) / n;
    MatD cov = symmetric_from_upper(token_train.zz).topLeftCorner(D, D) / n;
    cov.noalias() -= mu * mu.transpose();
    const Eigen::SelfAdjointEigenSolver<MatD> e(cov);
    const VecD lambda = e.eigenvalues().cwiseMax(0.0);
    const double floor = 1e-12 * std::max(lambda.maxCoeff(), 1e-300);
    VecD root(D), inv_root(D);
    for (int64_t i = 0; i < D; ++i) {
      root[i] = std::sqrt(lambda[i]);
      inv_root[i] = lambda[i] > floor ? 1 / root[i] : 0.0;
    }
    const MatD half = e.eigenvectors() * root.asDiagonal() * e.eigenvectors().transpose();
    MatD spread = MatD::Zero(D, D);
    for (const TokenFit& f : fits)
      for (const MatD& wz : f.wz)
        for (int64_t c = 0; c < ctx && wz.size() > 0; ++c) {
          const MatD w = half * wz.middleRows(c * D, D);
          spread.noalias() += w * w.transpose();
        }
    const Eigen::SelfAdjointEigenSolver<MatD> top(spread);  // ascending
    const MatD B = top.eigenvectors().rightCols(r).rowwise().reverse();
    return e.eigenvectors() * inv_root.asDiagonal() * e.eigenvectors().transpose() * B;
  }

  // The codes' sums with every slot's codes projected on basis P [dims, r].
  TokenMoments project(const TokenMoments& t, const MatD& P) const {
    const int64_t D = P.rows(), r = P.cols(), ctx = options.token_context;
    MatD P2 = MatD::Zero(ctx * D, ctx * r);
    for (int64_t c = 0; c < ctx; ++c) P2.block(c * D, c * r, D, r) = P;
    TokenMoments out;
    out.sz = P2.transpose() * t.sz;
    out.zz = P2.transpose() * symmetric_from_upper(t.zz) * P2;
    for (const MatD& zx : t.zx) out.zx.push_back(P2.transpose() * zx);
    out.zy = P2.transpose() * t.zy;
    return out;
  }

  // kAll and kExplicit: each target layer's one set. Every distinct set is factorised once
  // (sets that several target layers use are shared); independent sets run on separate threads.
  std::vector<Choice> fit_sets(Progress& progress) const {
    const int64_t Lt = target.num_layers, c = 2 * outputs;
    const std::vector<double> sd = slot_sd();
    std::map<std::vector<int64_t>, std::vector<int64_t>> users;
    for (int64_t j = 0; j < Lt; ++j) users[plan.candidates[static_cast<size_t>(j)]].push_back(j);
    std::vector<const std::pair<const std::vector<int64_t>, std::vector<int64_t>>*> sets;
    for (const auto& e : users) {
      sets.push_back(&e);
      const double F = static_cast<double>(e.first.size() * layer_features);
      progress.plan(1e-9 * (10 * F * F * F + static_cast<double>(e.second.size()) * 8 * F * F * c));
    }
    std::vector<Choice> out(static_cast<size_t>(Lt));
    const auto consider = [&](const std::vector<int64_t>& S, const RidgeBasis& b, int64_t j) {
      progress.check();
      MapScores s = score(j, S, b);
      solve_maps(b, s, outputs);
      Choice& ch = out[static_cast<size_t>(j)];
      ch.layers = S;
      ch.score = 0.5 * (s.fits[0].r2 + s.fits[1].r2);
      for (size_t kind = 0; kind < 2; ++kind) {
        MapFit& f = s.fits[kind];
        keep_float(ch, kind, f.weights, f.bias);
        f.weights = MatD();
        f.bias = VecD();
        ch.fits[kind] = std::move(f);
      }
      const double F = static_cast<double>(S.size() * layer_features);
      progress.step(1e-9 * 8 * F * F * c, 0, j, static_cast<int64_t>(S.size()));
    };
    const auto factorise = [&](const std::vector<int64_t>& S) {
      progress.check();
      RidgeBasis b = basis(S, sd);
      const double F = static_cast<double>(S.size() * layer_features);
      progress.step(1e-9 * 10 * F * F * F, 0, -1, 0);
      return b;
    };
    if (sets.size() == 1) {  // one factorisation on every thread, then its users in parallel
      const RidgeBasis b = factorise(sets[0]->first);
      const auto& u = sets[0]->second;
      detail::parallel_for(static_cast<int64_t>(u.size()), [&](int64_t i) {
        consider(sets[0]->first, b, u[static_cast<size_t>(i)]);
      });
    } else {
      detail::parallel_for(static_cast<int64_t>(sets.size()), [&](int64_t i) {
        const auto& [S, u] = *sets[static_cast<size_t>(i)];
        const RidgeBasis b = factorise(S);
        for (int64_t j : u) consider(S, b, j);
      });
    }
    return out;
  }

  // ---- kAuto: greedy forward selection per target layer ----
  //
  // All in standardised features (each slot's divided by its sd). Per slot: its covariance C,
  // held-out scatter Mh and eigenbasis. Per target layer: first the exact single-layer fit of
  // every candidate (from the slot's eigenbasis, every ridge strength at once), then rounds of
  // (1) a screen of every remaining candidate: the held-out R² of fitting the current maps'
  // training residual with that layer alone (a stagewise fit, from the slot's eigenbasis and
  // the residual's cross-covariances, O(f n c) per candidate); (2) an exact fit of the set with
  // each of the best `exact_candidates` by the screen, at every ridge strength, appended to
  // Cholesky factors of C_S + r I kept per strength (RidgePath): O(n^2 (f + 3c)) per strength.
  // The best exact one is added if it gains at least min_gain.

  struct SlotStats {
    double sd = 1;
    VecD mu, sxh;  // training mean and held-out sum of the raw features [f]
    MatD C, Mh;    // standardised training covariance and held-out scatter [f, f]
    RidgeBasis basis;
  };

  std::vector<SlotStats> slot_stats(const std::vector<double>& sd) const {
    const int64_t Fl = layer_features;
    std::vector<SlotStats> out(plan.slots.size());
    detail::parallel_for(static_cast<int64_t>(out.size()), [&](int64_t s) {
      SlotStats& st = out[static_cast<size_t>(s)];
      const size_t k = static_cast<size_t>(plan.block(s, s));
      const double n = static_cast<double>(train.n), nh = static_cast<double>(held.n);
      st.sd = sd[static_cast<size_t>(s)];
      st.mu = train.sx[static_cast<size_t>(s)] / n;
      st.sxh = held.sx[static_cast<size_t>(s)];
      st.basis = make_basis(n, train.sx[static_cast<size_t>(s)], symmetric_from_upper(train.xx[k]),
                            nh, st.sxh, symmetric_from_upper(held.xx[k]),
                            VecD::Constant(Fl, st.sd));
      st.C = cross(s, s, false, st, st);
      st.Mh = cross(s, s, true, st, st);
    });
    return out;
  }

  // Standardised training covariance (held false) or held-out scatter about the training means
  // (held true) of slots a (rows) and b (columns), [f, f]; needs a's and b's mu, sxh and sd.
  MatD cross(int64_t a, int64_t b, bool h, const SlotStats& sa, const SlotStats& sb) const {
    const BlockMoments& m = h ? held : train;
    const MatD& raw = m.xx[static_cast<size_t>(plan.block(a, b))];
    MatD out = a == b ? symmetric_from_upper(raw) : (a < b ? raw : MatD(raw.transpose()));
    if (!h) {
      out /= static_cast<double>(train.n);
      out.noalias() -= sa.mu * sb.mu.transpose();
    } else {
      out.noalias() -= sa.mu * sb.sxh.transpose();
      out.noalias() -= sa.sxh * sb.mu.transpose();
      out.noalias() += static_cast<double>(held.n) * sa.mu * sb.mu.transpose();
    }
    return out / (sa.sd * sb.sd);
  }

  // Target layer j's outputs against every candidate slot, standardised and centred.
  struct TargetSums {
    VecD mu_y;        // [c] training mean of the outputs (keys then values)
    VecD e, sst;      // [2] held-out sums of squares about mu_y and about the held-out mean
    std::vector<MatD> G, Dh;  // [candidate] -> [f, c] training cross-covariance, held-out
                              // cross-scatter about the training means
  };

  TargetSums target_sums(int64_t j, const std::vector<SlotStats>& st) const {
    const size_t jj = static_cast<size_t>(j);
    const auto& C = plan.candidates[jj];
    const double n = static_cast<double>(train.n), nh = static_cast<double>(held.n);
    TargetSums t;
    t.mu_y = train.sy[jj] / n;
    holdout_totals(t.mu_y, held.sy[jj], Eigen::Vector2d(held.yy[jj][0], held.yy[jj][1]), nh,
                   outputs, t.e, t.sst);
    for (size_t ci = 0; ci < C.size(); ++ci) {
      const SlotStats& s = st[static_cast<size_t>(plan.slot(C[ci]))];
      MatD g = train.xy[jj][ci] / n;
      g.noalias() -= s.mu * t.mu_y.transpose();
      MatD dh = held.xy[jj][ci];
      dh.noalias() -= s.mu * held.sy[jj].transpose();
      dh.noalias() -= s.sxh * t.mu_y.transpose();
      dh.noalias() += nh * s.mu * t.mu_y.transpose();
      t.G.push_back(g / s.sd);
      t.Dh.push_back(dh / s.sd);
    }
    return t;
  }

  // Exact ridge fits of one target layer's K and V maps, at every strength of the grid, on a
  // sequence of slots (in the order added): per strength the Cholesky factor of C_S + r I, the
  // weights and the held-out scatter times the weights, so that a slot is appended in
  // O(n^2 (f + 3 c)) per strength.
  struct RidgePath {
    std::vector<int64_t> seq;  // slots
    std::vector<int64_t> cand; // their indices among the target layer's candidates
    int64_t n = 0;
    MatD Mh;  // [n, n] held-out scatter
    MatD Dh;  // [n, c] held-out cross-scatter
    struct PerRidge {
      bool ok = true;  // false once a factorisation failed: never chosen after
      MatD L;          // [n, n], lower triangle
      MatD W;          // [n, c]
      MatD R;          // [n, c] Mh W
      std::array<double, 2> sse{};
    };
    std::vector<PerRidge> ridge;
  };

  struct Extension {
    int64_t slot = -1, cand = -1;
    double screen = 0;
    MatD Csl, Msl;  // [n, f]
    struct PerRidge {
      bool ok = false;
      MatD Et, Lc, v, Av, Rs, Rl;  // L^-1 C_Sl [n, f]; chol of the Schur complement [f, f];
                                   // the new layer's weights [f, c]; L^-T Et v [n, c]; the new
                                   // R of the old rows [n, c] and of the new ones [f, c]
      std::array<double, 2> sse{};
    };
    std::vector<PerRidge> ridge;
    std::array<double, 2> r2{};
    std::array<int64_t, 2> best{-1, -1};
    double score = -HUGE_VAL;
  };

  // Best strength and R² per map of per-strength held-out SSEs.
  template <class PerRidge>
  void pick_best(const std::vector<PerRidge>& ridge, const VecD& sst, std::array<double, 2>& r2,
                 std::array<int64_t, 2>& best, double& score) const {
    for (int k = 0; k < 2; ++k) {
      r2[static_cast<size_t>(k)] = -HUGE_VAL;
      best[static_cast<size_t>(k)] = -1;
      for (size_t a = 0; a < ridge.size(); ++a) {
        if (!ridge[a].ok) continue;
        const double v = 1 - ridge[a].sse[static_cast<size_t>(k)] / sst[k];
        if (v > r2[static_cast<size_t>(k)]) {
          r2[static_cast<size_t>(k)] = v;
          best[static_cast<size_t>(k)] = static_cast<int64_t>(a);
        }
      }
    }
    score = 0.5 * (r2[0] + r2[1]);
    if (std::isnan(score)) score = -HUGE_VAL;
  }

  Extension extend(const RidgePath& p, int64_t cand, int64_t slot, const std::vector<SlotStats>& st,
                   const TargetSums& t) const {
    namespace la = detail::lapack;
    const int64_t n = p.n, f = layer_features, c = 2 * outputs, O = outputs;
    const SlotStats& sl = st[static_cast<size_t>(slot)];
    Extension x;
    x.slot = slot;
    x.cand = cand;
    x.Csl.resize(n, f);
    x.Msl.resize(n, f);
    for (size_t i = 0; i < p.seq.size(); ++i) {
      const int64_t m = p.seq[i];
      x.Csl.middleRows(static_cast<int64_t>(i) * f, f) =
          cross(m, slot, false, st[static_cast<size_t>(m)], sl);
      x.Msl.middleRows(static_cast<int64_t>(i) * f, f) =
          cross(m, slot, true, st[static_cast<size_t>(m)], sl);
    }
    const MatD& G = t.G[static_cast<size_t>(cand)];
    const MatD& Dl = t.Dh[static_cast<size_t>(cand)];
    x.ridge.resize(p.ridge.size());
    for (size_t a = 0; a < p.ridge.size(); ++a) {
      const auto& pr = p.ridge[a];
      auto& e = x.ridge[a];
      if (!pr.ok) continue;
      e.Et = x.Csl;
      if (n) la::trsm_lower(false, n, f, pr.L.data(), n, e.Et.data(), f);
      e.Lc = sl.C;
      e.Lc.diagonal().array() += options.ridge_grid[a];
      if (n) la::syrk_upper(true, f, n, -1, e.Et.data(), f, 1, e.Lc.data(), f);
      for (int64_t r = 1; r < f; ++r)
        for (int64_t q = 0; q < r; ++q) e.Lc(r, q) = e.Lc(q, r);
      if (!la::potrf_lower(f, e.Lc.data(), f)) {
        e = Extension::PerRidge();
        continue;
      }
      e.v = G;  // G_l - C_lS W = the Schur system's right-hand side
      if (n) la::gemm(true, false, f, c, n, -1, x.Csl.data(), f, pr.W.data(), c, 1, e.v.data(), c);
      la::trsm_lower(false, f, c, e.Lc.data(), f, e.v.data(), c);
      la::trsm_lower(true, f, c, e.Lc.data(), f, e.v.data(), c);
      e.Av.resize(n, c);
      e.Rs = pr.R;
      if (n) {
        la::gemm(false, false, n, c, f, 1, e.Et.data(), f, e.v.data(), c, 0, e.Av.data(), c);
        la::trsm_lower(true, n, c, pr.L.data(), n, e.Av.data(), c);
        la::gemm(false, false, n, c, n, -1, p.Mh.data(), n, e.Av.data(), c, 1, e.Rs.data(), c);
        la::gemm(false, false, n, c, f, 1, x.Msl.data(), f, e.v.data(), c, 1, e.Rs.data(), c);
      }
      e.Rl.resize(f, c);
      la::gemm(false, false, f, c, f, 1, sl.Mh.data(), f, e.v.data(), c, 0, e.Rl.data(), c);
      if (n) {
        la::gemm(true, false, f, c, n, 1, x.Msl.data(), f, pr.W.data(), c, 1, e.Rl.data(), c);
        la::gemm(true, false, f, c, n, -1, x.Msl.data(), f, e.Av.data(), c, 1, e.Rl.data(), c);
      }
      for (int k = 0; k < 2; ++k) {
        const auto cols = [&](const auto& m) { return m.middleCols(k * O, O); };
        double q = cols(e.v).cwiseProduct(cols(e.Rl)).sum();
        double h = cols(e.v).cwiseProduct(cols(Dl)).sum();
        if (n) {
          q += (cols(pr.W) - cols(e.Av)).cwiseProduct(cols(e.Rs)).sum();
          h += (cols(pr.W) - cols(e.Av)).cwiseProduct(cols(p.Dh)).sum();
        }
        e.sse[static_cast<size_t>(k)] = std::max(t.e[k] - 2 * h + q, 0.0);
      }
      e.ok = true;
    }
    pick_best(x.ridge, t.sst, x.r2, x.best, x.score);
    return x;
  }

  void commit(RidgePath& p, Extension&& x, const std::vector<SlotStats>& st,
              const TargetSums& t) const {
    const int64_t n = p.n, f = layer_features, c = 2 * outputs, m = n + f;
    for (size_t a = 0; a < p.ridge.size(); ++a) {
      auto& pr = p.ridge[a];
      auto& e = x.ridge[a];
      if (!pr.ok || !e.ok) {
        pr = RidgePath::PerRidge();
        pr.ok = false;
        continue;
      }
      MatD L = MatD::Zero(m, m);
      L.topLeftCorner(n, n) = pr.L;
      L.block(n, 0, f, n) = e.Et.transpose();
      L.block(n, n, f, f) = e.Lc.triangularView<Eigen::Lower>();
      pr.L = std::move(L);
      MatD W(m, c), R(m, c);
      W.topRows(n) = pr.W - e.Av;
      W.bottomRows(f) = e.v;
      R.topRows(n) = e.Rs;
      R.bottomRows(f) = e.Rl;
      pr.W = std::move(W);
      pr.R = std::move(R);
      pr.sse = e.sse;
      e = Extension::PerRidge();
    }
    MatD Mh(m, m), Dh(m, c);
    Mh.topLeftCorner(n, n) = p.Mh;
    Mh.topRightCorner(n, f) = x.Msl;
    Mh.bottomLeftCorner(f, n) = x.Msl.transpose();
    Mh.bottomRightCorner(f, f) = st[static_cast<size_t>(x.slot)].Mh;
    Dh.topRows(n) = p.Dh;
    Dh.bottomRows(f) = t.Dh[static_cast<size_t>(x.cand)];
    p.Mh = std::move(Mh);
    p.Dh = std::move(Dh);
    p.seq.push_back(x.slot);
    p.cand.push_back(x.cand);
    p.n = m;
  }

  // The screen: per remaining candidate, the held-out R² (mean of K and V) after fitting the
  // path's training residual (at each map's best strength) with that layer alone.
  double screen(const RidgePath& p, const std::array<int64_t, 2>& best, int64_t cand,
                int64_t slot, const std::vector<SlotStats>& st, const TargetSums& t) const {
    namespace la = detail::lapack;
    const int64_t f = layer_features, c = 2 * outputs, O = outputs;
    const SlotStats& sl = st[static_cast<size_t>(slot)];
    // The path's weights for the raw features, map k's columns at its best strength.
    MatD Wo(p.n, c);
    VecD a = VecD::Zero(c), b = VecD::Zero(c);  // sum_i sxh_i^T Wo_i, sum_i mu_i^T Wo_i
    for (int k = 0; k < 2; ++k)
      Wo.middleCols(k * O, O) = p.ridge[static_cast<size_t>(best[static_cast<size_t>(k)])]
                                    .W.middleCols(k * O, O);
    MatD T = MatD::Zero(f, c), Th = MatD::Zero(f, c);
    for (size_t i = 0; i < p.seq.size(); ++i) {
      const int64_t m = p.seq[i];
      const SlotStats& sm = st[static_cast<size_t>(m)];
      auto Wi = Wo.middleRows(static_cast<int64_t>(i) * f, f);
      Wi /= sm.sd;
      a.noalias() += Wi.transpose() * sm.sxh;
      b.noalias() += Wi.transpose() * sm.mu;
      const size_t k = static_cast<size_t>(plan.block(slot, m));
      const bool tr = slot > m;  // the block is X_m^T X_slot
      la::gemm(tr, false, f, c, f, 1 / static_cast<double>(train.n), train.xx[k].data(), f,
               Wo.data() + static_cast<int64_t>(i) * f * c, c, 1, T.data(), c);
      la::gemm(tr, false, f, c, f, 1, held.xx[k].data(), f,
               Wo.data() + static_cast<int64_t>(i) * f * c, c, 1, Th.data(), c);
    }
    T.noalias() -= sl.mu * b.transpose();
    Th.noalias() -= sl.mu * a.transpose();
    Th.noalias() -= sl.sxh * b.transpose();
    Th.noalias() += static_cast<double>(held.n) * sl.mu * b.transpose();
    const MatD g = t.G[static_cast<size_t>(cand)] - T / sl.sd;
    const MatD dh = t.Dh[static_cast<size_t>(cand)] - Th / sl.sd;
    const VecD e = Eigen::Vector2d(p.ridge[static_cast<size_t>(best[0])].sse[0],
                                   p.ridge[static_cast<size_t>(best[1])].sse[1]);
    const MapScores s = score_centered(sl.basis, g, dh, e, t.sst, O, options.ridge_grid);
    const double v = 0.5 * (s.fits[0].r2 + s.fits[1].r2);
    return std::isnan(v) ? -HUGE_VAL : v;
  }

  // Estimated work (1e9 flops) of the round that takes a target layer from k to k + 1 source
  // layers with `left` candidates left.
  double round_cost(int64_t k, int64_t left) const {
    const double f = static_cast<double>(layer_features), c = 2.0 * outputs,
                 n = static_cast<double>(k) * f, A = static_cast<double>(options.ridge_grid.size());
    const double exact = A * (n * n * (f + 3 * c) + n * f * (f + 4 * c) + f * f * f / 3);
    const double tries = static_cast<double>(exact_tries(k, left));
    const double scr = k == 0 ? 0 : static_cast<double>(left) * (4 * n * f * c + 5 * f * f * c);
    return 1e-9 * (tries * exact + scr);
  }

  // How many candidates the round from k source layers fits exactly, of `left` ranked: the first
  // layer's ranking is exact already; exact_candidates while the set is small (the cheap rounds,
  // whose choices shape the rest), one from half of max_source_layers on (each exact fit there
  // costs as much as the first few rounds together).
  int64_t exact_tries(int64_t k, int64_t left) const {
    const int64_t n = k == 0 || 2 * k >= options.max_source_layers ? 1 : options.exact_candidates;
    return std::min(n, left);
  }
  int64_t screen_keep() const { return std::max<int64_t>(8, 4 * options.exact_candidates); }
  // How many candidates the round from k source layers ranks, of nc.
  int64_t screened(int64_t k, int64_t nc) const {
    return k <= 1 ? nc - k : std::max<int64_t>(std::min(nc - 2, screen_keep()) - (k - 2), 0);
  }

  Choice select_auto_one(int64_t j, const std::vector<SlotStats>& st, Progress& progress) const {
    const size_t jj = static_cast<size_t>(j);
    const auto& C = plan.candidates[jj];
    const int64_t NC = static_cast<int64_t>(C.size());
    const int64_t most = std::min(options.max_source_layers, NC);
    const TargetSums t = target_sums(j, st);
    RidgePath p;
    p.ridge.resize(options.ridge_grid.size());
    Choice out;
    // The candidates the next round ranks: all of them for the first two layers, after that the
    // best `keep` by the second layer's screen, less the layers taken since (a layer the screen
    // ranked low rarely rises to the top as the set grows, and the screen is most of a round's
    // cost where candidates are many).
    std::vector<int64_t> pool(static_cast<size_t>(NC));
    for (int64_t ci = 0; ci < NC; ++ci) pool[static_cast<size_t>(ci)] = ci;
    const int64_t keep = screen_keep();
    std::array<double, 2> r2{};
    std::array<int64_t, 2> best{-1, -1};
    double score = -HUGE_VAL;
    int64_t k = 0;
    for (; k < most; ++k) {
      progress.check();
      // Rank the remaining candidates: exactly for the first layer, by the screen after.
      std::vector<std::pair<double, int64_t>> ranked;
      for (int64_t ci : pool) {
        const int64_t slot = plan.slot(C[static_cast<size_t>(ci)]);
        double v;
        if (k == 0) {
          const SlotStats& s = st[static_cast<size_t>(slot)];
          const MapScores ms = score_centered(s.basis, t.G[static_cast<size_t>(ci)],
                                              t.Dh[static_cast<size_t>(ci)], t.e, t.sst, outputs,
                                              options.ridge_grid);
          v = 0.5 * (ms.fits[0].r2 + ms.fits[1].r2);
          if (std::isnan(v)) v = -HUGE_VAL;
        } else {
          v = screen(p, best, ci, slot, st, t);
        }
        ranked.emplace_back(v, ci);
      }
      std::stable_sort(ranked.begin(), ranked.end(),
                       [](const auto& x, const auto& y) { return x.first > y.first; });
      const int64_t left = static_cast<int64_t>(ranked.size());
      const int64_t tries = exact_tries(k, left);
      std::optional<Extension> win;
      std::vector<SelectionStep> round;
      for (int64_t i = 0; i < tries; ++i) {
        progress.check();
        const int64_t ci = ranked[static_cast<size_t>(i)].second;
        Extension x = extend(p, ci, plan.slot(C[static_cast<size_t>(ci)]), st, t);
        x.screen = ranked[static_cast<size_t>(i)].first;
        if (std::isfinite(x.r2[0]) && std::isfinite(x.r2[1]) && std::isfinite(x.screen)) {
          SelectionStep s;
          s.source_layer = C[static_cast<size_t>(ci)];
          s.r2_key = x.r2[0];
          s.r2_value = x.r2[1];
          s.screen = x.screen;
          round.push_back(s);
        }
        if (!win || x.score > win->score) win = std::move(x);
      }
      const bool take = win && std::isfinite(win->score) &&
                        (k == 0 || win->score >= score + options.min_gain);
      // The accepted step last among its round's.
      if (take) {
        auto it = std::find_if(round.begin(), round.end(), [&](const SelectionStep& s) {
          return s.source_layer == C[static_cast<size_t>(win->cand)];
        });
        if (it != round.end()) {
          it->accepted = true;
          std::rotate(it, it + 1, round.end());
        }
      }
      out.steps.insert(out.steps.end(), round.begin(), round.end());
      const double cost = round_cost(k, left);
      if (!take) {
        double rest = 0;
        for (int64_t r = k + 1; r < most; ++r) rest += round_cost(r, screened(r, NC));
        progress.step(cost, rest, j, k);
        break;
      }
      pool.clear();
      for (const auto& [v, ci] : ranked)
        if (ci != win->cand && (k == 0 || static_cast<int64_t>(pool.size()) < keep))
          pool.push_back(ci);
      if (k == 0) std::sort(pool.begin(), pool.end());
      commit(p, std::move(*win), st, t);
      pick_best(p.ridge, t.sst, r2, best, score);
      progress.step(cost, 0, j, k + 1);
    }
    KVB_CHECK_AS(Unavailable, !p.seq.empty() && best[0] >= 0 && best[1] >= 0,
                 "fit: no ridge strength gave a usable fit for target layer " << j);
    // The maps at each one's best strength, rows from the order added to ascending layers.
    const int64_t f = layer_features, O = outputs;
    std::vector<size_t> order(p.seq.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return p.seq[x] < p.seq[y]; });
    for (size_t i : order) out.layers.push_back(plan.slots[static_cast<size_t>(p.seq[i])]);
    for (size_t kind = 0; kind < 2; ++kind) {
      const MatD& Wk = p.ridge[static_cast<size_t>(best[kind])].W;
      MatD w(p.n, O);
      VecD bias = t.mu_y.segment(static_cast<int64_t>(kind) * O, O);
      for (size_t r = 0; r < order.size(); ++r) {
        const size_t i = order[r];
        const SlotStats& s = st[static_cast<size_t>(p.seq[i])];
        w.middleRows(static_cast<int64_t>(r) * f, f) =
            Wk.block(static_cast<int64_t>(i) * f, static_cast<int64_t>(kind) * O, f, O) / s.sd;
        bias.noalias() -= w.middleRows(static_cast<int64_t>(r) * f, f).transpose() * s.mu;
      }
      keep_float(out, kind, w, bias);
      out.fits[kind].r2 = r2[kind];
      out.fits[kind].ridge = options.ridge_grid[static_cast<size_t>(best[kind])];
    }
    out.score = score;
    return out;
  }

  std::vector<Choice> select_auto(Progress& progress) const {
    const int64_t Lt = target.num_layers;
    const double f = static_cast<double>(layer_features), c = 2.0 * outputs;
    const double slots = static_cast<double>(plan.slots.size());
    const double prep = 1e-9 * slots * 14 * f * f * f;
    progress.plan(prep);
    for (int64_t j = 0; j < Lt; ++j) {
      const int64_t NC = static_cast<int64_t>(plan.candidates[static_cast<size_t>(j)].size());
      double first = 1e-9 * static_cast<double>(NC) * 5 * f * f * c;
      for (int64_t k = 0; k < std::min(options.max_source_layers, NC); ++k)
        first += round_cost(k, screened(k, NC));
      progress.plan(first);
    }
    const std::vector<SlotStats> st = slot_stats(slot_sd());
    progress.step(prep, 0, -1, 0);
    std::vector<Choice> out(static_cast<size_t>(Lt));
    detail::parallel_for(Lt, [&](int64_t j) {
      const int64_t NC = static_cast<int64_t>(plan.candidates[static_cast<size_t>(j)].size());
      progress.step(1e-9 * static_cast<double>(NC) * 5 * f * f * c, 0, j, 0);
      out[static_cast<size_t>(j)] = select_auto_one(j, st, progress);
    });
    return out;
  }

  std::vector<Choice> select(Progress& progress) const {
    return options.selection == FitOptions::Selection::kAuto ? select_auto(progress)
                                                             : fit_sets(progress);
  }

  // Held-out R² (mean of K and V, on the sketched outputs) of every source layer alone for
  // every target layer: score[j][l]. One factorisation per source layer, layers in parallel.
  std::vector<std::vector<double>> probe_scores() const {
    const int64_t Ls = source.num_layers, Lt = target.num_layers;
    std::vector<std::vector<double>> score(static_cast<size_t>(Lt),
                                           std::vector<double>(static_cast<size_t>(Ls)));
    detail::parallel_for(Ls, [&](int64_t l) {
      const size_t ll = static_cast<size_t>(l);
      const double sd = layer_sd(static_cast<double>(probe_train.n), probe_train.sx[ll],
                                 probe_train.xx[ll].trace());
      const RidgeBasis b = make_basis(
          static_cast<double>(probe_train.n), probe_train.sx[ll],
          symmetric_from_upper(probe_train.xx[ll]), static_cast<double>(probe_held.n),
          probe_held.sx[ll], symmetric_from_upper(probe_held.xx[ll]),
          VecD::Constant(layer_features, sd));
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
  detail::check_key_norm(options.target_key_norm, target, "target_key_norm");
  detail::check_token_codes(options.target_token_codes, options.token_context,
                            "target_token_codes");
  KVB_CHECK(options.token_code_dims >= 0,
            "token_code_dims must be >= 0, got " << options.token_code_dims);
  KVB_CHECK(options.holdout > 0 && options.holdout <= 0.5,
            "holdout must be in (0, 0.5], got " << options.holdout);
  KVB_CHECK(!options.ridge_grid.empty(), "ridge_grid must not be empty");
  for (double r : options.ridge_grid)
    KVB_CHECK(std::isfinite(r) && r > 0, "ridge values must be finite and > 0, got " << r);
  KVB_CHECK(options.max_source_layers >= 1,
            "max_source_layers must be >= 1, got " << options.max_source_layers);
  KVB_CHECK(options.exact_candidates >= 1,
            "exact_candidates must be >= 1, got " << options.exact_candidates);
  KVB_CHECK(std::isfinite(options.min_gain), "min_gain must be finite, got " << options.min_gain);
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
  const double need = plan_bytes(plan, m.layer_features, m.outputs) + m.token_bytes(plan);
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
  add_impl(src, tgt, start_pos, nullptr, nullptr);
}

void AdapterFitter::add(const KVView& src, const KVView& tgt, int64_t start_pos,
                        const std::vector<int64_t>& alignment) {
  add_impl(src, tgt, start_pos, &alignment, nullptr);
}

void AdapterFitter::add(const KVView& src, const KVView& tgt, int64_t start_pos,
                        const TargetTokens& tokens) {
  add_impl(src, tgt, start_pos, nullptr, &tokens);
}

void AdapterFitter::add(const KVView& src, const KVView& tgt, int64_t start_pos,
                        const std::vector<int64_t>& alignment, const TargetTokens& tokens) {
  add_impl(src, tgt, start_pos, &alignment, &tokens);
}

namespace {

std::string device_name(const Device& d) {
  return d.type == DeviceType::kCUDA ? "cuda:" + std::to_string(d.index) : std::string("cpu");
}

}  // namespace

void AdapterFitter::add_impl(const KVView& src, const KVView& tgt, int64_t start_pos,
                             const std::vector<int64_t>* alignment, const TargetTokens* tokens) {
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
  const TokenCodes& codes = m.options.target_token_codes;
  if (!codes.empty()) {
    KVB_CHECK(tokens != nullptr, "AdapterFitter::add: this fitter takes the target's token codes "
                                 "(target_token_codes); pass the target's token ids");
    detail::check_target_tokens(*tokens, tgt.tokens(), start_pos, codes.vocab,
                                m.options.token_context);
  }
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
  // The codes' features of the paired target tokens, in the rows' order (final pass only).
  const int64_t Dz = probing ? 0 : m.token_width();
  MatD Zc(T, Dz);
  for (int64_t t = 0; t < T && Dz > 0; ++t)
    detail::token_features(codes, m.options.token_context, *tokens, start_pos,
                           alignment ? tgt_rows[static_cast<size_t>(t)] : t, 1,
                           Zc.data() + dest[static_cast<size_t>(t)] * Dz);
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
    if (Dz > 0) {  // on the host, as BLAS products (independent ones in parallel)
      TokenMoments& tm = part ? m.token_held : m.token_train;
      tm.sz += Zc.middleRows(first, rows).colwise().sum().transpose();
      const double* z = Zc.data() + first * Dz;
      const int64_t S = static_cast<int64_t>(layers.size());
      detail::parallel_for(S + 2, [&](int64_t i) {
        if (i < S)
          detail::lapack::gemm(true, false, Dz, Fl, rows, 1, z, Dz,
                               X.data() + first * X.cols() + i * Fl, X.cols(), 1,
                               tm.zx[static_cast<size_t>(i)].data(), Fl);
        else if (i == S)
          detail::lapack::gemm(true, false, Dz, Y.cols(), rows, 1, z, Dz,
                               Y.data() + first * Y.cols(), Y.cols(), 1, tm.zy.data(), Y.cols());
        else
          detail::lapack::syrk_upper(true, Dz, rows, 1, z, Dz, 1, tm.zz.data(), Dz);
      });
    }
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

LinearAdapter AdapterFitter::fit() const { return fit(FitProgressCallback()); }

LinearAdapter AdapterFitter::fit(const FitProgressCallback& progress) const {
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
  out->key_norm = m.options.target_key_norm;
  m.sync_from_device();
  Progress tracker(&progress);
  std::vector<Impl::Choice> chosen;
  try {
    chosen = m.select(tracker);
  } catch (...) {
    tracker.rethrow();
    throw;
  }
  // The token codes' terms of every map, refitted with the chosen maps (target layers in
  // parallel); with codes wider than token_code_dims, fitted at full width first to find the
  // basis they are compressed to, then again on the compressed codes.
  std::vector<std::array<double, 2>> token_ridge(chosen.size()), token_gain(chosen.size());
  if (m.token_width() > 0) {
    const std::vector<double> sd = m.slot_sd();
    std::vector<Impl::TokenFit> fits(chosen.size());
    const TokenCodes& codes = m.options.target_token_codes;
    const int64_t r = m.options.token_code_dims;
    // Work of one target layer's terms at Dz code features (1e9 flops, an estimate as above).
    const auto work = [&](size_t j, int64_t Dz) {
      const double F = static_cast<double>(chosen[j].layers.size() * m.layer_features);
      const double D = static_cast<double>(Dz), O = static_cast<double>(m.outputs);
      const double grid = static_cast<double>(m.options.ridge_grid.size());
      return 2e-9 * (F * F * F / 3 + F * F * (3 * D + O) + 2 * F * D * D +
                     grid * (D * D * D / 3 + 3 * D * D * O));
    };
    const bool compress = r > 0 && r < codes.dims;
    double second_round = 0;  // the work on the compressed codes
    for (size_t j = 0; j < chosen.size(); ++j) {
      const double second = compress ? work(j, r * m.options.token_context) : 0.0;
      second_round += second;
      tracker.plan(work(j, m.token_width()) + second);
    }
    const auto fit_terms = [&](const TokenMoments& tt, const TokenMoments& th) {
      detail::parallel_for(static_cast<int64_t>(chosen.size()), [&](int64_t i) {
        const size_t j = static_cast<size_t>(i);
        tracker.check();
        fits[j] = m.token_terms(i, sd, chosen[j], tt, th);
        tracker.step(work(j, tt.sz.size()), 0, i, static_cast<int64_t>(chosen[j].layers.size()));
      });
    };
    const auto any_term = [&] {
      return std::any_of(fits.begin(), fits.end(), [](const Impl::TokenFit& f) {
        return f.wz[0].size() > 0 || f.wz[1].size() > 0;
      });
    };
    try {  // a progress callback that throws stops the work (as in select)
      fit_terms(m.token_train, m.token_held);
      const bool any = any_term();
      if (!any && compress) tracker.step(0, second_round, -1, 0);  // no second round: not done
      if (any && compress) {
        const MatD P = m.code_basis(fits, r);
        fit_terms(m.project(m.token_train, P), m.project(m.token_held, P));
        using RowMatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
        out->token_codes.vocab = codes.vocab;
        out->token_codes.dims = r;
        out->token_codes.values.resize(static_cast<size_t>(codes.vocab * r));
        Eigen::Map<RowMatF>(out->token_codes.values.data(), codes.vocab, r) =
            (Eigen::Map<const RowMatF>(codes.values.data(), codes.vocab, codes.dims)
                 .cast<double>() *
             P)
                .cast<float>();
      } else {
        out->token_codes = codes;
      }
    } catch (...) {
      tracker.rethrow();
      throw;
    }
    if (any_term()) {  // the second round may have dropped every term
      out->token_context = m.options.token_context;
      out->token_weights.resize(chosen.size());
      for (size_t j = 0; j < chosen.size(); ++j)
        for (size_t k = 0; k < 2; ++k) {
          const Impl::TokenFit& f = fits[j];
          token_ridge[j][k] = f.ridge[k];
          if (f.wz[k].size() == 0) continue;
          token_gain[j][k] = f.r2_gain[k];
          Impl::keep_float(chosen[j], k, f.wx[k], f.bias[k]);
          auto& w = out->token_weights[j][k];
          w.resize(static_cast<size_t>(f.wz[k].size()));
          Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
              w.data(), f.wz[k].rows(), f.wz[k].cols()) = f.wz[k].cast<float>();
        }
    } else {
      out->token_codes = TokenCodes();  // no map takes them: an adapter without codes
    }
  }
  for (size_t j = 0; j < chosen.size(); ++j) {
    Impl::Choice& c = chosen[j];
    out->layers.push_back(c.layers);
    LayerFit lf;
    lf.source_layers = c.layers;
    lf.r2_key = c.fits[0].r2 + token_gain[j][0];
    lf.r2_value = c.fits[1].r2 + token_gain[j][1];
    lf.ridge_key = c.fits[0].ridge;
    lf.ridge_value = c.fits[1].ridge;
    if (out->token_context > 0) {
      lf.token_ridge_key = token_ridge[j][0];
      lf.token_ridge_value = token_ridge[j][1];
    }
    lf.selection = std::move(c.steps);
    out->report.layers.push_back(lf);
    out->weights.push_back(std::move(c.weights));
    out->bias.push_back(std::move(c.bias));
  }
  return LinearAdapter(std::move(out));
}

}  // namespace kvbridge
