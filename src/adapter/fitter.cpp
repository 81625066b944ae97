#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>

#include "kvbridge/adapter.h"
#include "kvbridge/error.h"
#include "src/adapter/adapter_impl.h"
#include "src/adapter/numeric.h"

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

// Un-rotated (if asked) K then V of one layer, as float64 rows [tokens, 2 * heads * dim].
MatD unrotated_rows(const ModelSpec& spec, const std::vector<double>& inv_freq, bool rope_aware,
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
    detail::apply_rope(spec, inv_freq, start_pos, /*inverse=*/true, T, spec.num_kv_heads,
                       out.data(), 2 * W);
  return out;
}

struct MapFit {
  double r2 = -std::numeric_limits<double>::infinity();
  double ridge = 0;
  MatD weights;  // [F, O]
  VecD bias;     // [O]
};

// What ridge fits of any output need from one feature set: the eigenbasis of the training
// covariance and the held-out covariance in that basis. One eigendecomposition serves every
// ridge strength and every output: W(r) = Q diag(1 / (lambda + r)) Q^T G.
struct RidgeBasis {
  double n = 0, nh = 0;  // training / held-out token counts
  VecD mu, sxh;          // training mean, held-out sum [F]
  MatD Q;                // eigenvectors [F, F]
  VecD lambda;           // eigenvalues, clamped at 0
  double scale = 1;      // mean feature variance: ridge strengths are relative to it
  MatD M;                // Q^T covh Q, covh the held-out scatter about the training mean
};

// xx and xxh are raw sums over tokens of x x^T (full symmetric), sx and sxh of x.
RidgeBasis make_basis(double n, const VecD& sx, const MatD& xx, double nh, const VecD& sxh,
                      const MatD& xxh) {
  RidgeBasis b;
  b.n = n;
  b.nh = nh;
  b.mu = sx / n;
  b.sxh = sxh;
  const MatD cov = xx / n - b.mu * b.mu.transpose();
  const MatD covh =
      xxh - b.mu * sxh.transpose() - sxh * b.mu.transpose() + nh * b.mu * b.mu.transpose();
  Eigen::SelfAdjointEigenSolver<MatD> eig(cov);
  b.Q = eig.eigenvectors();
  b.lambda = eig.eigenvalues().cwiseMax(0.0);
  b.scale = std::max(cov.trace() / static_cast<double>(sx.size()), 1e-300);
  b.M = b.Q.transpose() * covh * b.Q;
  return b;
}

// The ridge map of one output block: sy [O] and xy [F, O] are raw training sums, syh, xyh and
// yyh (sum of squares) held-out ones. Scores every ridge in `grid` by held-out R² in closed form;
// solves for the weights of the best one only if `keep`.
MapFit fit_map(const RidgeBasis& b, const VecD& sy, const MatD& xy, const VecD& syh,
               const MatD& xyh, double yyh, const std::vector<double>& grid, bool keep) {
  const VecD mu_y = sy / b.n;
  const MatD G = xy / b.n - b.mu * mu_y.transpose();
  const MatD Dh = xyh - b.mu * syh.transpose() - b.sxh * mu_y.transpose() +
                  b.nh * b.mu * mu_y.transpose();
  const MatD P = b.Q.transpose() * G;
  const VecD u = (P.cwiseProduct(b.Q.transpose() * Dh)).rowwise().sum();
  const MatD H = b.M.cwiseProduct(P * P.transpose());
  const double e = yyh - 2 * mu_y.dot(syh) + b.nh * mu_y.squaredNorm();
  const double sst = std::max(yyh - syh.squaredNorm() / b.nh, 1e-300);
  MapFit best;
  for (double alpha : grid) {
    const VecD d = (b.lambda.array() + alpha * b.scale).inverse();
    const double sse = std::max(e - 2 * d.dot(u) + d.dot(H * d), 0.0);  // >= 0 but for rounding
    const double r2 = 1 - sse / sst;
    if (r2 > best.r2) {
      best.r2 = r2;
      best.ridge = alpha;
    }
  }
  if (keep) {
    const VecD d = (b.lambda.array() + best.ridge * b.scale).inverse();
    best.weights = b.Q * d.asDiagonal() * P;
    best.bias = mu_y - best.weights.transpose() * b.mu;
  }
  return best;
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
                const KVView& dst, const char* src_name, const char* dst_name) {
  src.check_matches(source, src_name);
  dst.check_matches(target, dst_name);
  KVB_CHECK(src.tokens() == dst.tokens(), dst_name << " holds " << dst.tokens() << " tokens but "
                                                   << src_name << " holds " << src.tokens());
  KVB_CHECK(src.device().type == DeviceType::kCPU && dst.device().type == DeviceType::kCPU,
            src_name << " and " << dst_name << " must be CPU views here");
}


