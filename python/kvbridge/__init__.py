"""kvbridge: reuse one LLM's prompt KV cache in another.

KV caches are Hugging Face's legacy form: a tuple with one ``(key, value)`` pair per layer, each a
torch tensor ``[batch, kv_heads, tokens, head_dim]`` (batch 1 for the store).
"""
from kvbridge import _openblas

_openblas.set_default_core_type()  # before _core loads the system OpenBLAS

from kvbridge._core import (
    CorruptError,
    Error,
    InvalidArgumentError,
    LayerAttention,
    ModelSpec,
    NotFoundError,
    RopeScaling,
    UnavailableError,
    cpu_convert_kernel,
    cuda_device_count,
)
from kvbridge._core import version as _version
from kvbridge.align import ALIGN_POLICIES, TextAlignment, align, align_text, token_offsets
from kvbridge.adapter import AdapterFitter, LinearAdapter, fit_adapter
from kvbridge.bridge import Bridge, Load
from kvbridge.store import KVStore, Match, prefix_hashes
from kvbridge import exact, monitor  # after bridge: monitor builds on it

__version__ = _version()

__all__ = [
    "ALIGN_POLICIES",
    "TextAlignment",
    "align",
    "align_text",
    "token_offsets",
    "AdapterFitter",
    "Bridge",
    "LinearAdapter",
    "fit_adapter",
    "CorruptError",
    "Error",
    "InvalidArgumentError",
    "KVStore",
    "LayerAttention",
    "Load",
    "Match",
    "ModelSpec",
    "NotFoundError",
    "RopeScaling",
    "UnavailableError",
    "cpu_convert_kernel",
    "cuda_device_count",
    "exact",
    "monitor",
    "prefix_hashes",
    "__version__",
]
