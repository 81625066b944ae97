"""Quality of converted caches while serving: shadow checks, automatic fallback, probes.

A converted cache is an approximation. QualityMonitor wraps a Bridge: for a share of the loads
that return converted tokens (``sample_rate``, default 1%, drawn from a seeded generator) it
also runs the target model's own prefill of the same prompt and compares the two at the
prompt's last ``positions`` positions (``compare``):

- **agreement**: the share of those positions where the target's greedy next token after the
  converted cache equals the one after its own prefill;
- **KL**: the mean KL divergence KL(own || converted) of the two next-token distributions, in
  nats;
- **loss gap**: the mean cross-entropy of the prompt's actual next tokens after the converted
  cache minus after its own prefill, in nats per token (positions whose next token lies in the
  prompt: all but the last).

Each comparison is recorded in the C++ Bridge (Bridge.record_check), which keeps the rolling
figures per adapter fingerprint and disables an adapter whose pooled agreement over its last
``check_window`` checks falls below ``min_agreement`` once it has ``min_checks`` checks (the
Bridge's options): loads stop converting with it, so the model prefills itself, and its
written-back entries are purged. The event is logged (logger ``kvbridge.monitor``, WARNING) and
counted (``stats()["quality_disables"]``, Prometheus ``kvbridge_bridge_quality_disables_total``);
``monitor.enable(adapter)`` (or ``Bridge.enable_adapter``) re-enables it. ``stats()`` returns the
per-adapter figures; ``metrics()`` the Bridge's Prometheus text, which carries them labelled by
adapter fingerprint.

Shadow checks run in the calling thread, after the load and before ``load()`` returns (one own
prefill of the prompt and one forward of its last ``positions`` tokens per sampled load). A check
never raises into ``load()``: a failure is logged and counted (``stats()["check_errors"]``) and
the load is returned as it is.

Non-finite logits: a position where the model's own prefill gives a NaN or an infinity says
nothing about the adapter and is left out; one where only the converted cache does is a failed
position (not agreed; left out of the KL and loss-gap sums, which stay finite), so a cache that
turns the target's logits non-finite drives the agreement down and disables the adapter like
any other bad conversion (``Check.nonfinite`` counts those positions, ``stats()["nonfinite"]``
the checks that had any).

``probe_adapter`` runs the same comparison on a few prompts sampled from the source model with
a fixed seed (or given ones); ``Bridge.add_adapter(..., source_model=, target_model=)`` refuses
an adapter whose probe agreement is below the floor (AdapterQualityError).
"""
from __future__ import annotations

import logging
import math
import random
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

from kvbridge import _args, _core
from kvbridge._tensors import KVCache, check_kv
from kvbridge.adapter import AdapterFitter, LinearAdapter
from kvbridge.bridge import Bridge, Load

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
    from kvbridge.eval import forward

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
    from kvbridge.eval import forward

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
    from kvbridge.eval import prefix_kv

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
        conv = adapter.convert(prefix_kv(source_model, ids[:-1]))
        total = total + compare(target_model, ids, conv, positions)
    if total.positions == 0:
        raise _core.InvalidArgumentError("probe: no prompts")
    return total


def require_quality(bridge: Bridge, adapter: LinearAdapter, source_model: Any,
                    target_model: Any, prompts: Optional[Sequence[Sequence[int]]] = None) -> Check:
    """probe_adapter, then AdapterQualityError when its agreement is below bridge.min_agreement
    (what Bridge.add_adapter runs when given the models). Returns the probe's Check."""
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
    from kvbridge.eval import prefix_kv

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


