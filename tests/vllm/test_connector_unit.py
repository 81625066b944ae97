"""Parts of KVBridgeConnector that need no engine: extra-config validation, the ModelSpec
derivation (against kvbridge.experiments.testbed and the shipped adapter's recorded specs), and the
worker's load into paged blocks with the failures vLLM must recompute."""
import functools
import pathlib

import pytest
import torch

pytest.importorskip("vllm")

import kvbridge  # noqa: E402
from kvbridge import specs  # noqa: E402
from kvbridge.experiments import testbed  # noqa: E402
from kvbridge.experiments.vllm_testbed import ADAPTER  # noqa: E402
from kvbridge.vllm import (connector, metadata, options, paged, registry, stats,  # noqa: E402
                           tokenizer_setup, worker)



def test_parse_options_defaults_and_store_fields(tmp_path):
    o = options.parse_options({"disk_dir": tmp_path, "disk_capacity_bytes": 1 << 20,
                               "namespace": "t1", "adapters": [str(ADAPTER)]}, block_size=32)
    store = dict(o.store)
    assert store["chunk_tokens"] == 32 and store["capacity_bytes"] == options.DEFAULT_CAPACITY_BYTES
    assert store["disk_dir"] == str(tmp_path) and store["disk_capacity_bytes"] == 1 << 20
    assert o.namespace == "t1" and o.adapters == (str(ADAPTER.resolve()),)


@pytest.mark.parametrize("extra,match", [
    ({"disk_directory": "/tmp"}, "unknown kv_connector_extra_config key"),
    ({"chunk_tokens": 0}, "chunk_tokens must be positive"),
    ({"eviction": "random"}, "bad value 'random' for 'eviction'"),
    ({"adapters": ["/nonexistent/a_to_b.safetensors"]}, "does not exist"),
    ({"adapters": 3}, "must be a list"),
    ({"layout": "nhd"}, "layout must be"),
    ({"namespace": ""}, "namespace must be"),
    ({"min_quality": "high"}, "min_quality must be a number"),
])
def test_parse_options_rejects(extra, match):
    with pytest.raises(ValueError, match=match):
        options.parse_options(extra, block_size=32)


def test_kv_dtype():
    assert options.kv_dtype_name(torch.bfloat16, "auto") == "bfloat16"
    assert options.kv_dtype_name(torch.float32, "float16") == "float16"
    with pytest.raises(ValueError, match="fp8"):
        options.kv_dtype_name(torch.bfloat16, "fp8")


@pytest.mark.parametrize("name", testbed.MODEL_NAMES)
def test_engine_spec_is_the_testbed_spec(name):
    """What vLLM's config gives the connector (hf config, model and tokenizer paths, served
    name, dtype) yields the testbed's spec, which is the shipped adapter's recorded one."""
    from transformers import AutoConfig

    folder = testbed.MODELS_DIR / name
    tokenizer = testbed.tokenizer_folder(name)
    spec = options.engine_spec(AutoConfig.from_pretrained(folder), str(folder),
                               str(tokenizer), [name], torch.float32, "auto",
                               options.parse_options({}, 32))
    assert spec == testbed.load_model(name).spec
    if name in (testbed.SOURCE_NAME, testbed.TARGET_NAME):
        adapter = kvbridge.LinearAdapter.load(ADAPTER)
        recorded = adapter.source if name == testbed.SOURCE_NAME else adapter.target
        assert spec.fingerprint == recorded.fingerprint
    assert spec.tokenizer == specs.tokenizer_id(tokenizer)
    assert spec.version == specs.weights_version(folder)