struct AdapterFitter::Impl {
  ModelSpec source, target;
  FitOptions options;
  std::vector<double> source_inv_freq, target_inv_freq;
  int64_t layer_features = 0;  // Fl = 2 * source kv_heads * head_dim
  int64_t outputs = 0;         // O = target kv_heads * head_dim
  int passes = 1, pass = 0;
  uint64_t tokens_seen = 0;    // restarts each pass, so passes over the same data split alike
  // Probe pass (pass 0 of 2): every source layer alone against sketched target outputs.
  int64_t sketch_width = 0;
  MatD sketch;  // [O, sketch_width]
  ProbeMoments probe_train, probe_held;
  // Final pass: the plan's blocks.
  Plan plan;
  BlockMoments train, held;

  bool probing() const { return passes == 2 && pass == 0; }
  int64_t maps() const { return 2 * target.num_layers; }

  double probe_bytes() const {
    return ProbeMoments::bytes(source.num_layers, layer_features, maps(), sketch_width);
  }

  void start_final_pass(Plan p) {
    // The probe's accumulators go first, so the two passes' never coexist.
    probe_train = ProbeMoments();
    probe_held = ProbeMoments();
    sketch = MatD();
    plan = std::move(p);
    train.init(plan, layer_features, outputs);
    held.init(plan, layer_features, outputs);
    tokens_seen = 0;
  }

  // Target layer j's K and V maps from source layers S (ascending, a subset of the plan's
  // candidates for j), scored on held-out tokens for every ridge strength.
  struct Candidate {
    std::vector<int64_t> layers;
    RidgeBasis basis;
    MatD xy, xyh;               // [F, 2 * O]: features against keys then values
    std::array<MapFit, 2> fits;  // K, V: best ridge and held-out R², no weights yet
    double score() const { return 0.5 * (fits[0].r2 + fits[1].r2); }
  };

  Candidate evaluate(int64_t j, const std::vector<int64_t>& S) const {
    const int64_t Fl = layer_features, O = outputs, F = static_cast<int64_t>(S.size()) * Fl;
    const auto& C = plan.candidates[static_cast<size_t>(j)];
    const size_t jj = static_cast<size_t>(j);
    Candidate out;
    out.layers = S;
    VecD sx(F), sxh(F);
    MatD xx(F, F), xxh(F, F);
    out.xy.resize(F, 2 * O);
    out.xyh.resize(F, 2 * O);
    for (size_t a = 0; a < S.size(); ++a) {
      const int64_t sa = plan.slot(S[a]), ra = static_cast<int64_t>(a) * Fl;
      const size_t ca = static_cast<size_t>(std::find(C.begin(), C.end(), S[a]) - C.begin());
      sx.segment(ra, Fl) = train.sx[static_cast<size_t>(sa)];
      sxh.segment(ra, Fl) = held.sx[static_cast<size_t>(sa)];
      out.xy.middleRows(ra, Fl) = train.xy[jj][ca];
      out.xyh.middleRows(ra, Fl) = held.xy[jj][ca];
      for (size_t b = a; b < S.size(); ++b) {
        const int64_t rb = static_cast<int64_t>(b) * Fl;
        const size_t k = static_cast<size_t>(plan.block(sa, plan.slot(S[b])));
        if (a == b) {
          xx.block(ra, ra, Fl, Fl) = symmetric_from_upper(train.xx[k]);
          xxh.block(ra, ra, Fl, Fl) = symmetric_from_upper(held.xx[k]);
        } else {  // S ascending, so slot a < slot b: the block is X_a^T X_b
          xx.block(ra, rb, Fl, Fl) = train.xx[k];
          xx.block(rb, ra, Fl, Fl) = train.xx[k].transpose();
          xxh.block(ra, rb, Fl, Fl) = held.xx[k];
          xxh.block(rb, ra, Fl, Fl) = held.xx[k].transpose();
        }
      }
    }
    out.basis = make_basis(static_cast<double>(train.n), sx, xx, static_cast<double>(held.n),
                           sxh, xxh);
    for (int kind = 0; kind < 2; ++kind)
      out.fits[static_cast<size_t>(kind)] = map(j, out, kind, /*keep=*/false);
    return out;
  }

