"""Linear adapters between two models' KV caches: fitting and conversion."""
from __future__ import annotations

import math
import os

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch

from kvbridge import _args, _core
from kvbridge._tensors import KVCache, check_kv, empty_kv, host_kv, is_cache_object, kv_views
from kvbridge.hf import legacy_to_cache
from kvbridge._core import InvalidArgumentError

SourceLayers = Union[str, Sequence[Sequence[int]]]


#: The fields of one measured point of LinearAdapter.serving.
_POINT_KEYS = ("recompute_tail", "kept", "agreement", "computed_share", "prompt_tokens")
#: The fields of one measured length of LinearAdapter.serving["by_length"].
_LENGTH_KEYS = ("prompt_tokens", "recompute_tail")


def _known_keys(name: str, value: Mapping[str, Any], keys: Sequence[str]) -> None:
    unknown = sorted(str(k) for k in value if k not in keys)
    if unknown:
        raise InvalidArgumentError(f"{name}: unknown key(s) {unknown}; expected {list(keys)}")


def _figure(name: str, value: Any) -> float:
    """A measured figure: a number, or None (not measured) as NaN."""
    return math.nan if value is None else _args.number(name, value)


def _records(name: str, value: Any, keys: Sequence[str],
             required: Sequence[str]) -> List[Mapping[str, Any]]:
    """A list of dicts (None: empty), each with only `keys` and with every `required` one."""
    value = value or []
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a list of dicts, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise TypeError(f"{name}[{i}]: expected a dict, got {type(item).__name__}")
        _known_keys(f"{name}[{i}]", item, keys)
        for key in required:
            if key not in item:
                raise InvalidArgumentError(f"{name}[{i}]: '{key}' is required")
    return list(value)


def choose_serving(measured: Sequence[Mapping[str, Any]], agreement_goal: float,
                   note: str = "") -> Dict[str, Any]:
    """Serving defaults (LinearAdapter.serving) from a measured tail-recompute curve, measured
    at one prompt length or several (points grouped by prompt_tokens). At each length, the
    least measured tail whose agreement reaches `agreement_goal` (when none does, the largest
    measured tail there, with a note saying so); by_length lists them (lengths > 0), and the
    Bridge serves a prompt up to the longest length with them (LinearAdapter.serving).
    recompute_tail is the shortest length's; a longer length that needs more sets
    recompute_share to its tail over its length, so that past the longest length
    max(recompute_tail, ceil(recompute_share * n)) extrapolates with the largest share any
    length needed (the same tail agrees less after a longer converted prompt). measured: points as
    LinearAdapter.serving's (recompute_tail required; kept, agreement, computed_share,
    prompt_tokens); a point without an agreement does not reach the goal. `note` is prepended to
    the record's note. Raises InvalidArgumentError for an empty curve."""
    if not measured:
        raise InvalidArgumentError("choose_serving: no measured points")
    goal = _args.number("agreement_goal", agreement_goal)
    points = sorted((dict(p) for p in measured),
                    key=lambda p: (int(p.get("prompt_tokens") or 0), int(p["recompute_tail"])))
    by_length: Dict[int, List[Dict[str, Any]]] = {}
    for p in points:
        by_length.setdefault(int(p.get("prompt_tokens") or 0), []).append(p)

    def reaches(p: Mapping[str, Any]) -> bool:
        a = p.get("agreement")
        return a is not None and not math.isnan(a) and a >= goal

    tail, share, lengths, why = 0, 0.0, [], []
    for i, (length, curve) in enumerate(by_length.items()):
        reached = [int(p["recompute_tail"]) for p in curve if reaches(p)]
        needed = reached[0] if reached else int(curve[-1]["recompute_tail"])
        at = f" at {length} prompt tokens" if len(by_length) > 1 else ""
        if reached:
            why.append(f"least measured tail with agreement >= {goal:g}{at}: {needed}")
        else:
            why.append(f"no measured tail reached agreement {goal:g}{at}: the largest measured "
                       f"one, {needed} (measure longer tails, or serve this pair with care)")
        if length > 0:
            lengths.append({"prompt_tokens": length, "recompute_tail": needed})
        if i == 0:
            tail = needed
        elif needed > tail and length > 0:
            share = max(share, needed / length)
    if share:
        why.append(f"recompute_share {share:.4g} covers the longer prompts")
    why_text = "; ".join(why)
    return {"recompute_tail": tail, "recompute_share": share, "by_length": lengths,
            "agreement_goal": goal,
            "measured": sorted(points, key=lambda p: (int(p["recompute_tail"]),
                                                      int(p.get("prompt_tokens") or 0))),
            "note": f"{note}; {why_text}" if note else why_text}


