"""The quality of a converted cache: the target model after it against its own prefill.

``compare`` runs the target `model` after a converted cache and after its own prefill of the same
prompt and compares the two at the prompt's last ``positions`` positions (``compare_logits``):

- **agreement**: the share of those positions where the target's greedy next token after the
  converted cache equals the one after its own prefill;
- **KL**: the mean KL divergence KL(own || converted) of the two next-token distributions, in
  nats;
- **loss gap**: the mean cross-entropy of the prompt's actual next tokens after the converted
  cache minus after its own prefill, in nats per token (positions whose next token lies in the
  prompt: all but the last).

A ``Check`` holds the sums, so that checks pool by position. Non-finite logits: a position where
the model's own prefill gives a NaN or an infinity says nothing about the adapter and is left
out; one where only the converted cache does is a failed position (not agreed; left out of the
KL and loss-gap sums, which stay finite), so a cache that turns the target's logits non-finite
drives the agreement down like any other bad conversion (``Check.nonfinite`` counts those
positions).

``probe_adapter`` runs the same comparison on a few prompts sampled from the source model with
a fixed seed (or given ones); ``require_quality`` refuses an adapter whose probe agreement is
below a Bridge's floor (AdapterQualityError), which ``Bridge.add_adapter(...,
source_model=, target_model=)`` runs. kvbridge.monitor builds the serving-time shadow checks
(QualityMonitor) on this module and exports its names too.

This module knows no Bridge (it reads ``min_agreement`` of the one it is given), so that the
Bridge can call it and kvbridge.monitor can build on both.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from kvbridge import _args, _core
from kvbridge._tensors import KVCache, check_kv
from kvbridge.adapter import AdapterFitter, LinearAdapter
from kvbridge.hf import forward, prefix_kv

# The probe logs with the shadow checks (one logger for adapter quality).
log = logging.getLogger("kvbridge.monitor")

#: Default number of last prompt positions compared per check.
POSITIONS = 8


class AdapterQualityError(_core.InvalidArgumentError):
    """An adapter refused at registration: its probe agreement is below the Bridge's floor."""


@dataclass(frozen=True)
class Check:
    """One comparison of a converted cache with the target's own prefill (sums, so that checks
    pool by position; see the module docstring for the figures)."""

    positions: int        # positions compared
    agreed: int           # of which with equal greedy next tokens
    kl_sum: float         # sum of KL(own || converted), nats
    loss_positions: int   # positions whose true next token is known
    loss_gap_sum: float   # sum over those of CE(converted) - CE(own), nats
    nonfinite: int = 0    # of `positions`, those whose converted logits were not all finite

    @property
    def agreement(self) -> float:
        return self.agreed / self.positions if self.positions else math.nan

    @property
    def kl(self) -> float:
        return self.kl_sum / self.positions if self.positions else math.nan

    @property
    def loss_gap(self) -> float:
        return self.loss_gap_sum / self.loss_positions if self.loss_positions else math.nan

    def __add__(self, other: "Check") -> "Check":
        return Check(self.positions + other.positions, self.agreed + other.agreed,
                     self.kl_sum + other.kl_sum, self.loss_positions + other.loss_positions,
                     self.loss_gap_sum + other.loss_gap_sum, self.nonfinite + other.nonfinite)


