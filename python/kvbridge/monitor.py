"""Quality of converted caches while serving: shadow checks, automatic fallback, probes.

A converted cache is an approximation. QualityMonitor wraps a Bridge: for a share of the loads
that return converted tokens (``sample_rate``, default 1%, drawn from a seeded generator) it
also runs the target model's own prefill of the same prompt and compares the two at the
prompt's last ``positions`` positions (``compare``: agreement, KL and loss gap, defined in
kvbridge.quality).

Each comparison is recorded in the C++ Bridge (Bridge.record_check), which keeps the rolling
figures per adapter fingerprint and disables an adapter whose pooled agreement over its last
``check_window`` checks falls below ``min_agreement`` once it has ``min_checks`` checks (the
Bridge's options): loads stop converting with it, so the model prefills itself, and its
written-back entries are purged. The event is logged (logger ``kvbridge.monitor``, WARNING) and
counted (``stats()["quality_disables"]``, Prometheus ``kvbridge_bridge_quality_disables_total``);
``monitor.enable(adapter)`` (or ``Bridge.enable_adapter``) re-enables it. ``stats()`` returns the
per-adapter figures; ``metrics_text()`` the Bridge's Prometheus text, which carries them labelled by
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
an adapter whose probe agreement is below the floor (AdapterQualityError). The comparison and
the probe live in kvbridge.quality, which the Bridge calls; this module adds the shadow checks
on a Bridge and exports the names of both.
"""
from __future__ import annotations

import logging
import math
import random
import threading
from typing import Any, Dict, List, Mapping, Optional, Union

from kvbridge import _args, _core
from kvbridge.adapter import LinearAdapter
from kvbridge.bridge import Bridge, Load
# The comparison and the probe live in kvbridge.quality (which the Bridge calls); their names
# are part of this module's API too.
from kvbridge.quality import (POSITIONS, AdapterQualityError, Check, compare, compare_logits,
                              damaged_adapter, probe_adapter, require_quality, sample_prompts)

log = logging.getLogger("kvbridge.monitor")


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

    def metrics_text(self) -> str:
        """The Bridge's Prometheus text (per-adapter figures included)."""
        return self.bridge.metrics_text()

    metrics = metrics_text  # the earlier name


__all__: List[str] = ["AdapterQualityError", "Check", "QualityMonitor", "compare",
                      "compare_logits", "damaged_adapter", "probe_adapter", "require_quality", "sample_prompts"]