def test_spec_rules_for_other_folders(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"a" * 10)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"b" * 20)
    v = specs.weights_version(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"c" * 20)
    assert specs.weights_version(tmp_path) != v       # content-hashed below the limit
    assert specs.tokenizer_id(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    t = specs.tokenizer_id(tmp_path)
    assert t.startswith("tok-")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert specs.tokenizer_id(tmp_path) != t
    assert specs.weights_version(tmp_path / "missing") is None


SPEC = kvbridge.ModelSpec("unit", num_layers=2, num_kv_heads=3, head_dim=6, dtype="float32",
                          version="v1", tokenizer="tok")
BS = 4


def paged_layers(num_blocks=9):
    caches = [torch.zeros(num_blocks, SPEC.num_kv_heads, BS, 2 * SPEC.head_dim)
              for _ in range(SPEC.num_layers)]
    return caches, [paged.kv_views(c, "cpu", SPEC.head_dim) for c in caches]


def stored_prompt(store, n_tokens, n_stored):
    gen = torch.Generator().manual_seed(21)
    tokens = list(range(100, 100 + n_tokens))
    kv = tuple((torch.randn(1, 3, n_stored, 6, generator=gen),
                torch.randn(1, 3, n_stored, 6, generator=gen)) for _ in range(2))
    assert store.put(SPEC, tokens[:n_stored], kv) == n_stored
    return tokens, kv


def test_load_into_blocks_writes_the_promised_range():
    store = kvbridge.KVStore(1 << 22, chunk_tokens=4)
    bridge = kvbridge.Bridge(store)
    tokens, kv = stored_prompt(store, 13, 12)
    _, layers = paged_layers()
    block_ids = [5, 2, 7, 1]
    op = metadata.LoadOp("r", tokens, "default", 3, 12, block_ids)
    loaded, converted, failed = worker.load_into_blocks(bridge, SPEC, layers, BS, op)
    assert (loaded, converted, failed) == (9, False, set())
    for (keys, values), (k, v) in zip(layers, kv):
        gk, gv = paged.gather(keys, values, block_ids, 12)
        assert torch.equal(gk[:, :, 3:], k[:, :, 3:]) and torch.equal(gv[:, :, 3:], v[:, :, 3:])
        assert not gk[:, :, :3].any()            # tokens before the range untouched


def test_load_into_blocks_reports_what_it_could_not_deliver():
    store = kvbridge.KVStore(1 << 22, chunk_tokens=4)
    bridge = kvbridge.Bridge(store)
    tokens, kv = stored_prompt(store, 13, 8)     # the scheduler promised 12, only 8 remain
    _, layers = paged_layers()
    block_ids = [5, 2, 7, 1]
    op = metadata.LoadOp("r", tokens, "default", 4, 12, block_ids)
    loaded, _, failed = worker.load_into_blocks(bridge, SPEC, layers, BS, op)
    assert loaded == 4 and failed == {7}
    store.erase(SPEC, tokens[:8])                # now nothing is left
    loaded, _, failed = worker.load_into_blocks(bridge, SPEC, layers, BS, op)
    assert loaded == 0 and failed == {2, 7}
    # no registered caches (or any other exception) fails every promised block, never raises
    loaded, _, failed = worker.load_into_blocks(bridge, SPEC, None, BS, op)
    assert loaded == 0 and failed == {2, 7}


def test_stats_aggregate():
    a = stats.KVBridgeConnectorStats(data={"loads": 2, "tokens_loaded": 64})
    b = stats.KVBridgeConnectorStats(data={"loads": 1, "load_errors": 1})
    assert a.aggregate(b).reduce() == {"loads": 3, "tokens_loaded": 64, "load_errors": 1}
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()


def test_package_refuses_untested_vllm():
    import kvbridge.vllm as kv_vllm

    kv_vllm._check_version("0.32.0")
    kv_vllm._check_version("0.32.1+cpu")
    for bad in ("0.31.2", "1.0.0", "unknown"):
        with pytest.raises(ImportError, match="tested with vLLM 0.32.0"):
            kv_vllm._check_version(bad)
    assert pathlib.Path(kv_vllm.__file__).parent.name == "vllm"


def test_prometheus_counters_follow_the_stats():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def in_registry(cls):
        return lambda *a, **kw: cls(*a, registry=registry, **kw)

    types = {Gauge: in_registry(Gauge), Counter: in_registry(Counter),
             Histogram: in_registry(Histogram)}
    prom = connector.KVBridgeConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
        {0: ["testbed-b", "0"]})
    prom.observe({"tokens_loaded": 96, "loads_converted": 1, "load_errors": 0})
    prom.observe({"tokens_loaded": 32})
    labels = {"model_name": "testbed-b", "engine": "0"}
    assert registry.get_sample_value("vllm:kvbridge_tokens_loaded_total", labels) == 128
    assert registry.get_sample_value("vllm:kvbridge_loads_converted_total", labels) == 1
    assert registry.get_sample_value("vllm:kvbridge_load_errors_total", labels) == 0