class QualityMonitor:
    """Shadow checks on a sample of a Bridge's converted loads (see the module docstring).

    bridge: the Bridge (its min_agreement / check_window / min_checks set the fallback).
    models: target models by spec: a mapping from ModelSpec (or its fingerprint) to the Hugging
        Face model; loads of other specs are never checked.
    sample_rate: share of loads with converted tokens that are checked, in [0, 1] (default 0.01).
    seed: seed of the sampling generator.
    positions: last prompt positions compared per check (default 8).
    Thread-safe (checks of concurrent loads run in their own threads).
    """

    def __init__(self, bridge: Bridge, models: Mapping[Union[_core.ModelSpec, str], Any],
                 sample_rate: float = 0.01, seed: int = 0, positions: int = POSITIONS):
        if not isinstance(bridge, Bridge):
            raise TypeError(f"bridge: expected a kvbridge.Bridge, got {type(bridge).__name__}")
        rate = _args.number("sample_rate", sample_rate)
        if not 0 <= rate <= 1:
            raise _core.InvalidArgumentError(f"sample_rate: expected a share in [0, 1], got {rate}")
        self.bridge = bridge
        self.sample_rate = rate
        self.positions = _args.size("positions", positions)
        if self.positions < 1:
            raise _core.InvalidArgumentError("positions: expected at least 1")
        self._models = {(k.fingerprint if isinstance(k, _core.ModelSpec) else str(k)): m
                        for k, m in models.items()}
        self._rng = random.Random(_args.seed("seed", seed))
        self._lock = threading.Lock()
        self._counts = {"eligible": 0, "sampled": 0, "checks": 0, "disables": 0,
                        "unregistered": 0, "check_errors": 0, "nonfinite": 0, "unjudged": 0}

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _sampled(self) -> bool:
        with self._lock:
            self._counts["eligible"] += 1
            take = self._rng.random() < self.sample_rate
            if take:
                self._counts["sampled"] += 1
            return take

    def load(self, spec: _core.ModelSpec, tokens: Any, namespace: str = "default",
             **kwargs: Any) -> Load:
        """Bridge.load (same arguments), then a shadow check of the result when it holds
        converted tokens (converted now or written back by a conversion), a model is known for
        `spec` and the load is sampled."""
        model = self._models.get(spec.fingerprint)
        if model is not None and self.bridge.exact_layers:
            kwargs.setdefault("model", model)
        found = self.bridge.load(spec, tokens, namespace, **kwargs)
        if found.adapter and found.kv is not None and model is not None and self._sampled():
            try:
                self.check(found, tokens, model)
            except Exception as e:  # a shadow check never fails the load it watches
                self._count("check_errors")
                log.warning("shadow check of adapter %s failed, load served unchecked: %s: %s",
                            found.adapter, type(e).__name__, e)
        return found

    def check(self, found: Load, tokens: Any, model: Any) -> Optional[Check]:
        """Runs one shadow check of `found` (a Load of `tokens` with converted tokens and its KV)
        against `model` now and records it; returns the Check (None when the adapter is no
        longer registered, or when the model's own logits were non-finite at every compared
        position: nothing to judge the adapter by)."""
        ids = [int(x) for x in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]
        result = compare(model, ids, found.kv, self.positions)
        if result.nonfinite:
            self._count("nonfinite")
        if result.positions == 0:
            self._count("unjudged")
            return None
        try:
            disabled = self.bridge.record_check(found.adapter, result)
        except _core.NotFoundError:
            self._count("unregistered")
            return None
        self._count("checks")
        if disabled:
            self._count("disables")
            health = {h["adapter"]: h for h in self.bridge.adapter_health()}.get(found.adapter, {})
            log.warning("adapter %s -> %s (%s) disabled: rolling agreement %.3f over %d checks "
                        "is below min_agreement %s; loads fall back to the model's own prefill",
                        health.get("source", "?"), health.get("target", "?"), found.adapter,
                        health.get("agreement", math.nan), health.get("window_checks", 0),
                        self.bridge.min_agreement)
        return result

    def enable(self, adapter: Union[LinearAdapter, str]) -> bool:
        """Re-enables a disabled adapter (Bridge.enable_adapter)."""
        ok = self.bridge.enable_adapter(adapter)
        if ok:
            log.warning("adapter %s re-enabled", adapter.fingerprint
                        if isinstance(adapter, LinearAdapter) else adapter)
        return ok

    def stats(self) -> Dict[str, Any]:
        """{"eligible", "sampled", "checks", "disables", "unregistered", "check_errors" (checks
        that raised, load served unchecked), "nonfinite" (checks with non-finite converted
        logits), "unjudged" (checks with no finite own logits, not recorded)} counts of this
        monitor and "adapters": the Bridge's adapter_health() by fingerprint."""
        with self._lock:
            out: Dict[str, Any] = dict(self._counts)
        out["adapters"] = {h["adapter"]: h for h in self.bridge.adapter_health()}
        return out

    def metrics(self) -> str:
        """The Bridge's Prometheus text (per-adapter figures included)."""
        return self.bridge.metrics()


__all__: List[str] = ["AdapterQualityError", "Check", "QualityMonitor", "compare",
                      "compare_logits", "damaged_adapter", "probe_adapter", "require_quality", "sample_prompts"]
