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

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Sufficient statistics of one token split (train or held-out).
struct Moments {
  int64_t n = 0;
  VecD sx;                                // [F]
  MatD xx;                                // [F, F], upper triangle accumulated
  std::vector<std::array<VecD, 2>> sy;    // [target layer][K/V] -> [O]
  std::vector<std::array<MatD, 2>> xy;    // -> [F, O]
  std::vector<std::array<double, 2>> yy;  // sum of squares

  void init(int64_t features, int64_t layers, int64_t outputs) {
    sx = VecD::Zero(features);
    xx = MatD::Zero(features, features);
    sy.assign(static_cast<size_t>(layers), {VecD::Zero(outputs), VecD::Zero(outputs)});
    xy.assign(static_cast<size_t>(layers), {MatD::Zero(features, outputs), MatD::Zero(features, outputs)});
    yy.assign(static_cast<size_t>(layers), {0.0, 0.0});
  }
};

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
  MatD weights;  // [F_S, O]
  VecD bias;     // [O]
};

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
  std::vector<int64_t> used_layers;  // source layers that feed anything, ascending
  int64_t layer_features = 0;        // 2 * source kv_heads * head_dim
  int64_t outputs = 0;               // target kv_heads * head_dim
  Moments train, held;
  uint64_t tokens_seen = 0;

  int64_t features() const { return static_cast<int64_t>(used_layers.size()) * layer_features; }

  // Feature indices of a set of source layers, in ascending layer order.
  std::vector<int64_t> feature_index(const std::vector<int64_t>& layers) const {
    std::vector<int64_t> idx;
    for (int64_t l : layers) {
      const int64_t slot = std::lower_bound(used_layers.begin(), used_layers.end(), l) -
                           used_layers.begin();
      for (int64_t f = 0; f < layer_features; ++f) idx.push_back(slot * layer_features + f);
    }
    return idx;
  }

  // Ridge fits of target layer j's K and V maps from source layers S; weights only if asked.
  std::array<MapFit, 2> evaluate(int64_t j, const std::vector<int64_t>& S, bool keep) const {
    const std::vector<int64_t> idx = feature_index(S);
    const int64_t F = static_cast<int64_t>(idx.size());
    const double n = static_cast<double>(train.n), nh = static_cast<double>(held.n);
    VecD mu(F), sxh(F);
    MatD cov(F, F), covh(F, F);
    for (int64_t a = 0; a < F; ++a) {
      mu[a] = train.sx[idx[a]] / n;
      sxh[a] = held.sx[idx[a]];
    }
    for (int64_t a = 0; a < F; ++a)
      for (int64_t b = a; b < F; ++b) {
        const int64_t r = std::min(idx[a], idx[b]), c = std::max(idx[a], idx[b]);
        cov(a, b) = cov(b, a) = train.xx(r, c) / n - mu[a] * mu[b];
        covh(a, b) = covh(b, a) =
            held.xx(r, c) - mu[a] * sxh[b] - sxh[a] * mu[b] + nh * mu[a] * mu[b];
      }
    Eigen::SelfAdjointEigenSolver<MatD> eig(cov);
    const MatD& Q = eig.eigenvectors();
    const VecD lam = eig.eigenvalues().cwiseMax(0.0);
    const double scale = std::max(cov.trace() / static_cast<double>(F), 1e-300);
    const MatD M = Q.transpose() * covh * Q;

    std::array<MapFit, 2> fits;
    for (int kind = 0; kind < 2; ++kind) {
      const MatD& xy = train.xy[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      const MatD& xyh = held.xy[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      const VecD mu_y = train.sy[static_cast<size_t>(j)][static_cast<size_t>(kind)] / n;
      const VecD& syh = held.sy[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      const double yyh = held.yy[static_cast<size_t>(j)][static_cast<size_t>(kind)];
      MatD G(F, outputs), Dh(F, outputs);
      for (int64_t a = 0; a < F; ++a) {
        G.row(a) = xy.row(idx[a]) / n - mu[a] * mu_y.transpose();
        Dh.row(a) = xyh.row(idx[a]) - mu[a] * syh.transpose() - sxh[a] * mu_y.transpose() +
                    nh * mu[a] * mu_y.transpose();
      }
      const MatD P = Q.transpose() * G;            // W(λ) = Q diag(1/(λ_i + λ)) P
      const VecD u = (P.cwiseProduct(Q.transpose() * Dh)).rowwise().sum();
      const MatD H = M.cwiseProduct(P * P.transpose());
      const double e = yyh - 2 * mu_y.dot(syh) + nh * mu_y.squaredNorm();
      const double sst = std::max(yyh - syh.squaredNorm() / nh, 1e-300);
      MapFit& best = fits[static_cast<size_t>(kind)];
      for (double alpha : options.ridge_grid) {
        const VecD d = (lam.array() + alpha * scale).inverse();
        const double sse = e - 2 * d.dot(u) + d.dot(H * d);
        const double r2 = 1 - sse / sst;
        if (r2 > best.r2) {
          best.r2 = r2;
          best.ridge = alpha;
        }
      }
      if (keep) {
        const VecD d = (lam.array() + best.ridge * scale).inverse();
        best.weights = Q * d.asDiagonal() * P;
        best.bias = mu_y - best.weights.transpose() * mu;
      }
    }
    return fits;
  }

  std::vector<int64_t> select_layers(int64_t j) const {
    if (options.selection == FitOptions::Selection::kAll) return used_layers;
    if (options.selection == FitOptions::Selection::kExplicit)
      return options.source_layers[static_cast<size_t>(j)];
    // Greedy forward selection on held-out R², never on in-sample fit (which only rises).
    std::vector<int64_t> chosen;
    double current = -std::numeric_limits<double>::infinity();
    while (static_cast<int64_t>(chosen.size()) < options.max_source_layers) {
      double best_score = -std::numeric_limits<double>::infinity();
      int64_t best_layer = -1;
      for (int64_t l : used_layers) {
        if (std::find(chosen.begin(), chosen.end(), l) != chosen.end()) continue;
        std::vector<int64_t> trial = chosen;
        trial.insert(std::lower_bound(trial.begin(), trial.end(), l), l);
        const auto fits = evaluate(j, trial, false);
        const double score = 0.5 * (fits[0].r2 + fits[1].r2);
        if (score > best_score) {
          best_score = score;
          best_layer = l;
        }
      }
      if (best_layer < 0 || (!chosen.empty() && best_score < current + 1e-4)) break;
      chosen.insert(std::lower_bound(chosen.begin(), chosen.end(), best_layer), best_layer);
      current = best_score;
    }
    return chosen;
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
      m.options.source_layers[j] = list;
      m.used_layers.insert(m.used_layers.end(), list.begin(), list.end());
    }
    std::sort(m.used_layers.begin(), m.used_layers.end());
    m.used_layers.erase(std::unique(m.used_layers.begin(), m.used_layers.end()),
                        m.used_layers.end());
  } else {
    for (int64_t l = 0; l < source.num_layers; ++l) m.used_layers.push_back(l);
  }
  const double F = static_cast<double>(m.features());
  const double bytes = 2.0 * 8.0 * (F * F + 2.0 * target.num_layers * F * m.outputs);
  KVB_CHECK(bytes <= static_cast<double>(options.max_memory_bytes),
            "the fitter's accumulators would take " << bytes / (1 << 20) << " MiB (" << F
                << " features), over max_memory_bytes " << options.max_memory_bytes / (1 << 20)
                << " MiB; list fewer source layers per target layer (selection kExplicit)");
  m.train.init(m.features(), target.num_layers, m.outputs);
  m.held.init(m.features(), target.num_layers, m.outputs);
}

AdapterFitter::~AdapterFitter() = default;

int64_t AdapterFitter::train_tokens() const noexcept { return impl_->train.n; }
int64_t AdapterFitter::holdout_tokens() const noexcept { return impl_->held.n; }
int64_t AdapterFitter::memory_bytes() const noexcept {
  const int64_t F = impl_->features();
  return 2 * 8 * (F * F + 2 * impl_->target.num_layers * F * impl_->outputs);
}

void AdapterFitter::add(const KVView& src, const KVView& tgt, int64_t start_pos) {
  Impl& m = *impl_;
  check_pair(m.source, m.target, src, tgt, "source_kv", "target_kv");
  KVB_CHECK(start_pos >= 0, "start_pos must be >= 0, got " << start_pos);
  const int64_t T = src.tokens();
  if (T == 0) return;
  // Everything is computed before anything is accumulated, so a bad sample changes nothing.
  MatD X(T, m.features());
  for (size_t s = 0; s < m.used_layers.size(); ++s)
    X.middleCols(static_cast<int64_t>(s) * m.layer_features, m.layer_features) = unrotated_rows(
        m.source, m.source_inv_freq, m.options.rope_aware, src, m.used_layers[s], start_pos);
  std::vector<MatD> Y;
  for (int64_t j = 0; j < m.target.num_layers; ++j)
    Y.push_back(unrotated_rows(m.target, m.target_inv_freq, m.options.rope_aware, tgt, j,
                               start_pos));

  std::vector<int64_t> rows[2];
  for (int64_t t = 0; t < T; ++t) {
    const uint64_t h = splitmix64(m.options.seed ^ splitmix64(m.tokens_seen++));
    const bool is_held = static_cast<double>(h >> 11) * 0x1.0p-53 < m.options.holdout;
    rows[is_held].push_back(t);
  }
  for (int part = 0; part < 2; ++part) {
    if (rows[part].empty()) continue;
    Moments& acc = part ? m.held : m.train;
    const MatD Xp = X(rows[part], Eigen::all);
    acc.n += static_cast<int64_t>(rows[part].size());
    acc.sx += Xp.colwise().sum().transpose();
    acc.xx.selfadjointView<Eigen::Upper>().rankUpdate(Xp.transpose());
    for (int64_t j = 0; j < m.target.num_layers; ++j)
      for (int kind = 0; kind < 2; ++kind) {
        const MatD Yp = Y[static_cast<size_t>(j)](rows[part], Eigen::seqN(kind * m.outputs, m.outputs));
        acc.xy[static_cast<size_t>(j)][static_cast<size_t>(kind)].noalias() += Xp.transpose() * Yp;
        acc.sy[static_cast<size_t>(j)][static_cast<size_t>(kind)] += Yp.colwise().sum().transpose();
        acc.yy[static_cast<size_t>(j)][static_cast<size_t>(kind)] += Yp.squaredNorm();
      }
  }
}

LinearAdapter AdapterFitter::fit() const {
  const Impl& m = *impl_;
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
    const std::vector<int64_t> S = m.select_layers(j);
    const auto fits = m.evaluate(j, S, /*keep=*/true);
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