def test_background_saves_keep_provenance_and_respect_a_disable():
    """The save thread stores KV derived from a conversion with its provenance (so the
    adapter's purge removes it), and stores nothing for a save whose adapter was disabled while
    it was queued (Bridge.save refuses a dropped adapter); the connector's Bridge itself never
    writes back."""
    shipped = kvbridge.LinearAdapter.load(ADAPTER)
    spec = shipped.target
    shared = registry.Shared(options.parse_options({"adapters": [str(ADAPTER)]}, 32), spec)
    assert shared.bridge.write_back is False
    gen = torch.Generator().manual_seed(11)

    def prompt_kv(n):
        return tuple((torch.randn(1, spec.num_kv_heads, n, spec.head_dim, generator=gen),
                      torch.randn(1, spec.num_kv_heads, n, spec.head_dim, generator=gen))
                     for _ in range(spec.num_layers))

    origin = (shipped.source.fingerprint, shipped.fingerprint)
    derived, own = list(range(100, 164)), list(range(300, 364))
    shared.saver.submit(derived, prompt_kv(64), "t", origin)
    shared.saver.submit(own, prompt_kv(64), "t")
    shared.flush()
    hit = shared.store.match(spec, derived, "t", return_kv=False)
    assert (hit.tokens, hit.converted_from, hit.adapter) == (64, *origin)
    assert shared.store.match(spec, own, "t", return_kv=False).adapter == ""
    # a disable purges the derived entries, not the model's own
    assert shared.bridge.disable_adapter(shipped)
    assert shared.store.match(spec, derived, "t").tokens == 0
    assert shared.store.match(spec, own, "t").tokens == 64
    # a save queued for the disabled adapter stores nothing
    late = list(range(500, 564))
    shared.saver.submit(late, prompt_kv(64), "t", origin)
    shared.flush()
    assert shared.store.match(spec, late, "t").tokens == 0
    assert shared.counters.totals()["saves_purged"] == 1 and shared.counters.totals()["save_errors"] == 0


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_engine_spec_of_a_real_model_folder_is_the_models_spec(name, tmp_path, monkeypatch):
    """vLLM serving a converted folder by its path (model, tokenizer and the default served
    name all the path) gives the connector exactly kvbridge.models.load's spec: the name the
    folder holds, its version and tokenizer id, Gemma 3's per-layer attention, the KV dtype;
    the same through another path to the folder and under another served name, so an adapter
    fitted on the folder applies without renaming anything."""
    from transformers import AutoConfig

    from real_models import folder

    path, why = folder(name)
    if path is None:
        pytest.skip(why)
    # Gemma's tokenizer.json is 33 MB: hash each folder's files once in this test.
    monkeypatch.setattr(specs, "tokenizer_id", functools.lru_cache()(specs.tokenizer_id))
    # models.load's spec is specs.folder_spec of the folder and its model's config (the engine
    # test compares the running engines' specs with models.load itself).
    config = AutoConfig.from_pretrained(path)
    reference = specs.folder_spec(path, config, "float32")
    plain = options.parse_options({}, 32)
    spec = options.engine_spec(config, str(path), str(path), [str(path)], torch.float32, "auto",
                               plain)
    assert spec == reference and spec.fingerprint == reference.fingerprint
    assert spec.name == name and spec.name == specs.model_name(path, config)
    assert list(spec.layer_attention) == list(reference.layer_attention)
    if name == "gemma3-270m":
        assert sum(a.sliding_window == 512 for a in spec.layer_attention) == 15
    link = tmp_path / "served-from-here"
    link.symlink_to(path, target_is_directory=True)
    for model, served in ((str(link), [str(link)]), (str(path), ["my-api-name"]),
                          (str(path), "my-api-name")):
        assert options.engine_spec(config, model, model, served, torch.float32, "auto",
                                   plain) == reference
    # The KV dtype is the engine's cache dtype (here bfloat16 weights, or a float16 cache).
    assert options.engine_spec(config, str(path), str(path), None, torch.bfloat16, "auto",
                               plain) == specs.folder_spec(path, config, "bfloat16")
    assert options.engine_spec(config, str(path), str(path), None, torch.float32, "float16",
                               plain).dtype == "float16"
    # model_name still overrides the name (and only it).
    renamed = options.engine_spec(config, str(path), str(path), None, torch.float32, "auto",
                                  options.parse_options({"model_name": "other"}, 32))
    assert renamed.name == "other" and renamed.version == reference.version