def compare_logits(own: torch.Tensor, conv: torch.Tensor, next_tokens: torch.Tensor) -> Check:
    """A Check from next-token logits [m, vocab] after the model's own prefill (`own`) and after
    the converted cache (`conv`) at the same m positions; next_tokens: the true next tokens of the
    first len(next_tokens) <= m of them. Computed in float64. Positions whose `own` logits are
    not all finite are left out (the Check may then have 0 positions); positions whose `conv`
    logits are not all finite count as not agreed and in `nonfinite`, and are left out of the
    KL and loss-gap sums (module docstring)."""
    if own.shape != conv.shape or own.dim() != 2 or own.shape[0] == 0:
        raise _core.InvalidArgumentError(f"logits: expected two equal [m > 0, vocab] shapes, got "
                         f"{tuple(own.shape)} and {tuple(conv.shape)}")
    if next_tokens.numel() > own.shape[0]:
        raise _core.InvalidArgumentError(f"next_tokens: {next_tokens.numel()} for {own.shape[0]} positions")
    own, conv = own.double(), conv.double()
    judged = torch.isfinite(own).all(-1)
    failed = judged & ~torch.isfinite(conv).all(-1)
    good = judged & ~failed
    lp_own = torch.log_softmax(own[good], -1)
    lp_conv = torch.log_softmax(conv[good], -1)
    kl = (lp_own.exp() * (lp_own - lp_conv)).sum(-1).clamp_min(0)
    agreed = int((own[good].argmax(-1) == conv[good].argmax(-1)).sum())
    n = int(next_tokens.numel())
    rows = good[:n].nonzero().view(-1)  # positions with a true next token, judged and finite
    t = next_tokens.long().view(-1)[rows].view(-1, 1)
    lp_own_n = torch.log_softmax(own[rows], -1)
    lp_conv_n = torch.log_softmax(conv[rows], -1)
    gap = (lp_own_n.gather(1, t) - lp_conv_n.gather(1, t)).sum() if len(rows) else torch.zeros(())
    return Check(int(judged.sum()), agreed, float(kl.sum()), int(len(rows)), float(gap),
                 int(failed.sum()))


@torch.no_grad()
def compare(model: Any, tokens: Sequence[int], kv: KVCache,
            positions: int = POSITIONS) -> Check:
    """Compares the target `model` after the cache `kv` (its layout, for tokens[:t], t >= 1, as
    Bridge.load returns it) with its own prefill of `tokens`, at the prompt's last
    m = min(positions, len(tokens) - s) positions, where the cache is cut to
    s = max(1, min(t, len(tokens) - positions)) tokens and the model runs tokens[s:] on it."""
    ids = [int(x) for x in tokens]
    pairs = check_kv(kv)
    t = int(pairs[0][0].shape[2])
    n = len(ids)
    if not 1 <= t < n:
        raise _core.InvalidArgumentError(f"kv: expected 1..{n - 1} cached tokens for a {n}-token prompt, got {t}")
    positions = _args.size("positions", positions)
    if positions < 1:
        raise _core.InvalidArgumentError("positions: expected at least 1")
    s = max(1, min(t, n - positions))
    m = min(positions, n - s)
    cut = tuple((k[:, :, :s], v[:, :, :s]) for k, v in pairs)
    conv, _ = forward(model, ids[s:], cut, logits_to_keep=m)
    own, _ = forward(model, ids, logits_to_keep=m)
    # Position i of the m predicts token n - m + 1 + i; the last one's is not in the prompt.
    next_tokens = torch.as_tensor(ids[n - m + 1:], dtype=torch.long)
    return compare_logits(own[-m:], conv[-m:], next_tokens)


