"""kvbridge.specs' rules for each supported family, on configs built by transformers itself
(no weights needed): geometry, per-layer RoPE and sliding windows, refusals."""
import pytest
import transformers

import kvbridge
from kvbridge import specs


def spec_of(config):
    return specs.spec_from_config(config, "m", "float32", "v", "t")


def test_llama_and_qwen_are_uniform():
    llama = transformers.LlamaConfig(num_hidden_layers=3, num_attention_heads=8,
                                     num_key_value_heads=2, hidden_size=256,
                                     rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                      "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192})
    s = spec_of(llama)
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.rope_base) == (3, 2, 32, 5e5)
    assert s.rope_scaling.type == "llama3" and list(s.layer_attention) == []
    qwen = transformers.Qwen2Config(num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, hidden_size=128,
                                    use_sliding_window=False, sliding_window=64)
    assert list(spec_of(qwen).layer_attention) == []  # the window is not in use


def test_mistral_window_on_every_layer():
    s = spec_of(transformers.MistralConfig(num_hidden_layers=3, num_attention_heads=4,
                                           num_key_value_heads=2, hidden_size=128,
                                           sliding_window=96))
    assert [a.sliding_window for a in s.layer_attention] == [96, 96, 96]
    assert all(a.rope_base == s.rope_base for a in s.layer_attention)


def test_gemma2_and_gemma3_alternate_layers():
    g2 = spec_of(transformers.Gemma2Config(num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, hidden_size=128, head_dim=32,
                                           sliding_window=64))
    windows = [a.sliding_window for a in g2.layer_attention]
    assert sorted(set(windows)) == [0, 64] and len(windows) == 4
    g3 = spec_of(transformers.Gemma3TextConfig(num_hidden_layers=12, num_attention_heads=4,
                                               num_key_value_heads=1, hidden_size=128,
                                               head_dim=32, sliding_window=128))
    for t, a in zip(g3_types := specs.layer_types(transformers.Gemma3TextConfig(
            num_hidden_layers=12)), g3.layer_attention):
        assert (a.sliding_window == 128) == (t == "sliding_attention")
        assert a.rope_base == (1e4 if t == "sliding_attention" else 1e6)
    assert "full_attention" in g3_types and g3.rope_base == 1e6  # spec-wide: the full layers'


def test_phi3_and_refusals():
    phi = transformers.Phi3Config(num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, hidden_size=128, sliding_window=None)
    assert spec_of(phi).head_dim == 32
    partial = transformers.Phi3Config(num_hidden_layers=2, num_attention_heads=4,
                                      hidden_size=128, partial_rotary_factor=0.5)
    with pytest.raises(kvbridge.InvalidArgumentError, match="partial rotary"):
        spec_of(partial)
    gpt2 = transformers.GPT2Config(n_layer=2)
    with pytest.raises(kvbridge.InvalidArgumentError, match="model_type 'gpt2'"):
        spec_of(gpt2)
