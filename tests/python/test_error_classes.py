"""Every error the package raises for bad input is a kvbridge.InvalidArgumentError (a ValueError
and a kvbridge.Error) or a TypeError: the public API walked with bad inputs, each error's class
asserted exactly (a bare ValueError fails). The vLLM connector's share is in
tests/vllm/test_error_classes.py (it needs vllm installed)."""
import types

import numpy as np
import pytest
import torch

import kvbridge
from kvbridge import specs
from conftest import random_kv

SPEC = dict(name="m", num_layers=2, num_kv_heads=2, head_dim=4)


def _spec():
    return kvbridge.ModelSpec(**SPEC)


def _store(**kw):
    return kvbridge.KVStore(1 << 22, chunk_tokens=4, **kw)


def _sliding_cache():
    layer = types.SimpleNamespace(is_sliding=True, keys=torch.zeros(1, 2, 4, 4),
                                  values=torch.zeros(1, 2, 4, 4))
    return types.SimpleNamespace(layers=[layer])


def _meta_kv():
    t = torch.empty(1, 2, 8, 4, device="meta")
    return [(t, t), (t, t)]


# (what, call, expected class): InvalidArgumentError for a bad value, TypeError for a bad type.
BAD = [
    ("spec num_layers", lambda: kvbridge.ModelSpec(**{**SPEC, "num_layers": 0}), "value"),
    ("spec dtype", lambda: kvbridge.ModelSpec(**{**SPEC, "dtype": "int8"}), "value"),
    ("spec head_dim type", lambda: kvbridge.ModelSpec(**{**SPEC, "head_dim": 4.5}), "type"),
    ("store capacity", lambda: kvbridge.KVStore(0), "value"),
    ("store chunk type", lambda: kvbridge.KVStore(1 << 20, chunk_tokens=2.5), "type"),
    ("store eviction", lambda: _store(eviction="mru"), "value"),
    ("store storage", lambda: _store(storage="fp4"), "value"),
    ("clear tiers", lambda: _store().clear(tiers=["ram"]), "value"),
    ("erase tiers", lambda: _store().erase(_spec(), list(range(8)), tiers="cache"), "value"),
    ("put token id", lambda: _store().put(_spec(), [1, -2, 3, 4], random_kv(_spec(), 4, 1)),
     "value"),
    ("put token type", lambda: _store().put(_spec(), [1.5] * 4, random_kv(_spec(), 4, 1)),
     "type"),
    ("match 2-D tokens", lambda: _store().match(_spec(), np.ones((2, 4), dtype=np.int64)),
     "value"),
    ("put no layers", lambda: _store().put(_spec(), list(range(8)), []), "value"),
    ("put meta tensor", lambda: _store().put(_spec(), list(range(8)), _meta_kv()), "value"),
    ("put sliding cache", lambda: _store().put(_spec(), list(range(4)), _sliding_cache()),
     "value"),
    ("put kv type", lambda: _store().put(_spec(), list(range(8)), 3), "type"),
    ("bridge min_quality", lambda: kvbridge.Bridge(_store(), min_quality="0.5"), "type"),
    ("bridge store type", lambda: kvbridge.Bridge(object()), "type"),
    ("fitter source_layers", lambda: kvbridge.AdapterFitter(_spec(), _spec(),
                                                             source_layers="some"), "value"),
    ("fitter ridge", lambda: kvbridge.AdapterFitter(_spec(), _spec(), ridge="big"), "value"),
    ("fitter holdout", lambda: kvbridge.AdapterFitter(_spec(), _spec(), holdout=2.0), "value"),
    ("rope type", lambda: specs.rope_parameters(
        types.SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"})),
     "value"),
]


@pytest.mark.parametrize("what, call, kind", BAD, ids=[b[0] for b in BAD])
def test_bad_input_error_class(what, call, kind):
    with pytest.raises(Exception) as info:
        call()
    err = info.value
    if kind == "value":
        assert type(err) is kvbridge.InvalidArgumentError, f"{what}: {type(err).__name__}: {err}"
        assert isinstance(err, ValueError) and isinstance(err, kvbridge.Error)
    else:
        assert isinstance(err, TypeError), f"{what}: {type(err).__name__}: {err}"
