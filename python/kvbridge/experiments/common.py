"""What the experiments share: the text source, the pooled continuation metrics, timing,
results files and command-line pieces.

The evaluations (eval, eval_cross, real_eval), the demos and refine build on this module and on
the library; it imports none of them. The model calls themselves (forward, prefix_kv) are the
library's (kvbridge.hf), as serving makes the same ones.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import kvbridge
from kvbridge._core import InvalidArgumentError
from kvbridge.hf import forward

# ----------------------------------------------------------------------------- data


def testbed_module(data: Any = None) -> Any:
    """`data` if given (anything with texts(split) and MAX_CONTEXT), else
    kvbridge.experiments.testbed."""
    if data is not None:
        return data
    from kvbridge.experiments import testbed

    return testbed


# ----------------------------------------------------------------------------- metrics


@dataclass
class Sums:
    """Pooled continuation statistics (kvbridge.experiments.eval's docstring says what each
    loss means)."""

    tokens: int = 0
    loss_own: float = 0.0
    loss_conv: float = 0.0
    loss_none: float = 0.0
    agree: int = 0

    def add(self, logits_own: torch.Tensor, logits_conv: torch.Tensor,
            logits_none: torch.Tensor, targets: torch.Tensor) -> None:
        """Adds one window: logits [C, vocab] of each setting, targets [C] token ids."""
        self.add_scored(Reference.of(logits_own, logits_none, targets), logits_conv)

    def add_scored(self, reference: "Reference", logits_conv: torch.Tensor) -> None:
        """Adds one window scored against its Reference (built once per window for all the
        variants that window is scored with): logits_conv [C, vocab]."""
        if tuple(logits_conv.shape) != (reference.tokens, reference.vocab):
            raise InvalidArgumentError(
                f"converted logits {tuple(logits_conv.shape)} do not match the reference's "
                f"{reference.tokens} targets and vocabulary of {reference.vocab}")
        self.tokens += reference.tokens
        self.loss_own += reference.loss_own
        self.loss_conv += _summed_loss(logits_conv, reference.targets)
        self.loss_none += reference.loss_none
        self.agree += int((reference.own_top == logits_conv.argmax(-1)).sum())

    def metrics(self) -> Dict[str, float]:
        if self.tokens == 0:
            raise InvalidArgumentError("no continuation tokens were scored")
        l_own, l_conv = self.loss_own / self.tokens, self.loss_conv / self.tokens
        l_none = self.loss_none / self.tokens
        return {"kept": kept(l_none, l_conv, l_own), "agreement": self.agree / self.tokens,
                "loss_own": l_own, "loss_conv": l_conv, "loss_none": l_none,
                "tokens": self.tokens}


def _summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum"))


@dataclass(frozen=True)
class Reference:
    """The part of a window's statistics that the converted variant does not change: the
    continuation's targets [C] (int64), the own and no-prompt losses summed over them and the own
    top-1 tokens [C]. Computed once per window: its logits are C x vocab each."""

    targets: torch.Tensor
    own_top: torch.Tensor
    loss_own: float
    loss_none: float
    vocab: int

    @property
    def tokens(self) -> int:
        return int(self.targets.numel())

    @classmethod
    def of(cls, logits_own: torch.Tensor, logits_none: torch.Tensor,
           targets: torch.Tensor) -> "Reference":
        """From logits [C, vocab] of the own and no-prompt settings and targets [C] token ids."""
        if not (logits_own.dim() == 2 and logits_own.shape == logits_none.shape
                and logits_own.shape[0] == targets.shape[0] and targets.dim() == 1):
            raise InvalidArgumentError("logits and targets disagree in shape: "
                                       f"{tuple(logits_own.shape)}, {tuple(logits_none.shape)}, "
                                       f"{tuple(targets.shape)}")
        t = targets.long()
        return cls(t, logits_own.argmax(-1), _summed_loss(logits_own, t),
                   _summed_loss(logits_none, t), int(logits_own.shape[1]))


def kept(loss_none: float, loss_conv: float, loss_own: float) -> float:
    """(L_none - L_conv) / (L_none - L_own); NaN when the prefix does not help (L_own >= L_none)."""
    benefit = loss_none - loss_own
    if not benefit > 0:
        return float("nan")
    return (loss_none - loss_conv) / benefit


def best_by_kept(variants: Dict[str, Dict[str, Any]],
                 names: Optional[Sequence[str]] = None) -> Optional[str]:
    """The name (of `names`, default all) whose variant has the highest kept, NaN lowest; None
    when there is none."""
    names = list(variants) if names is None else list(names)
    if not names:
        return None
    return max(names, key=lambda n: (-math.inf if math.isnan(variants[n]["kept"])
                                     else variants[n]["kept"]))


def layer_r2(adapter: kvbridge.LinearAdapter) -> Dict[str, Any]:
    """An adapter's held-out R² per target layer, its layer map and its quality."""
    layers = adapter.report["layers"]
    return {"r2_key": [float(l["r2_key"]) for l in layers],
            "r2_value": [float(l["r2_value"]) for l in layers],
            "source_layers": [list(map(int, l["source_layers"])) for l in layers],
            "quality": kvbridge.Bridge.quality(adapter),
            "train_tokens": int(adapter.report["train_tokens"]),
            "holdout_tokens": int(adapter.report["holdout_tokens"])}


