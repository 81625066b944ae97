"""Shadow checks inside vLLM: a sample of the requests whose prefix KVBridgeConnector converted
is checked against the model's own prefill, and an adapter whose rolling agreement falls below
the floor is disabled (its loads fall back to the model's own prefill).

Enable::

    llm = LLM(..., kv_transfer_config=<KVBridgeConnector>,
              worker_extension_cls="kvbridge.vllm.shadow.ShadowWorkerExtension")
    shadow = ShadowChecks(llm, sample_rate=0.01, seed=0, positions=8)
    outputs = shadow.generate(prompts, sampling_params)   # llm.generate, plus the checks

The user's requests are served as by ``llm.generate``. For each one whose load held converted
tokens (``kv_transfer_params["kvbridge"]["adapter"]`` of its output, set by the connector) and
that the seeded sampler draws (share ``sample_rate``), two twin requests of the same prompt run
after the batch (``max_tokens=1`` with prompt logprobs):

- an **own** twin: the model prefills the whole prompt (vLLM reads neither its prefix cache nor
  the connector for a request with prompt logprobs, and the connector promises it nothing);
- a **converted** twin (``skip_reading_prefix_cache=False`` and a fresh ``cache_salt``, so vLLM
  asks the connector but cannot reuse its own cached blocks): the connector loads the prompt's
  prefix from the user's namespace, cut to at most ``len(prompt) - positions`` tokens, so the
  model computes the last ``positions`` positions over the converted prefix.

At those positions ``check_from_logprobs`` compares the two next-token distributions as
``kvbridge.monitor.compare`` does (top-1 agreement, KL(own || converted), loss gap); the Check is
recorded in the worker's Bridge (``Bridge.record_check``, through ShadowWorkerExtension), which
keeps the per-adapter rolling figures and disables an adapter below ``min_agreement`` once it has
``min_checks`` checks (the connector's extra-config keys, the Bridge's defaults). On a disable
the engine's prefix cache is reset, so blocks computed over the adapter's KV are not reused; the
Bridge purges the entries it wrote back. ``enable(fingerprint)`` re-enables an adapter.

Cost: two extra one-token requests per sampled request (about two prompt prefills' compute,
prompts of the sampled requests only). Figures: ``stats()`` (this object's counts, the
connector's counters with ``"adapters"``: Bridge.adapter_health by fingerprint) and
``metrics_text()`` (the Bridge's Prometheus text with the per-adapter families).

KL from top-k logprobs is a lower bound (the tokens outside both top-k lists pooled into one
bucket); it is exact when the twins get the whole vocabulary (``logprobs=-1``, which needs the
engine's ``max_logprobs=-1``). Agreement and loss gap are exact with any k >= 1.
"""
from __future__ import annotations

import logging
import math
import random
import threading
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from kvbridge import _args
from kvbridge._core import InvalidArgumentError
from kvbridge.monitor import POSITIONS, Check
from kvbridge.vllm.connector import KVBridgeConnector
from kvbridge.vllm.metadata import OUTCOME_KEY, SHADOW_KEY

log = logging.getLogger("kvbridge.vllm.shadow")

#: A distribution's mass outside the known tokens below this is float rounding, not a bucket
#: (vLLM's logprobs are float32: a whole vocabulary sums to 1 within about 1e-7).
REST_TOLERANCE = 1e-6
#: The worker extension's qualified name (vLLM's ``worker_extension_cls``).
EXTENSION = "kvbridge.vllm.shadow.ShadowWorkerExtension"


def _top1(step: Mapping[int, float]) -> int:
    # The highest logprob; ties go to the lower token id (torch.argmax's rule).
    return min(step.items(), key=lambda kv: (-kv[1], kv[0]))[0]