def test_kv_cache_groups_rule():
    """One KV cache group whose layers keep every token's blocks: what vLLM gives Gemma 3 with
    the hybrid KV cache manager off (sliding-window layers promoted to full attention, their
    window kept for the kernel). Several groups, or sliding layers that drop blocks before
    max_model_len, are refused."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    def config(*specs_):
        return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}"], s)
                                                for i, s in enumerate(specs_)])

    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=256, dtype=torch.float32)
    promoted = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=256,
                                 dtype=torch.float32, sliding_window=512)
    sliding = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=256,
                                dtype=torch.float32, sliding_window=512)
    worker.check_kv_cache_groups(None)
    worker.check_kv_cache_groups(config(full), 1024)
    worker.check_kv_cache_groups(config(promoted), 1024)
    worker.check_kv_cache_groups(config(sliding), 512)  # no request outgrows the window
    with pytest.raises(ValueError, match="2 KV cache groups"):
        worker.check_kv_cache_groups(config(full, sliding), 1024)
    with pytest.raises(ValueError, match="does not keep every token's blocks"):
        worker.check_kv_cache_groups(config(sliding), 1024)


def test_source_tokenizers_are_found_by_their_files(tmp_path, monkeypatch):
    """An adapter source's tokenizer folder is taken from the 'tokenizers' option, else from
    where kvbridge.models converted the source, and only for the tokenizer id its files give."""
    from kvbridge import models

    shipped = kvbridge.LinearAdapter.load(ADAPTER)
    tok_dir = tmp_path / "given"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text('{"model": {"type": "BPE"}, "x": 1}')
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"model": {"type": "BPE"}, "x": 2}')
    fields = {n: getattr(shipped.source, n) for n, _, _ in kvbridge.ModelSpec.FIELDS}
    source = kvbridge.ModelSpec(**dict(fields, name="src-model",
                                       tokenizer=specs.tokenizer_id(tok_dir)))
    fake = type("A", (), {"source": source, "target": shipped.target})()
    monkeypatch.setenv("KVBRIDGE_MODELS_DIR", str(tmp_path / "models"))
    assert tokenizer_setup.source_tokenizers([fake], (str(other), str(tok_dir))) == \
        {source.tokenizer: str(tok_dir)}
    with pytest.raises(ValueError, match="'tokenizers' option"):
        tokenizer_setup.source_tokenizers([fake], (str(other),))
    converted = models.models_dir() / "src-model"
    converted.mkdir(parents=True)
    (converted / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    assert tokenizer_setup.source_tokenizers([fake], ()) == {source.tokenizer: str(converted)}


def test_connector_module_keeps_its_public_names():
    """KVTransferConfig names the connector by module path: kvbridge.vllm and
    kvbridge.vllm.connector both give the one class, and the connector module still exports
    the names it documents."""
    import kvbridge.vllm as kv_vllm

    assert kv_vllm.KVBridgeConnector is connector.KVBridgeConnector
    assert kv_vllm.COUNTERS is stats.COUNTERS and kv_vllm.TIMERS is stats.TIMERS
    for name in connector.__all__:
        assert getattr(connector, name) is not None, name
    assert connector.LoadOp is metadata.LoadOp
    assert connector.load_into_blocks is worker.load_into_blocks


def _vllm_imports():
    """{module: kvbridge.vllm modules it imports}, at module level or inside functions."""
    import ast

    folder = pathlib.Path(connector.__file__).parent
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name in names:
        found = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "kvbridge.vllm":
                    found |= {a.name for a in node.names if a.name in names}
                elif node.module.startswith("kvbridge.vllm."):
                    found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names
                          if a.name.startswith("kvbridge.vllm.")}
        graph[name] = found - {name}
    return graph


def test_vllm_modules_import_one_way():
    """No import loop inside kvbridge.vllm (lazy imports count): the roles and their parts
    form a tree under connector, and only shadow (which drives the connector) sits above it."""
    graph = _vllm_imports()
    assert "connector" in graph["shadow"]
    for name in ("scheduler", "worker", "registry", "saver", "stats", "metadata"):
        assert "connector" not in graph[name] and "shadow" not in graph[name], name
    state = {}

    def visit(name, path):
        if state.get(name) == "open":
            raise AssertionError(f"import loop: {' -> '.join(path + [name])}")
        if state.get(name) == "done":
            return
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            visit(dep, path + [name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])


def test_each_role_serves_its_own_calls():
    """A connector holds only its role's side: a call of the other role raises kvbridge.Error
    rather than running on state the role never builds."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    conn = connector.KVBridgeConnector.__new__(connector.KVBridgeConnector)
    conn._role, conn._scheduler, conn._worker = KVConnectorRole.WORKER, None, object()
    with pytest.raises(kvbridge.Error, match="scheduler-side call on the worker connector"):
        conn.build_connector_meta(None)
    conn._role, conn._scheduler, conn._worker = KVConnectorRole.SCHEDULER, object(), None
    with pytest.raises(kvbridge.Error, match="worker-side call on the scheduler connector"):
        conn.get_block_ids_with_load_errors()


