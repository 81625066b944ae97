"""AdapterFitter add() and fit() against torch doing the same float64 work, in one process.

Both sides get the same features: random KV for a source and a target model (default 8 layers x
4 KV heads x 64 on both sides), `source_layers="all"`, rope_aware=False so that the features are
the raw keys and values (X [tokens, Ls * 2 * kv_heads * head_dim], Y likewise for the target, in
float64).

- add: one fitter.add() of the sample (float32 KV in, float64 features, train / held-out split,
  upper triangle of X^T X and X^T Y for every target layer) against torch's `X.T @ X` and
  `X.T @ Y` on the prebuilt float64 X and Y. Ratio = torch time / add time (>= 1: add is faster),
  and the rate of each in GFLOP/s of the products it runs (syrk counts n^2 k, gemm 2 m n k).
- fit: fitter.fit() against the same ridge selection written with torch.linalg on the same kind
  of normal equations (one torch.linalg.eigh of the training covariance, the held-out covariance
  in its basis, every ridge strength scored in closed form per target layer and K/V map, the
  weights of the best): ratio = fit time / torch time (<= 2 is the target). The eigh alone is
  printed too.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/python/bench_fitter_speed.py [--tokens 2048]
"""
import argparse
import os
import time

import torch

import kvbridge


def torch_ridge_fit(x_tr, y_tr, x_h, y_h, layers, width, grid):
    """Held-out ridge selection per map, as the fitter does it, in torch float64.

    x_* [tokens, F], y_* [tokens, layers * 2 * width]. Returns per layer and map (R², ridge).
    """
    n, nh = x_tr.shape[0], x_h.shape[0]
    xx, xxh = x_tr.T @ x_tr, x_h.T @ x_h  # the accumulated moments (not timed by the caller)
    sx, sxh = x_tr.sum(0), x_h.sum(0)
    xy, xyh = x_tr.T @ y_tr, x_h.T @ y_h
    sy, syh = y_tr.sum(0), y_h.sum(0)
    yyh = (y_h * y_h).sum(0)
    t0 = time.perf_counter()
    mu = sx / n
    cov = xx / n - torch.outer(mu, mu)
    covh = xxh - torch.outer(mu, sxh) - torch.outer(sxh, mu) + nh * torch.outer(mu, mu)
    lam, q = torch.linalg.eigh(cov)
    t_eigh = time.perf_counter() - t0
    lam = lam.clamp_min(0)
    scale = max(cov.diagonal().mean().item(), 1e-300)
    m = q.T @ covh @ q
    d = 1 / (lam[:, None] + torch.tensor(grid, dtype=torch.float64)[None, :] * scale)
    out = []
    for j in range(layers):
        cols = slice(j * 2 * width, (j + 1) * 2 * width)
        mu_y = sy[cols] / n
        g = xy[:, cols] / n - torch.outer(mu, mu_y)
        dh = (xyh[:, cols] - torch.outer(mu, syh[cols]) - torch.outer(sxh, mu_y)
              + nh * torch.outer(mu, mu_y))
        p, qd = q.T @ g, q.T @ dh
        for k in range(2):
            c = slice(k * width, (k + 1) * width)
            u = (p[:, c] * qd[:, c]).sum(1)
            h = m * (p[:, c] @ p[:, c].T)
            yk, mk = yyh[cols][c].sum(), mu_y[c]
            e = yk - 2 * mk @ syh[cols][c] + nh * mk @ mk
            sst = yk - syh[cols][c] @ syh[cols][c] / nh
            sse = e - 2 * (d * u[:, None]).sum(0) + (d * (h @ d)).sum(0)
            r2 = 1 - sse / sst
            best = int(torch.argmax(r2))
            w = q @ (d[:, best, None] * p[:, c])
            _ = mk - w.T @ mu
            out.append((r2[best].item(), grid[best]))
    return time.perf_counter() - t0, t_eigh, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or
                    os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    L, H, D, T = args.layers, args.kv_heads, args.head_dim, args.tokens
    W = H * D
    spec_a = kvbridge.ModelSpec("speed-a", L, H, D)
    spec_b = kvbridge.ModelSpec("speed-b", L, H, D, rope_base=50000.0)
    g = torch.Generator().manual_seed(0)
    src = tuple((torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g))
                for _ in range(L))
    # The float64 features both sides work on, in the fitter's order (per layer keys, values).
    X = torch.cat([t[0].transpose(0, 1).reshape(T, W) for pair in src for t in pair], 1).double()
    # Targets: a random linear function of the source plus noise, so the fits are not trivial.
    mix = torch.randn(X.shape[1], 2 * L * W, generator=g, dtype=torch.float64) / X.shape[1] ** 0.5
    y = X @ mix + 0.3 * torch.randn(T, 2 * L * W, generator=g, dtype=torch.float64)
    def planes(cols):
        return y[:, cols].float().reshape(T, H, D).transpose(0, 1)[None]

    tgt = tuple((planes(slice(2 * j * W, (2 * j + 1) * W)),
                 planes(slice((2 * j + 1) * W, (2 * j + 2) * W))) for j in range(L))
    Y = torch.cat([t.float()[0].transpose(0, 1).reshape(T, W) for pair in tgt for t in pair],
                  1).double()
    F, C = X.shape[1], Y.shape[1]
    print(f"shapes: {L} layers x {H} KV heads x {D} both sides, source_layers=all, {T} tokens; "
          f"features F = {F}, outputs {C}; threads {args.threads} (torch and OpenMP)")

    fitter = kvbridge.AdapterFitter(spec_a, spec_b, source_layers="all", rope_aware=False)
    t0 = time.perf_counter()
    fitter.add(src, tgt)
    t_add = time.perf_counter() - t0
    t0 = time.perf_counter()
    _ = X.T @ X
    _ = X.T @ Y
    t_torch = time.perf_counter() - t0
    flops_add = T * F * F + 2 * T * F * C  # syrk (upper triangle) + gemm
    flops_torch = 2 * T * F * F + 2 * T * F * C
    print(f"add: {t_add:.2f} s ({flops_add / t_add / 1e9:.1f} GFLOP/s); torch X.T@X + X.T@Y: "
          f"{t_torch:.2f} s ({flops_torch / t_torch / 1e9:.1f} GFLOP/s); "
          f"torch time / add time {t_torch / t_add:.2f}, rate ratio "
          f"{(flops_add / t_add) / (flops_torch / t_torch):.2f}")

    t0 = time.perf_counter()
    report = fitter.fit().report
    t_fit = time.perf_counter() - t0
    held = torch.rand(T, generator=g) < 0.1
    t_peer, t_eigh, peer = torch_ridge_fit(X[~held], Y[~held], X[held], Y[held], L, W,
                                           [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0])
    r2 = [0.5 * (l["r2_key"] + l["r2_value"]) for l in report["layers"]]
    print(f"fit: {t_fit:.1f} s; torch.linalg ridge selection {t_peer:.1f} s (eigh of {F}^2 "
          f"{t_eigh:.1f} s); fit time / torch time {t_fit / t_peer:.2f}")
    print(f"held-out R² mean: fitter {sum(r2) / len(r2):.4f}, torch peer "
          f"{sum(r for r, _ in peer) / len(peer):.4f} (different held-out tokens)")


if __name__ == "__main__":
    main()
