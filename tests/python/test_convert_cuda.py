"""LinearAdapter.convert on CUDA tensors: stays on the device, on torch's current stream, and
agrees with the CPU path and the float64 reference (tolerances of include/kvbridge/adapter.h:
1e-4 float32, 2e-2 bfloat16, 4e-3 float16, relative to each tensor's largest value)."""
import pytest
import torch

import kvbridge
from conftest import random_kv

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


def fitted(dtype, per_layer=False):
    """per_layer: both specs with per-layer attention (a Gemma-3-like source of two RoPE groups,
    a target of two), so each layer's keys use their own table."""
    LA = kvbridge.LayerAttention
    llama3 = kvbridge.RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    src_layers = [LA(1e4, sliding_window=16), LA(1e4, sliding_window=16), LA(1e6)]
    tgt_layers = [LA(3e5), LA(1e4, llama3, 8)]
    src = kvbridge.ModelSpec("s", 3, 3, 10, dtype=dtype, rope_base=20000.0,
                             layer_attention=src_layers if per_layer else [])
    tgt = kvbridge.ModelSpec("t", 2, 5, 6, dtype=dtype, rope_style="interleaved",
                             rope_scaling=llama3,
                             layer_attention=tgt_layers if per_layer else [])
    fitter = kvbridge.AdapterFitter(src, tgt, source_layers=[[0, 2], [1]])
    fitter.add(random_kv(src, 203, 1), random_kv(tgt, 203, 2))
    return src, tgt, fitter.fit()


def to_cuda(kv):
    return tuple((k.cuda(), v.cuda()) for k, v in kv)


def assert_close(got, want, tol):
    assert len(got) == len(want)
    for pair, pair0 in zip(got, want):
        for a, b in zip(pair, pair0):
            assert a.shape == b.shape and a.dtype == b.dtype
            scale = b.float().abs().max().item()
            assert scale > 0
            err = (a.float().cpu() - b.float().cpu()).abs().max().item()
            assert err <= tol * scale, (err, scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("per_layer", [False, True])
def test_matches_cpu_and_reference(dtype, strided, per_layer):
    src_spec, tgt_spec, adapter = fitted(dtype, per_layer)
    src = random_kv(src_spec, 37, 3, strided=strided)
    out = adapter.convert(to_cuda(src), start_pos=517)
    assert all(t.device.type == "cuda" for pair in out for t in pair)
    assert out[0][0].shape == (1, 5, 37, 6) and out[0][0].dtype == getattr(torch, dtype)
    torch.cuda.synchronize()
    assert_close(out, adapter.convert(src, start_pos=517), TOL[dtype])
    assert_close(out, adapter.convert(src, start_pos=517, reference=True), TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_aligned_matches_cpu_and_reference(dtype, per_layer):
    # Across tokenizers: the gather by index inside the kernels, repeats and an out-of-order
    # entry, blocks of target tokens (a small scratch budget is not reachable from Python, so
    # one block; the C++ host test covers the per-element functions).
    src_spec, tgt_spec, adapter = fitted(dtype, per_layer)
    src = random_kv(src_spec, 41, 6, strided=True)
    g = torch.Generator().manual_seed(9)
    index = torch.sort(torch.randint(0, 41, (67,), generator=g)).values
    index[[3, 60]] = index[[60, 3]]
    index = index.tolist()
    out = adapter.convert(to_cuda(src), start_pos=300, alignment=index, target_start_pos=12)
    assert out[0][0].shape == (1, 5, 67, 6) and out[0][0].device.type == "cuda"
    torch.cuda.synchronize()
    want = adapter.convert(src, start_pos=300, alignment=index, target_start_pos=12)
    assert_close(out, want, TOL[dtype])
    ref = adapter.convert(src, start_pos=300, alignment=index, target_start_pos=12,
                          reference=True)
    assert_close(out, ref, TOL[dtype])


def test_token_slice_and_one_token():
    src_spec, _, adapter = fitted("bfloat16")
    src = to_cuda(random_kv(src_spec, 50, 4))
    sliced = tuple((k[:, :, 11:40], v[:, :, 11:40]) for k, v in src)  # non-contiguous views
    got = adapter.convert(sliced, start_pos=100 + 11)
    want = adapter.convert(tuple((k.cpu(), v.cpu()) for k, v in sliced), start_pos=111)
    assert_close(got, want, TOL["bfloat16"])
    one = tuple((k[:, :, 7:8], v[:, :, 7:8]) for k, v in src)
    host_one = tuple((k.cpu(), v.cpu()) for k, v in one)
    assert_close(adapter.convert(one, 7), adapter.convert(host_one, 7), TOL["bfloat16"])
    empty = adapter.convert(tuple((k[:, :, :0], v[:, :, :0]) for k, v in src))
    assert empty[0][0].shape == (1, 5, 0, 6) and empty[0][0].device.type == "cuda"


def test_runs_on_the_current_stream():
    src_spec, _, adapter = fitted("float32")
    src = random_kv(src_spec, 29, 5)
    want = adapter.convert(src, 3)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cuda_src = to_cuda(src)
        got = adapter.convert(cuda_src, 3)
    stream.synchronize()
    assert_close(got, want, TOL["float32"])


def test_reference_on_cuda_tensors_comes_back_on_the_device():
    src_spec, _, adapter = fitted("float16")
    src = random_kv(src_spec, 9, 6)
    got = adapter.convert(to_cuda(src), 0, reference=True)
    want = adapter.convert(src, 0, reference=True)  # the same float64 computation on the host
    assert got[0][0].device.type == "cuda"
    assert all(torch.equal(a.cpu(), b) for pa, pb in zip(got, want) for a, b in zip(pa, pb))


@pytest.mark.skipif(kvbridge.cuda_device_count() == 0,
                    reason="the native core has no CUDA path (host copies instead)")
def test_mixed_devices_are_rejected():
    src_spec, _, adapter = fitted("float32")
    src = list(to_cuda(random_kv(src_spec, 5, 7)))
    src[1] = (src[1][0].cpu(), src[1][1])
    with pytest.raises(ValueError, match="device"):
        adapter.convert(tuple(src))