def check_from_logprobs(own: Sequence[Mapping[int, float]], conv: Sequence[Mapping[int, float]],
                        next_tokens: Sequence[int]) -> Check:
    """A kvbridge.monitor.Check from next-token logprobs at m compared positions.

    own[i], conv[i]: the log probabilities known at position i (token id -> logprob, natural
    log) after the model's own prefill and after the converted cache: a top-k list (k >= 1,
    with the true next token added, as vLLM returns them) or the whole vocabulary.
    next_tokens: the true next tokens of the first len(next_tokens) <= m positions.

    agreement: top-1 of each mapping (highest logprob, ties to the lower id): exact.
    loss gap: logprob of the true next token under own minus under conv: exact (each must be
        in both mappings).
    KL(own || conv): over the tokens known in both mappings, plus one bucket with each side's
        remaining mass; by the log-sum inequality a lower bound of the full-vocabulary KL, and
        equal to it when both mappings hold the whole vocabulary. Computed in float64.
    """
    m = len(own)
    if m == 0 or len(conv) != m:
        raise InvalidArgumentError(f"logprobs: expected two equal non-empty position lists, got "
                                   f"{len(own)} and {len(conv)}")
    if len(next_tokens) > m:
        raise InvalidArgumentError(f"next_tokens: {len(next_tokens)} for {m} positions")
    agreed, kl_sum, gap_sum = 0, 0.0, 0.0
    for i, (p_step, q_step) in enumerate(zip(own, conv)):
        if not p_step or not q_step:
            raise InvalidArgumentError(f"logprobs: position {i} has no logprobs")
        agreed += _top1(p_step) == _top1(q_step)
        both = [t for t in p_step if t in q_step]
        p = [math.exp(float(p_step[t])) for t in both]
        q = [math.exp(float(q_step[t])) for t in both]
        kl = math.fsum(pi * (float(p_step[t]) - float(q_step[t]))
                       for pi, t in zip(p, both) if pi > 0)
        p_rest = 1.0 - math.fsum(p)
        q_rest = 1.0 - math.fsum(q)
        if p_rest > REST_TOLERANCE:
            kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, REST_TOLERANCE)))
        kl_sum += max(0.0, kl)
        if i < len(next_tokens):
            t = int(next_tokens[i])
            if t not in p_step or t not in q_step:
                raise InvalidArgumentError(f"logprobs: position {i} lacks its true next token {t}")
            gap_sum += float(p_step[t]) - float(q_step[t])
    return Check(m, int(agreed), kl_sum, len(next_tokens), gap_sum)


def _connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    if not isinstance(conn, KVBridgeConnector):
        raise InvalidArgumentError(f"shadow checks need KVBridgeConnector, the engine runs "
                                   f"{type(conn).__name__}")
    return conn