  MapFit map(int64_t j, const Candidate& c, int kind, bool keep) const {
    const int64_t O = outputs;
    const size_t jj = static_cast<size_t>(j);
    return fit_map(c.basis, train.sy[jj].segment(kind * O, O), c.xy.middleCols(kind * O, O),
                   held.sy[jj].segment(kind * O, O), c.xyh.middleCols(kind * O, O),
                   held.yy[jj][static_cast<size_t>(kind)], options.ridge_grid, keep);
  }

  // The layers fit() uses for target layer j, with their basis (not recomputed for the weights).
  Candidate select(int64_t j) const {
    const auto& C = plan.candidates[static_cast<size_t>(j)];
    if (options.selection != FitOptions::Selection::kAuto) return evaluate(j, C);
    // Greedy forward selection on held-out R², never on in-sample fit (which only rises).
    Candidate chosen;
    double current = -std::numeric_limits<double>::infinity();
    while (static_cast<int64_t>(chosen.layers.size()) < options.max_source_layers) {
      Candidate best;
      bool found = false;
      for (int64_t l : C) {
        if (std::find(chosen.layers.begin(), chosen.layers.end(), l) != chosen.layers.end())
          continue;
        std::vector<int64_t> trial = chosen.layers;
        trial.insert(std::lower_bound(trial.begin(), trial.end(), l), l);
        Candidate c = evaluate(j, trial);
        if (!found || c.score() > best.score()) {
          best = std::move(c);
          found = true;
        }
      }
      if (!found || (!chosen.layers.empty() && best.score() < current + 1e-4)) break;
      current = best.score();
      chosen = std::move(best);
    }
    return chosen;
  }

  // Held-out R² (mean of K and V, on the sketched outputs) of every source layer alone for
  // every target layer: score[j][l].
  std::vector<std::vector<double>> probe_scores() const {
    const int64_t Ls = source.num_layers, Lt = target.num_layers, r = sketch_width;
    std::vector<std::vector<double>> score(static_cast<size_t>(Lt),
                                           std::vector<double>(static_cast<size_t>(Ls)));
    for (int64_t l = 0; l < Ls; ++l) {
      const size_t ll = static_cast<size_t>(l);
      const RidgeBasis basis = make_basis(
          static_cast<double>(probe_train.n), probe_train.sx[ll],
          symmetric_from_upper(probe_train.xx[ll]), static_cast<double>(probe_held.n),
          probe_held.sx[ll], symmetric_from_upper(probe_held.xx[ll]));
      for (int64_t j = 0; j < Lt; ++j) {
        double sum = 0;
        for (int64_t kind = 0; kind < 2; ++kind) {
          const int64_t map = 2 * j + kind;
          sum += fit_map(basis, probe_train.sz.segment(map * r, r),
                         probe_train.xz[ll].middleCols(map * r, r),
                         probe_held.sz.segment(map * r, r),
                         probe_held.xz[ll].middleCols(map * r, r), probe_held.zz[map],
                         options.ridge_grid, false)
                     .r2;
        }
        score[static_cast<size_t>(j)][ll] = 0.5 * sum;
      }
    }
    return score;
  }
};