class LinearAdapter:
    """Converts a source model's KV cache into a target model's (see AdapterFitter)."""

    def __init__(self, native: _core.LinearAdapter):
        self._native = native

    @property
    def source(self) -> _core.ModelSpec:
        return self._native.source

    @property
    def target(self) -> _core.ModelSpec:
        return self._native.target

    @property
    def report(self) -> dict:
        """Held-out R² per target layer for K and V, chosen ridge and source layers, token counts."""
        return self._native.report

    @property
    def alignment_policy(self) -> str:
        """The alignment policy the adapter was fitted with ("" for one shared tokenizer);
        conversions across tokenizers take alignments of this policy (kvbridge.align)."""
        return self._native.report["alignment_policy"]

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Writes the adapter as a safetensors file with JSON metadata (atomic), with its serving
        defaults when it records any."""
        self._native.save(os.fspath(path))

    @property
    def key_norm(self) -> Optional[torch.Tensor]:
        """The target's key norm gains the conversion applies, float32 [target layers, head_dim]
        (AdapterFitter's target_key_norm), or None when it applies none."""
        if not self._native.has_key_norm:
            return None
        return torch.tensor([self._native.key_norm(j) for j in range(self.target.num_layers)],
                            dtype=torch.float32)

    @property
    def has_token_codes(self) -> bool:
        """Whether the maps take the target's token codes (then convert needs target_ids)."""
        return self._native.has_token_codes

    @property
    def token_codes(self) -> Optional[torch.Tensor]:
        """The target's token codes the maps take (AdapterFitter's target_token_codes), float32
        [vocab, dims] (a copy), or None when they take none; convert then needs the target's
        ids."""
        if not self._native.has_token_codes:
            return None
        return torch.from_numpy(self._native.token_codes)

    @property
    def token_context(self) -> int:
        """Tokens whose codes feed each target token (it and the ones before); 0 without codes."""
        return self._native.token_context

    @property
    def fingerprint(self) -> str:
        """32 hex digits identifying the adapter's content (the checksum its file carries,
        computed without the serving defaults: recording them keeps the fingerprint)."""
        return self._native.fingerprint

    @property
    def serving(self) -> Optional[Dict[str, Any]]:
        """The serving defaults recorded from the adapter's held-out evaluation, or None.

        ``{"recompute_tail": r, "recompute_share": s, "by_length": [{"prompt_tokens": L_i,
        "recompute_tail": r_i}, ...], "agreement_goal": g or None, "measured":
        [{"recompute_tail", "kept", "agreement", "computed_share", "prompt_tokens"}, ...],
        "note": str}``: the tail recompute to serve with (choose_serving: r_i is the least that
        reached the goal at prompt length L_i), and the curve it was chosen from (figures not
        measured are None; computed_share is the share of the prompt the target computed itself,
        (r + 1) / prompt_tokens). A prompt of n tokens gets, up to the longest L_i,
        max(r, max_i ceil(r_i * min(1, n / L_i))): each length's tail, scaled in proportion below
        it and held above it; past every L_i (or with by_length empty), max(r, ceil(s * n)).
        kvbridge.Bridge uses that tail for loads this adapter converts unless its own
        recompute_tail option is set (>= 0). Stored in the adapter file (key "serving",
        docs/adapter_file.md).

        Assign a dict of that form to record new defaults (only "recompute_tail" is required;
        "recompute_share", "by_length", "agreement_goal", "measured" and "note" default to 0, [],
        None, [] and ""; each length needs both keys, lengths > 0 and increasing; each point needs
        its "recompute_tail", the rest default to None), or None to clear them;
        save() then writes them. Thread-safe, also while a Bridge serves the adapter (loads
        starting afterwards use the new tail). Raises TypeError for a wrong type,
        kvbridge.InvalidArgumentError for an unknown key or a value out of range (tails and
        prompt_tokens ints >= 0, recompute_share, agreement_goal, agreement and computed_share
        in [0, 1], kept finite)."""
        return self._native.serving

    @serving.setter
    def serving(self, value: Optional[Mapping[str, Any]]) -> None:
        if value is None:
            self._native.set_serving(False, 0, 0.0, [], math.nan, [], "")
            return
        if not isinstance(value, Mapping):
            raise TypeError(f"serving: expected a dict or None, got {type(value).__name__}")
        _known_keys("serving", value, ("recompute_tail", "recompute_share", "by_length",
                                       "agreement_goal", "measured", "note"))
        if "recompute_tail" not in value:
            raise InvalidArgumentError("serving: 'recompute_tail' is required")
        lengths = []
        for i, length in enumerate(_records("serving['by_length']", value.get("by_length"),
                                            _LENGTH_KEYS, _LENGTH_KEYS)):
            name = f"serving['by_length'][{i}]"
            lengths.append((_args.size(f"{name}['prompt_tokens']", length["prompt_tokens"]),
                            _args.integer(f"{name}['recompute_tail']", length["recompute_tail"],
                                          -2**63)))
        points = []
        for i, point in enumerate(_records("serving['measured']", value.get("measured"),
                                           _POINT_KEYS, ("recompute_tail",))):
            name = f"serving['measured'][{i}]"
            points.append((_args.size(f"{name}['recompute_tail']", point["recompute_tail"]),
                           _figure(f"{name}['kept']", point.get("kept")),
                           _figure(f"{name}['agreement']", point.get("agreement")),
                           _figure(f"{name}['computed_share']", point.get("computed_share")),
                           _args.size(f"{name}['prompt_tokens']", point.get("prompt_tokens", 0))))
        self._native.set_serving(
            True, _args.integer("serving['recompute_tail']", value["recompute_tail"], -2**63),
            _args.number("serving['recompute_share']", value.get("recompute_share", 0.0)),
            lengths, _figure("serving['agreement_goal']", value.get("agreement_goal")), points,
            _args.text("serving['note']", value.get("note", "")))

    @classmethod
    def load(cls, path: Union[str, "os.PathLike[str]"], *,
             allow_unchecked: bool = False) -> "LinearAdapter":
        """Reads an adapter file; kvbridge.CorruptError if it is damaged or malformed in any way.

        Files without a checksum (format_version 1, or written by a tool that dropped it) are
        refused unless ``allow_unchecked=True``; save() them again to add one."""
        return cls(_core.LinearAdapter.load(os.fspath(path), allow_unchecked=allow_unchecked))

    def convert(self, source_kv: KVCache, start_pos: int = 0, alignment: Any = None,
                target_start_pos: Optional[int] = None, *,
                target_ids: Any = None, previous_ids: Any = (),
                reference: bool = False, as_cache: Optional[bool] = None) -> KVCache:
        """The target model's KV for the same tokens, on the input's device.

        source_kv: legacy tuple of the source model (or a transformers DynamicCache),
            [1, kv_heads, tokens, head_dim] per tensor, the source spec's dtype, any strides, all
            on one device, tokens at absolute positions start_pos, start_pos + 1, ...
        alignment: for a pair with different tokenizers, the source token of each target token
            (kvbridge.align / align_text(...).index; ints, none -1: convert only the target
            tokens that have a source token). Output token j is computed from source token
            alignment[j] (keys un-rotated at start_pos + alignment[j], re-rotated at
            target_start_pos + j); the output has len(alignment) tokens. None: token j from
            source token j.
        target_start_pos: absolute position of the output's first token with an alignment
            (default start_pos).
        target_ids: the target's token ids of the output's tokens (ints, one per output token),
            which an adapter with token codes (token_codes not None) needs and others ignore;
            previous_ids: the ids just before them, nearest last, at least
            min(token_context - 1, first output position) of them.
        reference: compute in float64 on the CPU (slow; for validation); CUDA inputs are copied
            to the host and the result back.
        as_cache: return a transformers DynamicCache (True) or a legacy tuple (False); default:
            the form of source_kv.
        Returns fresh tensors of the target spec's dtype on the input's device.

        CUDA tensors stay on their device: the conversion runs there (cuBLAS GEMMs with float32
        accumulation and fused RoPE/cast/layout kernels), enqueued on torch's current stream of
        that device, so it is ordered like any torch operation on that stream and the call does
        not wait for it. If the native core has no CUDA path (``kvbridge.cuda_device_count()``
        is 0, e.g. a build without CUDA), CUDA tensors go through host copies and the CPU path.
        """
        if as_cache is None:
            as_cache = is_cache_object(source_kv)
        start_pos = _args.position("start_pos", start_pos)
        target_start_pos = (start_pos if target_start_pos is None
                            else _args.position("target_start_pos", target_start_pos))
        if alignment is not None:
            alignment = _args.int_list("alignment", alignment)
        ids = None if target_ids is None else _args.int_list("target_ids", target_ids)
        out = self._convert(check_kv(source_kv), start_pos, _args.flag("reference", reference),
                            alignment, target_start_pos, ids,
                            _args.int_list("previous_ids", list(previous_ids)))
        return legacy_to_cache(out, self.target) if as_cache else out

    def _convert(self, pairs, start_pos: int, reference: bool, alignment: Optional[List[int]] = None,
                 target_start_pos: int = 0, target_ids: Optional[List[int]] = None,
                 previous_ids: Sequence[int] = ()) -> KVCache:
        device = pairs[0][0].device
        tokens = pairs[0][0].shape[2] if pairs[0][0].dim() == 4 else 0
        if alignment is not None:
            tokens = len(alignment)
        if device.type == "cuda" and not reference and _core.cuda_device_count() > 0:
            out = empty_kv(self.target, tokens, device=device)
            src_k, src_v = kv_views(pairs)
            dst_k, dst_v = kv_views(out)
            stream = torch.cuda.current_stream(device).cuda_stream
            self._native.convert(src_k, src_v, int(start_pos), dst_k, dst_v, False, stream,
                                 alignment, target_start_pos, target_ids, list(previous_ids))
            return out
        pairs = host_kv(pairs)
        out = empty_kv(self.target, tokens)
        src_k, src_v = kv_views(pairs)
        dst_k, dst_v = kv_views(out)
        self._native.convert(src_k, src_v, int(start_pos), dst_k, dst_v, reference, 0, alignment,
                             target_start_pos, target_ids, list(previous_ids))
        if device.type != "cpu":
            out = tuple((k.to(device), v.to(device)) for k, v in out)
        return out


class AdapterFitter:
    """Accumulates paired (source KV, target KV) samples and fits a LinearAdapter.

    source_layers: "auto" (per target layer, the source layers that predict it best on held-out
        tokens, added greedily while held-out R² improves), "all", or one list per target layer.
    rope_aware: map keys in position-free space (un-rotate source, rotate with the target RoPE).
    ridge: "auto" (chosen per map on held-out tokens from a grid) or a fixed relative strength.
    holdout: share of tokens held out for choosing layers and ridge and for the report.
    alignment_policy: for a pair with different tokenizers, the policy ("seen", "covering";
        kvbridge.align) the alignments given to add() were made with; "" (default) for a pair
        sharing one tokenizer. Recorded in the report and the adapter file (kvbridge.Bridge
        accepts an adapter between different tokenizers only when it names a policy).
    max_source_layers: "auto": most source layers one target layer may draw on.
    min_gain: "auto": a source layer is added only if it raises the target layer's held-out R²
        (mean of keys and values) by at least this much.
    exact_candidates: "auto", from the second source layer on: how many candidates, ranked by a
        cheap screen, are fitted exactly at each step (the best of them is added).
    target_key_norm: for a target that RMS-normalizes each key head before RoPE (QK-norm, e.g.
        Gemma 3, Qwen3), its gains per layer, [target layers, head_dim] (kvbridge.hf.key_norm
        reads them off a model); the adapter then puts converted keys back on the set the
        target's own lie on (FitOptions::target_key_norm in include/kvbridge/adapter.h). None
        (default): the target has no key norm.
    target_token_codes: a fixed code per target vocabulary entry, float32 [vocab, dims]
        (kvbridge.hf.token_codes derives them from a model's input embeddings): each map then
        also takes the codes of the target token and of the token_context - 1 before it
        (FitOptions::target_token_codes), and add() and the adapter's convert need the target's
        token ids. None (default): the maps take the source's KV alone.
    token_context: tokens whose codes feed each target token, in [1, 8] (default 2: it and the
        one before).
    token_code_dims: codes wider than this are compressed to the directions that carry most of
        the maps' codes terms (FitOptions::token_code_dims; default 128); 0 keeps them.
    max_memory_bytes: bound on the float64 accumulators (default 8 GiB). When "auto" over all
        source layers would exceed it, the fitter takes two passes over the samples: a probe pass
        that ranks source layers per target layer, then `next_pass()` and the same samples again
        (`passes`, `pass_index`; `fit_adapter` does this itself). See AdapterFitter in
        include/kvbridge/adapter.h for the memory formulas.
    """

    def __init__(self, source_spec: _core.ModelSpec, target_spec: _core.ModelSpec,
                 source_layers: SourceLayers = "auto", rope_aware: bool = True,
                 ridge: Union[str, float] = "auto", holdout: float = 0.1,
                 max_source_layers: int = 8, seed: int = 0,
                 max_memory_bytes: Optional[int] = None, alignment_policy: str = "",
                 min_gain: float = 1e-4, exact_candidates: int = 2,
                 target_key_norm: Any = None, target_token_codes: Any = None,
                 token_context: int = 2, token_code_dims: int = 128):
        opts = _core.FitOptions()
        if isinstance(source_layers, str):
            if source_layers not in ("auto", "all"):
                raise InvalidArgumentError(f"source_layers: expected 'auto', 'all' or lists, got {source_layers!r}")
            opts.selection = (_core.FitOptions.Selection.AUTO if source_layers == "auto"
                              else _core.FitOptions.Selection.ALL)
        else:
            opts.selection = _core.FitOptions.Selection.EXPLICIT
            opts.source_layers = [[_args.size("source_layers", l) for l in layers]
                                  for layers in source_layers]
        if ridge != "auto":
            if isinstance(ridge, str):
                raise InvalidArgumentError(f"ridge: expected 'auto' or a number, got {ridge!r}")
            opts.ridge_grid = [_args.number("ridge", ridge)]
        opts.rope_aware = _args.flag("rope_aware", rope_aware)
        opts.holdout = _args.number("holdout", holdout)
        opts.max_source_layers = _args.size("max_source_layers", max_source_layers)
        opts.seed = _args.seed("seed", seed)
        opts.alignment_policy = _args.text("alignment_policy", alignment_policy)
        opts.min_gain = _args.number("min_gain", min_gain)
        opts.exact_candidates = _args.size("exact_candidates", exact_candidates)
        if opts.exact_candidates < 1:
            raise InvalidArgumentError(f"exact_candidates must be >= 1, got {exact_candidates}")
        if max_memory_bytes is not None:
            opts.max_memory_bytes = _args.size("max_memory_bytes", max_memory_bytes)
        if target_key_norm is not None:
            opts.target_key_norm = _args.float_rows("target_key_norm", target_key_norm)
        opts.token_context = _args.size("token_context", token_context)
        opts.token_code_dims = _args.size("token_code_dims", token_code_dims)
        if target_token_codes is not None:
            opts.set_target_token_codes(_args.float32_matrix("target_token_codes",
                                                             target_token_codes))
        self._native = _core.AdapterFitter(source_spec, target_spec, opts)

    @property
    def train_tokens(self) -> int:
        return self._native.train_tokens

    @property
    def holdout_tokens(self) -> int:
        return self._native.holdout_tokens

    @property
    def memory_bytes(self) -> int:
        return self._native.memory_bytes

    @property
    def passes(self) -> int:
        """1, or 2 when a probe pass selects candidate source layers first."""
        return self._native.passes

    @property
    def pass_index(self) -> int:
        """The pass being accumulated, from 0."""
        return self._native.pass_index

    def next_pass(self) -> None:
        """Ends the probe pass; add the same samples again afterwards."""
        self._native.next_pass()

    def candidate_layers(self) -> List[List[int]]:
        """Per target layer, the source layers fit() chooses from (after the probe pass)."""
        return self._native.candidate_layers()

    def add(self, source_kv: KVCache, target_kv: KVCache, start_pos: int = 0,
            alignment: Any = None, *, target_ids: Any = None, previous_ids: Any = ()) -> None:
        """Adds both models' KV for the same tokens (legacy tuples or DynamicCaches, any device
        and strides), at absolute positions start_pos, start_pos + 1, ...

        alignment: for two tokenizations of one text (models with different tokenizers), one
            int per target token (kvbridge.align / align_text(...).index): target token j is
            paired with source token alignment[j] (keys un-rotated at start_pos + alignment[j]);
            -1 entries are skipped. The two caches' token counts may then differ.
        target_ids: the target's token ids, one per target token (ints), which a fitter with
            target_token_codes needs and others ignore; previous_ids: the ids just before them,
            nearest last, when start_pos > 0 (LinearAdapter.convert says how many).
        """
        if alignment is not None:
            alignment = _args.int_list("alignment", alignment)
        src, tgt = host_kv(source_kv), host_kv(target_kv)
        sk, sv = kv_views(src)
        tk, tv = kv_views(tgt)
        ids = None if target_ids is None else _args.int_list("target_ids", target_ids)
        self._native.add(sk, sv, tk, tv, _args.position("start_pos", start_pos), alignment, ids,
                         _args.int_list("previous_ids", list(previous_ids)))

    def fit(self, progress: Union[bool, Callable[[float, float, int, int], None], None] = None
            ) -> LinearAdapter:
        """Solves the regressions and returns the adapter.

        progress: True shows a tqdm bar (if tqdm is installed) of fit()'s estimated work; a
            callable is called as progress(done, total, target_layer, source_layers) after every
            step (work in units of about 1e9 floating-point operations, an estimate; total may
            shrink when a target layer's selection stops early; target_layer -1 for work that
            is not one target layer's), from fit()'s threads, one call at a time. An exception
            it raises stops fit() and propagates.
        """
        if progress is None or progress is False:
            return LinearAdapter(self._native.fit())
        if progress is True:
            try:
                from tqdm import tqdm
            except ImportError:
                return LinearAdapter(self._native.fit())
            bar = tqdm(total=1.0, desc="fit", unit="GFLOP", unit_scale=False,
                       bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} GFLOP [{elapsed}<{remaining}]")
            def update(done: float, total: float, layer: int, layers: int) -> None:
                bar.total = max(total, 1e-9)
                bar.n = done
                if layer >= 0:
                    bar.set_postfix_str(f"target layer {layer}: {layers} source layers",
                                        refresh=False)
                bar.refresh()
            try:
                return LinearAdapter(self._native.fit(update))
            finally:
                bar.close()
        if not callable(progress):
            raise InvalidArgumentError(f"progress: expected a bool or a callable, got {progress!r}")
        return LinearAdapter(self._native.fit(progress))


def fit_adapter(source_spec: _core.ModelSpec, target_spec: _core.ModelSpec,
                source_kv_fn: Callable[[Any], KVCache], target_kv_fn: Callable[[Any], KVCache],
                batches: Iterable[Any], progress: bool = True,
                alignment_fn: Optional[Callable[[Any], Any]] = None,
                **fitter_options) -> LinearAdapter:
    """Fits an adapter from two callables that return each model's KV for a token batch.

    alignment_fn: for models with different tokenizers, a callable returning the batch's
        alignment (AdapterFitter.add); pass alignment_policy= with it.
    batches: token batches (whatever the callables take), e.g. lists of token ids. When the
        fitter needs two passes (see AdapterFitter), they are iterated twice, so they must be a
        re-iterable collection (a list, say), not a one-shot iterator or generator.
    progress: show tqdm progress bars (if tqdm is installed) of the batches and of fit().
    """
    fitter = AdapterFitter(source_spec, target_spec, **fitter_options)
    if fitter.passes > 1 and iter(batches) is batches:
        raise InvalidArgumentError("fit_adapter: this fitter takes two passes over the batches (a probe pass "
                                   "first, see AdapterFitter.passes), so batches must be re-iterable, "
                                   "e.g. a list, not an iterator or generator")
    with torch.no_grad():
        for p in range(fitter.passes):
            if p > 0:
                fitter.next_pass()
            items: Iterable[Any] = batches
            if progress:
                try:
                    from tqdm import tqdm
                    desc = ("fitting adapter" if fitter.passes == 1
                            else f"fitting adapter, pass {p + 1}/{fitter.passes}")
                    items = tqdm(batches, desc=desc, unit="batch")
                except ImportError:
                    pass
            for batch in items:
                fitter.add(source_kv_fn(batch), target_kv_fn(batch),
                           alignment=None if alignment_fn is None else alignment_fn(batch))
    return fitter.fit(progress=progress)


__all__: List[str] = ["AdapterFitter", "LinearAdapter", "choose_serving", "fit_adapter"]