def _braces(text):
    """Each `name` in backquotes of `text`, with `a_{b,c}_d` expanded to a_b_d and a_c_d."""
    import itertools
    import re
    names = []
    for quoted in re.findall(r"`([a-z_{},]+)`", text):
        parts = re.split(r"\{([a-z_,]+)\}", quoted)
        options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
        names += ["".join(c) for c in itertools.product(*options)]
    return set(names)


def test_readme_names_every_connector_counter_and_timer():
    """The README's Metrics paragraph names each counter and timer stats.py declares (and no
    other), so a new counter cannot go undocumented."""
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("- Metrics: `connector.stats()`")
    paragraph = readme[start:readme.index("\n- ", start + 1)]
    named = _braces(paragraph[:paragraph.index("with the Bridge's")])
    assert named - {"connector.stats()"} == set(stats.COUNTERS) | set(stats.TIMERS)
    assert _braces("`a_{b,c}_d` `e`") == {"a_b_d", "a_c_d", "e"}


def test_key_norm_and_cross_tokenizer_adapters_load_on_the_host():
    """device_load.loads_on_host: an adapter to the spec from another tokenizer, or one keeping
    the target's key norm or taking its token codes (which the CUDA convert does not apply),
    sends its loads through Bridge.load; a plain same-tokenizer adapter does not."""
    from kvbridge.vllm import device_load
    tgt = kvbridge.ModelSpec("kn-tgt", 2, 1, 4, rope_base=10000.0, tokenizer="tok-a")
    g = torch.Generator().manual_seed(4)

    def kv(spec):
        return tuple((torch.randn(1, spec.num_kv_heads, 64, spec.head_dim, generator=g),
                      torch.randn(1, spec.num_kv_heads, 64, spec.head_dim, generator=g))
                     for _ in range(spec.num_layers))

    def adapter(name, **kw):
        src = kvbridge.ModelSpec(name, 2, 2, 8, rope_base=10000.0, tokenizer="tok-a")
        fitter = kvbridge.AdapterFitter(src, tgt, source_layers="all", **kw)
        fitter.add(kv(src), kv(tgt))
        return fitter.fit()

    bridge = kvbridge.Bridge(kvbridge.KVStore(capacity_bytes=1 << 20, chunk_tokens=4))
    bridge.add_adapter(adapter("kn-plain"))
    assert not device_load.loads_on_host(bridge, tgt)
    bridge.add_adapter(adapter("kn-normed", target_key_norm=torch.rand(2, 4, generator=g) + 0.5))
    assert device_load.loads_on_host(bridge, tgt)

    # One taking the target's token codes (the CUDA convert does not add them either).
    codes = torch.randn(10, 2, generator=g)
    ids = torch.randint(10, (64,), generator=g).tolist()
    src = kvbridge.ModelSpec("kn-codes", 2, 2, 8, rope_base=10000.0, tokenizer="tok-a")
    fitter = kvbridge.AdapterFitter(src, tgt, source_layers="all", target_token_codes=codes)
    shift = codes[ids].sum(-1).reshape(1, 1, 64, 1) * 3  # targets that depend on the ids
    fitter.add(kv(src), tuple((k + shift, v - shift) for k, v in kv(tgt)), target_ids=ids)
    with_codes = fitter.fit()
    assert with_codes.has_token_codes
    bridge = kvbridge.Bridge(kvbridge.KVStore(capacity_bytes=1 << 20, chunk_tokens=4))
    bridge.add_adapter(adapter("kn-plain"))
    bridge.add_adapter(with_codes)
    assert device_load.loads_on_host(bridge, tgt)