def _plain(value: Any) -> Any:
    """Stats as plain dicts, lists and numbers (they cross vLLM's RPC)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class ShadowWorkerExtension:
    """vLLM worker extension (``worker_extension_cls=kvbridge.vllm.shadow.EXTENSION``): the
    worker-side calls of ShadowChecks, run through ``llm.collective_rpc``. The Bridge lives in
    the worker process, so its health state is the one source of truth."""

    def kvbridge_record_checks(self, records: List[Tuple[str, int, int, float, int, float]]
                               ) -> List[str]:
        """Records (adapter, positions, agreed, kl_sum, loss_positions, loss_gap_sum) checks;
        returns the adapters this disabled."""
        return _connector().record_checks([(r[0], Check(int(r[1]), int(r[2]), float(r[3]),
                                                        int(r[4]), float(r[5])))
                                           for r in records])

    def kvbridge_enable_adapter(self, adapter: str) -> bool:
        return bool(_connector().bridge.enable_adapter(adapter))

    def kvbridge_disable_adapter(self, adapter: str) -> bool:
        return bool(_connector().bridge.disable_adapter(adapter))

    def kvbridge_stats(self) -> Dict[str, Any]:
        return _plain(_connector().stats())

    def kvbridge_metrics(self) -> str:
        return _connector().metrics_text()


class ShadowChecks:
    """Shadow checks of a vllm.LLM served with KVBridgeConnector (see the module docstring).

    llm: the engine; it must run KVBridgeConnector with
        ``worker_extension_cls="kvbridge.vllm.shadow.ShadowWorkerExtension"``.
    sample_rate: share in [0, 1] of the requests with converted tokens that are checked
        (default 0.01; 0: generate() is llm.generate).
    seed: seed of the sampler (a request is drawn when its converted load is seen, in output
        order).
    positions: last prompt positions compared per check (default 8, as kvbridge.monitor).
    logprobs: logprobs the twins ask for per position (top-k); None: the engine's max_logprobs
        (-1 there: the whole vocabulary, and an exact KL).
    Not thread-safe across concurrent generate() calls on one LLM (neither is vllm.LLM).
    """

    def __init__(self, llm: Any, sample_rate: float = 0.01, seed: int = 0,
                 positions: int = POSITIONS, logprobs: Optional[int] = None):
        rate = _args.number("sample_rate", sample_rate)
        if not 0 <= rate <= 1:
            raise InvalidArgumentError(f"sample_rate: expected a share in [0, 1], got {rate}")
        self.positions = _args.size("positions", positions)
        if self.positions < 1:
            raise InvalidArgumentError("positions: expected at least 1")
        config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
        if config is None:
            raise TypeError(f"llm: expected a vllm.LLM, got {type(llm).__name__}")
        tc = config.kv_transfer_config
        if tc is None or tc.kv_connector != "KVBridgeConnector":
            raise InvalidArgumentError("llm: shadow checks need an engine with KVBridgeConnector "
                                       "(kv_transfer_config)")
        if not _has_extension(config.parallel_config.worker_extension_cls):
            raise InvalidArgumentError(f"llm: start the engine with worker_extension_cls="
                                       f"{EXTENSION!r} (the checks are recorded in the worker)")
        max_logprobs = int(config.model_config.max_logprobs)
        if logprobs is None:
            logprobs = max_logprobs
        elif isinstance(logprobs, bool) or not isinstance(logprobs, int) or (
                logprobs < 1 and logprobs != -1):
            raise InvalidArgumentError(f"logprobs: expected k >= 1 or -1 (the whole vocabulary), "
                                       f"got {logprobs!r}")
        if max_logprobs != -1 and (logprobs == -1 or logprobs > max_logprobs):
            raise InvalidArgumentError(f"logprobs: {logprobs} exceeds the engine's max_logprobs "
                                       f"{max_logprobs}")
        self.llm = llm
        self.sample_rate = rate
        self.logprobs = int(logprobs)
        self._rng = random.Random(_args.seed("seed", seed))
        self._lock = threading.Lock()
        self._instance = uuid.uuid4().hex[:12]
        self._twins = 0
        self._counts = {"eligible": 0, "sampled": 0, "checks": 0, "skipped": 0,
                        "disables": 0, "enables": 0}

    # ----- serving ------------------------------------------------------------------------

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> List[Any]:
        """llm.generate(prompts, sampling_params, **kwargs); then the shadow checks of the
        sampled requests with converted tokens (two one-token requests each, batched)."""
        outputs = self.llm.generate(prompts, sampling_params, **kwargs)
        if self.sample_rate > 0:
            sampled = [o for o in outputs if self._eligible(o) and self._draw()]
            if sampled:
                self.check(sampled)
        return outputs

    @staticmethod
    def _outcome(output: Any) -> Optional[Dict[str, Any]]:
        params = getattr(output, "kv_transfer_params", None) or {}
        found = params.get(OUTCOME_KEY)
        return found if isinstance(found, dict) else None

    def _eligible(self, output: Any) -> bool:
        found = self._outcome(output)
        ok = bool(found and found.get("adapter") and found.get("tokens_loaded"))
        if ok:
            self._count("eligible")
        return ok

    def _draw(self) -> bool:
        with self._lock:
            take = self._rng.random() < self.sample_rate
            if take:
                self._counts["sampled"] += 1
            return take

    def _count(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def check(self, outputs: Sequence[Any]) -> List[Optional[Check]]:
        """Runs the shadow checks of `outputs` (RequestOutputs of converted loads) now, records
        them and returns their Checks (None where a check could not be made: the twin loaded
        no converted tokens, e.g. the adapter was disabled meanwhile, or the prompt is too
        short)."""
        from vllm import SamplingParams

        jobs = []
        for out in outputs:
            found = self._outcome(out)
            ids = [int(t) for t in (out.prompt_token_ids or [])]
            if found is None or len(ids) < 2:
                self._count("skipped")
                continue
            jobs.append((ids, found["namespace"]))
        if not jobs:
            return []
        twins = []
        for ids, namespace in jobs:
            # The own twin: vLLM reads neither its prefix cache nor the connector for a request
            # with prompt logprobs, so it prefills the whole prompt.
            own = SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.logprobs,
                                 prompt_logprobs=self.logprobs, detokenize=False,
                                 extra_args={"kv_transfer_params": {SHADOW_KEY: {"role": "own"}}})
            twins.append(({"prompt_token_ids": ids}, own))
            # The converted twin asks vLLM to consult the connector after all; a fresh
            # cache_salt keeps vLLM's own prefix cache (blocks of the served request) out.
            conv = SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.logprobs,
                                  prompt_logprobs=self.logprobs, detokenize=False,
                                  skip_reading_prefix_cache=False,
                                  extra_args={"kv_transfer_params": {SHADOW_KEY: {
                                      "role": "converted", "namespace": namespace,
                                      "positions": self.positions}}})
            twins.append(({"prompt_token_ids": ids, "cache_salt": self._salt()}, conv))
        results = self.llm.generate([p for p, _ in twins], [s for _, s in twins],
                                    use_tqdm=False)
        checks: List[Optional[Check]] = []
        records = []
        for (ids, _), own, conv in zip(jobs, results[0::2], results[1::2]):
            adapter, check = self._compare(ids, own, conv)
            checks.append(check)
            if check is None:
                self._count("skipped")
                continue
            records.append((adapter, check.positions, check.agreed, check.kl_sum,
                            check.loss_positions, check.loss_gap_sum))
        if records:
            disabled = self.llm.collective_rpc("kvbridge_record_checks", args=(records,))[0]
            self._count("checks", len(records))
            if disabled:
                self._count("disables", len(disabled))
                # vLLM's own prefix cache may hold blocks computed over the adapter's KV.
                self.llm.reset_prefix_cache()
                for fp in disabled:
                    log.warning("adapter %s disabled by shadow checks; its loads fall back to "
                                "the model's own prefill (ShadowChecks.enable re-enables it)", fp)
        return checks

    def _salt(self) -> str:
        with self._lock:
            self._twins += 1
            return f"kvbridge-shadow-{self._instance}-{self._twins}"

    def _compare(self, ids: List[int], own: Any, conv: Any) -> Tuple[str, Optional[Check]]:
        found = self._outcome(conv)
        if not found or not found.get("adapter") or not found.get("tokens_loaded"):
            return "", None
        n = len(ids)
        t = int(found.get("start", 0)) + int(found["tokens_loaded"])
        conv_prompt = conv.prompt_logprobs or []
        own_prompt = own.prompt_logprobs or []
        # The last m positions, as kvbridge.monitor.compare: n - m .. n - 1. Position i's
        # distribution is the prompt logprobs entry of token i + 1, the last one's is the
        # sampled token's. vLLM computes no logprobs for loaded positions: its list still has
        # one entry per prompt token, but those of tokens 1..t hold whatever its buffer held
        # (a release that leaves them out would start the list at token t), so only entries
        # of tokens past t are read, indexed from the list's end.
        m = min(self.positions, n - t)
        conv_tail = conv_prompt[len(conv_prompt) - m + 1:] if m > 1 else []
        own_tail = own_prompt[len(own_prompt) - m + 1:] if m > 1 else []
        if (not 1 <= t < n or len(own_prompt) != n or len(conv_prompt) not in (n, n - t)
                or any(not d for d in conv_tail + own_tail)):
            log.warning("shadow check of a %d-token prompt skipped: %d tokens loaded, %d / %d "
                        "prompt logprob entries not as expected", n, t, len(conv_prompt),
                        len(own_prompt))
            return "", None
        own_steps = [_as_floats(d) for d in own_tail] + [_as_floats(own.outputs[0].logprobs[0])]
        conv_steps = [_as_floats(d) for d in conv_tail] + [
            _as_floats(conv.outputs[0].logprobs[0])]
        return found["adapter"], check_from_logprobs(own_steps, conv_steps, ids[n - m + 1:])

    # ----- operator -----------------------------------------------------------------------

    def enable(self, adapter: str) -> bool:
        """Re-enables a disabled adapter (by fingerprint) with an empty check window; False if it
        is not registered."""
        ok = bool(self.llm.collective_rpc("kvbridge_enable_adapter", args=(str(adapter),))[0])
        if ok:
            self._count("enables")
            log.warning("adapter %s re-enabled", adapter)
        return ok

    def disable(self, adapter: str) -> bool:
        """Disables an adapter by hand (its loads fall back to the model's own prefill)."""
        ok = bool(self.llm.collective_rpc("kvbridge_disable_adapter", args=(str(adapter),))[0])
        if ok:
            self.llm.reset_prefix_cache()
        return ok

    def stats(self) -> Dict[str, Any]:
        """This object's counts ("eligible": outputs with converted tokens seen, "sampled",
        "checks" recorded, "skipped", "disables", "enables") and "connector": the worker's
        KVBridgeConnector.stats(), whose "adapters" holds the per-adapter rolling figures."""
        with self._lock:
            out: Dict[str, Any] = dict(self._counts)
        out["connector"] = self.llm.collective_rpc("kvbridge_stats")[0]
        return out

    def metrics_text(self) -> str:
        """The worker Bridge's Prometheus text (kvbridge_bridge_*, per-adapter families with
        an adapter="<fingerprint>" label)."""
        return self.llm.collective_rpc("kvbridge_metrics")[0]

    metrics = metrics_text  # the earlier name


def _as_floats(step: Optional[Mapping[int, Any]]) -> Dict[int, float]:
    if not step:
        return {}
    return {int(t): float(getattr(lp, "logprob", lp)) for t, lp in step.items()}


def _has_extension(qualname: str) -> bool:
    if not qualname:
        return False
    if qualname == EXTENSION:
        return True
    from vllm.utils.import_utils import resolve_obj_by_qualname

    try:
        cls = resolve_obj_by_qualname(qualname)
    except Exception:
        return False
    return isinstance(cls, type) and issubclass(cls, ShadowWorkerExtension)


__all__ = ["EXTENSION", "REST_TOLERANCE", "ShadowChecks", "ShadowWorkerExtension",
           "check_from_logprobs"]