@torch.no_grad()
def sample_prompts(model: Any, count: int = 4, length: int = 96, seed: int = 0,
                   start_token: Optional[int] = None) -> List[List[int]]:
    """`count` prompts of `length` tokens sampled from `model` (temperature 1) from its BOS token
    (config.bos_token_id, or `start_token`), with a seeded generator: the same model gives the
    same prompts. A probe set that needs no tokenizer and stays in the model's distribution."""
    start = start_token if start_token is not None else getattr(model.config, "bos_token_id", None)
    if start is None:
        raise _core.InvalidArgumentError("start_token: the model's config has no bos_token_id; pass one")
    gen = torch.Generator().manual_seed(_args.seed("seed", seed))
    prompts = []
    for _ in range(_args.size("count", count)):
        ids = [int(start)]
        logits, kv = forward(model, ids, logits_to_keep=1)
        while len(ids) < length:
            probs = torch.softmax(logits[-1].double(), -1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
            logits, kv = forward(model, ids[-1:], kv, logits_to_keep=1)
        prompts.append(ids)
    return prompts


@torch.no_grad()
def probe_adapter(adapter: LinearAdapter, source_model: Any, target_model: Any,
                  prompts: Optional[Sequence[Sequence[int]]] = None,
                  positions: int = 16) -> Check:
    """Pooled Check of `adapter` on `prompts` (default: sample_prompts(source_model)): the source
    prefills each prompt but its last token, the adapter converts that, and compare() scores the
    target at the last `positions` positions. Adapters across tokenizers (an alignment policy)
    are refused: the probe feeds both models the same token ids."""
    if adapter.alignment_policy:
        raise _core.InvalidArgumentError(
            f"probe: {adapter.source.name} -> {adapter.target.name} converts across tokenizers "
            "(alignment policy " + repr(adapter.alignment_policy) + "), which the probe's shared "
            "token ids cannot check; register it without models and watch it with QualityMonitor")
    if prompts is None:
        prompts = sample_prompts(source_model)
    total = Check(0, 0, 0.0, 0, 0.0)
    for p in prompts:
        ids = [int(x) for x in p]
        if len(ids) < 2:
            raise _core.InvalidArgumentError(f"probe: prompts need at least 2 tokens, got {len(ids)}")
        conv = adapter.convert(prefix_kv(source_model, ids[:-1]), target_ids=ids[:-1])
        total = total + compare(target_model, ids, conv, positions)
    if total.positions == 0:
        raise _core.InvalidArgumentError("probe: no prompts")
    return total


def require_quality(bridge: Any, adapter: LinearAdapter, source_model: Any,
                    target_model: Any, prompts: Optional[Sequence[Sequence[int]]] = None) -> Check:
    """probe_adapter, then AdapterQualityError when its agreement is below bridge.min_agreement
    (what Bridge.add_adapter runs when given the models; `bridge`: a kvbridge.Bridge, of which
    only min_agreement is read). Returns the probe's Check."""
    check = probe_adapter(adapter, source_model, target_model, prompts)
    if check.agreement < bridge.min_agreement:
        raise AdapterQualityError(
            f"adapter {adapter.source.name} -> {adapter.target.name} ({adapter.fingerprint}) "
            f"refused: probe agreement {check.agreement:.3f} over {check.positions} positions is "
            f"below min_agreement {bridge.min_agreement} (KL {check.kl:.4f} nats, loss gap "
            f"{check.loss_gap:+.4f} nats/token)")
    log.info("adapter %s -> %s (%s) probed: agreement %.3f over %d positions",
             adapter.source.name, adapter.target.name, adapter.fingerprint, check.agreement,
             check.positions)
    return check


@torch.no_grad()
def damaged_adapter(source_model: Any, target_model: Any, source_spec: _core.ModelSpec,
                    target_spec: _core.ModelSpec, windows: Sequence[Sequence[int]],
                    shift: int = 5) -> LinearAdapter:
    """A deliberately damaged adapter, for testing the fallback: fitted in closed form on
    mismatched pairs (each window's source KV against the target KV of the window `shift`
    places further on, cyclically). It has the right specs, loads and converts, but its KV is
    unrelated to the target's. windows: token-id lists of one length, at least 2 of them; shift:
    1..len(windows) - 1."""
    wins = [[int(t) for t in w] for w in windows]
    if len(wins) < 2 or len({len(w) for w in wins}) != 1:
        raise _core.InvalidArgumentError(f"windows: expected at least 2 of one length, got "
                                         f"lengths {sorted({len(w) for w in wins})}")
    shift = _args.size("shift", shift)
    if not 1 <= shift < len(wins):
        raise _core.InvalidArgumentError(f"shift: expected 1..{len(wins) - 1}, got {shift}")
    fitter = AdapterFitter(source_spec, target_spec)
    for i, w in enumerate(wins):
        fitter.add(prefix_kv(source_model, w), prefix_kv(target_model, wins[(i + shift) % len(wins)]))
    return fitter.fit()


__all__: List[str] = ["AdapterQualityError", "Check", "POSITIONS", "compare", "compare_logits",
                      "damaged_adapter", "probe_adapter", "require_quality", "sample_prompts"]