def score_cells(v: Dict[str, Any]) -> str:
    """A variant's kept, agreement, L_own, L_conv, L_none, min R², mean R² K and mean R² V as
    cells of a markdown table row."""
    mean = lambda xs: sum(xs) / len(xs)
    return (f"{v['kept']:.3f} | {v['agreement']:.3f} | {v['loss_own']:.3f} | "
            f"{v['loss_conv']:.3f} | {v['loss_none']:.3f} | {v['quality']:.3f} | "
            f"{mean(v['r2_key']):.3f} | {mean(v['r2_value']):.3f}")


def ttft_record(best: str, ttft: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """results.json's "ttft": the best variant's rows, the threads, every variant's rows."""
    return {"variant": best, "rows": ttft[best], "threads": torch.get_num_threads(),
            "by_variant": ttft}


def versions() -> Dict[str, str]:
    """results.json's kvbridge and torch versions."""
    return {"kvbridge_version": kvbridge.__version__, "torch_version": torch.__version__}


def model_record(m: Any, tokenizer: bool = False) -> Dict[str, Any]:
    """results.json's record of a loaded model (anything with .spec and .model); with its
    tokenizer id when `tokenizer`."""
    s = m.spec
    return {"name": s.name, "version": s.version,
            **({"tokenizer": s.tokenizer} if tokenizer else {}),
            "fingerprint": s.fingerprint, "num_layers": s.num_layers,
            "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
            "parameters": sum(p.numel() for p in m.model.parameters())}


# ----------------------------------------------------------------------------- model calls


def next_token(model: Any, ids: Sequence[int], past: Any = None) -> int:
    """The model's greedy next token after `ids` on the cache `past` (legacy tuple or None):
    what the TTFT paths time."""
    logits, _ = forward(model, ids, past, logits_to_keep=1)
    return int(logits[-1].argmax())


# ----------------------------------------------------------------------------- progress, time


def progress_items(items: Sequence[Any], progress: bool, desc: str = "paired KV") -> Any:
    """`items`, wrapped in a tqdm progress bar on stderr when `progress` and tqdm is there."""
    if progress:
        try:
            from tqdm import tqdm

            return tqdm(items, desc=desc, unit="window", file=sys.stderr)
        except ImportError:
            pass
    return items


def seconds(fn: Callable[[], Any]) -> float:
    """Wall time of one call of `fn`."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate_timings(own: Callable[[], Any], others: Dict[str, Callable[[], Any]],
                      repeats: int) -> Tuple[float, Dict[str, float]]:
    """Median seconds of `own` and of each of `others` after one untimed warm-up of each; the
    repeats alternate, so that drifts in machine load hit every path alike."""
    own()
    for fn in others.values():
        fn()
    own_times: List[float] = []
    times: Dict[str, List[float]] = {name: [] for name in others}
    for _ in range(repeats):
        own_times.append(seconds(own))
        for name, fn in others.items():
            times[name].append(seconds(fn))
    return statistics.median(own_times), {n: statistics.median(t) for n, t in times.items()}


# ----------------------------------------------------------------------------- results


def finite_or_null(x: Any) -> Any:
    """NaN and infinities become null, so that results.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_null(v) for v in x]
    return x