AdapterFitter::AdapterFitter(const ModelSpec& source, const ModelSpec& target,
                             const FitOptions& options)
    : impl_(std::make_unique<Impl>()) {
  source.validate();
  target.validate();
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
  m.source_inv_freq = detail::rope_inv_freq(source);
  m.target_inv_freq = detail::rope_inv_freq(target);
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
  Impl& m = *impl_;
  check_pair(m.source, m.target, src, tgt, "source_kv", "target_kv");
  const int64_t T = src.tokens();
  detail::check_positions(start_pos, T);
  if (T == 0) return;
  const int64_t Fl = m.layer_features, O = m.outputs, Lt = m.target.num_layers;
  const bool probing = m.probing();
  std::vector<int64_t> layers;
  if (probing) {
    for (int64_t l = 0; l < m.source.num_layers; ++l) layers.push_back(l);
  } else {
    layers = m.plan.slots;
  }
  // Everything is computed before anything is accumulated, so a bad sample changes nothing.
  MatD X(T, static_cast<int64_t>(layers.size()) * Fl);
  for (size_t s = 0; s < layers.size(); ++s)
    X.middleCols(static_cast<int64_t>(s) * Fl, Fl) = unrotated_rows(
        m.source, m.source_inv_freq, m.options.rope_aware, src, layers[s], start_pos);
  MatD Y(T, Lt * 2 * O);  // target layer j's keys then values at columns j * 2O
  for (int64_t j = 0; j < Lt; ++j)
    Y.middleCols(j * 2 * O, 2 * O) =
        unrotated_rows(m.target, m.target_inv_freq, m.options.rope_aware, tgt, j, start_pos);
  if (probing) {
    const int64_t r = m.sketch_width;
    MatD Z(T, m.maps() * r);
    for (int64_t map = 0; map < m.maps(); ++map)
      Z.middleCols(map * r, r).noalias() = Y.middleCols(map * O, O) * m.sketch;
    Y = std::move(Z);
  }

  std::vector<int64_t> rows[2];
  for (int64_t t = 0; t < T; ++t) {
    const uint64_t h = splitmix64(m.options.seed ^ splitmix64(m.tokens_seen++));
    const bool is_held = static_cast<double>(h >> 11) * 0x1.0p-53 < m.options.holdout;
    rows[is_held].push_back(t);
  }
  for (int part = 0; part < 2; ++part) {
    if (rows[part].empty()) continue;
    const MatD Xp = X(rows[part], Eigen::all);
    const MatD Yp = Y(rows[part], Eigen::all);
    if (probing) {
      ProbeMoments& acc = part ? m.probe_held : m.probe_train;
      const int64_t r = m.sketch_width;
      acc.n += static_cast<int64_t>(rows[part].size());
      acc.sz += Yp.colwise().sum().transpose();
      for (int64_t map = 0; map < m.maps(); ++map)
        acc.zz[map] += Yp.middleCols(map * r, r).squaredNorm();
      for (size_t l = 0; l < layers.size(); ++l) {
        const auto Xl = Xp.middleCols(static_cast<int64_t>(l) * Fl, Fl);
        acc.sx[l] += Xl.colwise().sum().transpose();
        acc.xx[l].selfadjointView<Eigen::Upper>().rankUpdate(Xl.transpose());
        acc.xz[l].noalias() += Xl.transpose() * Yp;
      }
      continue;
    }
    BlockMoments& acc = part ? m.held : m.train;
    acc.n += static_cast<int64_t>(rows[part].size());
    for (size_t s = 0; s < layers.size(); ++s)
      acc.sx[s] += Xp.middleCols(static_cast<int64_t>(s) * Fl, Fl).colwise().sum().transpose();
    for (size_t k = 0; k < m.plan.blocks.size(); ++k) {
      const auto [a, b] = m.plan.blocks[k];
      const auto Xa = Xp.middleCols(a * Fl, Fl);
      if (a == b)
        acc.xx[k].selfadjointView<Eigen::Upper>().rankUpdate(Xa.transpose());
      else
        acc.xx[k].noalias() += Xa.transpose() * Xp.middleCols(b * Fl, Fl);
    }
    for (int64_t j = 0; j < Lt; ++j) {
      const size_t jj = static_cast<size_t>(j);
      const auto Yj = Yp.middleCols(j * 2 * O, 2 * O);
      acc.sy[jj] += Yj.colwise().sum().transpose();
      acc.yy[jj][0] += Yj.leftCols(O).squaredNorm();
      acc.yy[jj][1] += Yj.rightCols(O).squaredNorm();
      const auto& C = m.plan.candidates[jj];
      for (size_t c = 0; c < C.size(); ++c)
        acc.xy[jj][c].noalias() += Xp.middleCols(m.plan.slot(C[c]) * Fl, Fl).transpose() * Yj;
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
  for (int64_t j = 0; j < m.target.num_layers; ++j) {
    const Impl::Candidate chosen = m.select(j);
    const std::vector<int64_t>& S = chosen.layers;
    const std::array<MapFit, 2> fits = {m.map(j, chosen, 0, /*keep=*/true),
                                        m.map(j, chosen, 1, /*keep=*/true)};
    out->layers.push_back(S);
    LayerFit lf;
    lf.source_layers = S;
    lf.r2_key = fits[0].r2;
    lf.r2_value = fits[1].r2;
    lf.ridge_key = fits[0].ridge;
    lf.ridge_value = fits[1].ridge;
    out->report.layers.push_back(lf);
    std::array<std::vector<float>, 2> w, b;
    for (int kind = 0; kind < 2; ++kind) {
      const MapFit& f = fits[static_cast<size_t>(kind)];
      w[static_cast<size_t>(kind)].resize(static_cast<size_t>(f.weights.size()));
      Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
          w[static_cast<size_t>(kind)].data(), f.weights.rows(), f.weights.cols()) =
          f.weights.cast<float>();
      b[static_cast<size_t>(kind)].assign(f.bias.data(), f.bias.data() + f.bias.size());
    }
    out->weights.push_back(std::move(w));
    out->bias.push_back(std::move(b));
  }
  return LinearAdapter(std::move(out));
}

}  // namespace kvbridge
