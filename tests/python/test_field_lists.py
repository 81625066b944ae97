"""The field lists the bindings publish (Bridge.OPTIONS from BridgeOptions' table, ModelSpec.FIELDS
from for_each_spec_field) against the _core.pyi stub, which is written by hand, and against the
Python wrappers built from them."""
import ast
import inspect
import math
import pathlib
import pickle

import numpy as np
import pytest

import kvbridge
from kvbridge import _core

STUB = pathlib.Path(__file__).resolve().parents[2] / "python" / "kvbridge" / "_core.pyi"


def stub_class(name):
    tree = ast.parse(STUB.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"{name} is not in {STUB}")


def stub_init(cls):
    """(name, annotation, default) per __init__ parameter after self; default is
    inspect.Parameter.empty when there is none, Ellipsis for `...`."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    params = init.args.args[1:]
    defaults = [inspect.Parameter.empty] * (len(params) - len(init.args.defaults))
    defaults += [ast.literal_eval(d) for d in init.args.defaults]
    params += init.args.kwonlyargs
    defaults += [inspect.Parameter.empty if d is None else ast.literal_eval(d)
                 for d in init.args.kw_defaults]
    return [(p.arg, ast.unparse(p.annotation), d) for p, d in zip(params, defaults)]


def stub_members(cls):
    """name -> annotation of every attribute and property the stub class declares."""
    out = {}
    for n in cls.body:
        if isinstance(n, ast.AnnAssign):
            out[n.target.id] = ast.unparse(n.annotation)
        elif isinstance(n, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list):
            out[n.name] = ast.unparse(n.returns)
    return out


@pytest.mark.parametrize("name", ["ModelSpec", "RopeScaling", "LayerAttention"])
def test_stub_fields_match_binding(name):
    cls = stub_class(name)
    fields = getattr(_core, name).FIELDS
    assert [f[0] for f in fields] == [p[0] for p in stub_init(cls)]
    members = stub_members(cls)
    for (field, kind, default), (_, annotation, stub_default) in zip(fields, stub_init(cls)):
        assert annotation == kind, field
        assert members.get(field) == kind, field
        if default is None:
            assert stub_default is inspect.Parameter.empty, f"{field} is required"
        elif isinstance(default, _core.RopeScaling):
            assert stub_default is Ellipsis and default == _core.RopeScaling(), field
        else:
            assert stub_default == default and type(stub_default) is type(default), field


def test_stub_bridge_matches_binding():
    cls = stub_class("Bridge")
    params = stub_init(cls)
    assert params[0][:2] == ("store", "KVStore")
    options = _core.Bridge.OPTIONS
    assert [o[0] for o in options] == [p[0] for p in params[1:]]
    members = stub_members(cls)
    for (name, kind, default, doc), (_, annotation, stub_default) in zip(options, params[1:]):
        assert annotation == kind and members.get(name) == kind, name
        assert stub_default == default and type(stub_default) is type(default), name
        assert doc, name


def test_model_spec_fields_are_the_constructor():
    fields = _core.ModelSpec.FIELDS
    assert [f[0] for f in fields] == ["name", "num_layers", "num_kv_heads", "head_dim", "dtype",
                                      "version", "tokenizer", "rope_base", "rope_style",
                                      "rope_scaling", "layer_attention"]
    scaling = kvbridge.RopeScaling("llama3", factor=8.0, low_freq_factor=1.5,
                                   high_freq_factor=3.5, original_max_position=4097)
    layers = [kvbridge.LayerAttention(1e4, sliding_window=512),
              kvbridge.LayerAttention(2e6, scaling), kvbridge.LayerAttention(3e4)]
    values = ["m/x", 3, 5, 14, "bfloat16", "rev-7", "tok-3", 5e5, "interleaved", scaling, layers]
    by_position = kvbridge.ModelSpec(*values)
    by_name = kvbridge.ModelSpec(**{f[0]: v for f, v in zip(fields, values)})
    assert by_position == by_name and by_position.fingerprint == by_name.fingerprint
    for (name, _, _), value in zip(fields, values):
        assert getattr(by_position, name) == value, name
    assert pickle.loads(pickle.dumps(by_position)) == by_position
    # Defaults: the optional arguments left out are the published defaults.
    short = kvbridge.ModelSpec("m/x", 3, 5, 14)
    for name, _, default in fields[4:]:
        assert getattr(short, name) == default, name
    # numpy ints are not Python ints here (as before): a TypeError naming the argument.
    with pytest.raises(TypeError, match="num_layers"):
        kvbridge.ModelSpec("m", np.int64(2), 2, 8)


@pytest.mark.parametrize("name, value", [("name", 5), ("dtype", 3), ("version", 1.5),
                                         ("tokenizer", None), ("rope_base", "1e4"),
                                         ("rope_style", 0), ("rope_scaling", "none"),
                                         ("num_kv_heads", 2.0), ("head_dim", True),
                                         ("layer_attention", None),
                                         ("layer_attention", [None, None]),
                                         ("layer_attention", "full")])
def test_model_spec_argument_types(name, value):
    args = {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, name: value}
    with pytest.raises(TypeError, match=name):
        kvbridge.ModelSpec(**args)


@pytest.mark.parametrize("name, value, match", [
    ("dtype", "float8", "dtype"), ("rope_style", "sideways", "rope_style"),
    ("num_layers", 0, "num_layers"), ("head_dim", 7, "head_dim"),
    ("rope_base", math.inf, "rope_base"), ("num_layers", 1 << 70, "int64")])
def test_model_spec_argument_values(name, value, match):
    args = {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, name: value}
    with pytest.raises(kvbridge.InvalidArgumentError, match=match):
        kvbridge.ModelSpec(**args)


def test_rope_scaling_fields_are_the_constructor():
    fields = _core.RopeScaling.FIELDS
    assert [f[0] for f in fields] == ["type", "factor", "low_freq_factor", "high_freq_factor",
                                      "original_max_position"]
    values = ["llama3", 6.5, 1.25, 3.75, 3001]
    by_position = kvbridge.RopeScaling(*values)
    assert by_position == kvbridge.RopeScaling(**{f[0]: v for f, v in zip(fields, values)})
    assert [getattr(by_position, f[0]) for f in fields] == values
    assert [getattr(kvbridge.RopeScaling(), f[0]) for f in fields] == [f[2] for f in fields]
    with pytest.raises(TypeError, match="type"):
        kvbridge.RopeScaling(type=2)
    with pytest.raises(TypeError, match="factor"):
        kvbridge.RopeScaling("linear", factor="2")
    with pytest.raises(TypeError, match="original_max_position"):
        kvbridge.RopeScaling("llama3", original_max_position=2.0)
    with pytest.raises(kvbridge.InvalidArgumentError, match="rope_scaling.type"):
        kvbridge.RopeScaling("cubic")


def test_model_spec_required_arguments():
    with pytest.raises(TypeError):
        kvbridge.ModelSpec("m", 2, 2)
    with pytest.raises(TypeError):
        kvbridge.ModelSpec("m", 2, 2, 8, "float32", "", "", 1e4, "half", kvbridge.RopeScaling(), [],
                           1)


def test_bridge_options_from_the_binding():
    store = kvbridge.KVStore(1 << 20, chunk_tokens=16)
    options = _core.Bridge.OPTIONS
    params = inspect.signature(kvbridge.Bridge).parameters
    assert list(params) == ["store"] + [o[0] for o in options] + ["exact_layers"]
    for name, _, default, doc in options:
        assert params[name].default == default
        assert getattr(kvbridge.Bridge, name).__doc__ == doc
        assert name in kvbridge.Bridge.__doc__
    defaults = kvbridge.Bridge(store)
    for name, _, default, _ in options:
        assert getattr(defaults, name) == default, name
    values = {"min_quality": -1.25, "write_back": False, "recompute_tail": 3,
              "min_agreement": 0.375, "check_window": 7, "min_checks": 5}
    assert sorted(values) == sorted(o[0] for o in options)
    given = kvbridge.Bridge(store, **values, exact_layers=2)
    assert {n: getattr(given, n) for n in values} == values and given.exact_layers == 2
    positional = kvbridge.Bridge(store, -1.25, False)
    assert positional.min_quality == -1.25 and positional.write_back is False
    assert kvbridge.Bridge(store=store, min_quality=0.25).min_quality == 0.25


@pytest.mark.parametrize("call", [
    lambda s: kvbridge.Bridge(s, 0.5, True, 2),        # recompute_tail is keyword only
    lambda s: kvbridge.Bridge(s, min_quality=0.5, min_qualty=0.5),
    lambda s: kvbridge.Bridge(s, 0.5, min_quality=0.5),
    lambda s: kvbridge.Bridge(s, min_quality="0.5"),
    lambda s: kvbridge.Bridge(s, write_back=1),
    lambda s: kvbridge.Bridge(s, check_window=4.0),
    lambda s: kvbridge.Bridge(s, exact_layers=None),
    lambda s: kvbridge.Bridge()])
def test_bridge_option_type_errors(call):
    store = kvbridge.KVStore(1 << 20, chunk_tokens=16)
    with pytest.raises(TypeError):
        call(store)


@pytest.mark.parametrize("options, match", [
    ({"recompute_tail": -2}, "recompute_tail"), ({"check_window": 0}, "check_window"),
    ({"min_checks": 33}, "min_checks"), ({"min_quality": math.nan}, "NaN"),
    ({"exact_layers": -2}, "exact_layers")])
def test_bridge_option_values(options, match):
    store = kvbridge.KVStore(1 << 20, chunk_tokens=16)
    with pytest.raises(kvbridge.InvalidArgumentError, match=match):
        kvbridge.Bridge(store, **options)