def write_results(results: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    """Writes out_dir/results.json and out_dir/eval.png (plot); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "results.json"),
             "plot": os.path.join(out_dir, "eval.png")}
    with open(paths["json"], "w") as f:
        json.dump(finite_or_null(results), f, indent=2, allow_nan=False)
        f.write("\n")
    plot(results, paths["plot"])
    return paths


def finish(results: Dict[str, Any], out_dir: str, table: str) -> None:
    """write_results, then the table and where the files went, on stdout."""
    paths = write_results(results, out_dir)
    print(table)
    print(f"\nwrote {paths['json']} and {paths['plot']}")


def plot(results: Dict[str, Any], path: str) -> None:
    """eval.png of results with "variants": held-out R² per target layer, kept per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = results["variants"]
    fig, (ax_r2, ax_kept) = plt.subplots(1, 2, figsize=(11, 4),
                                         gridspec_kw={"width_ratios": [2, 1]})
    for name, v in variants.items():
        layers = range(len(v["r2_key"]))
        line, = ax_r2.plot(layers, v["r2_key"], marker="o", label=f"{name} K")
        ax_r2.plot(layers, v["r2_value"], marker="s", linestyle="--", color=line.get_color(),
                   label=f"{name} V")
    ax_r2.set_xlabel("target layer")
    ax_r2.set_ylabel("held-out R²")
    ax_r2.set_title("adapter fit per target layer")
    ax_r2.legend(fontsize=7)
    names = list(variants)
    ax_kept.bar(names, [v["kept"] for v in variants.values()])
    ax_kept.axhline(1.0, color="gray", linewidth=0.8)
    ax_kept.set_ylabel("kept")
    ax_kept.set_title("share of the prefix benefit kept")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_adapter(adapter: kvbridge.LinearAdapter, path: str) -> None:
    """adapter.save(path), creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    adapter.save(path)


# ----------------------------------------------------------------------------- command line


def quiet_model_loading() -> None:
    """No transformers progress bars while the testbed weights load (they clutter the tables)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def set_threads(threads: int) -> None:
    """torch.set_num_threads(threads) unless 0. torch and kvbridge's native core share one OpenMP
    runtime, so this sets the threads of both paths being compared. One thread is the default of
    the commands: the testbed models are tiny, and on a shared CPU more threads make OpenMP's
    barriers wait on other processes (measured: up to 10x slower prefills at 2 threads)."""
    if threads:
        torch.set_num_threads(int(threads))


def int_at_least(lo: int):
    """An argparse type: an integer >= lo (a bad value is a usage error, not a traceback)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"
    return parse


def add_pair_arguments(p: argparse.ArgumentParser) -> None:
    """--source, --target and --out of the testbed commands."""
    p.add_argument("--source", default=None, help="source testbed model (default: testbed-a)")
    p.add_argument("--target", default=None, help="target testbed model (default: testbed-b)")
    p.add_argument("--out", default="eval-out", help="directory for results.json and eval.png")


def add_real_pair_arguments(p: argparse.ArgumentParser) -> None:
    """--source and --target of the real-pair experiments (selective, real_refine, headroom)."""
    p.add_argument("--source", required=True, help="short name, model folder or GGUF file")
    p.add_argument("--target", required=True, help="short name, model folder or GGUF file")


def add_run_arguments(p: argparse.ArgumentParser, threads: int = 1) -> None:
    """--seed, --threads (default `threads`) and --quiet."""
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--threads", type=int_at_least(0), default=threads,
                   help="torch (and kvbridge OpenMP) threads; 0 keeps torch's default")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
