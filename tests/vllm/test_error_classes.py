"""The vLLM connector's checks raise kvbridge.InvalidArgumentError for bad values (as the rest of
the package does, tests/python/test_error_classes.py), never a bare ValueError."""
import pytest
import torch

pytest.importorskip("vllm")

import kvbridge  # noqa: E402
from kvbridge.vllm import options, paged  # noqa: E402

BAD = [
    ("paged layout", lambda: paged.kv_views(torch.zeros(2, 2, 4, 8), "nhd", 4)),
    ("paged shape", lambda: paged.kv_views(torch.zeros(2, 2, 4, 6), "cpu", 4)),
    ("unknown option", lambda: options.parse_options({"no_such_option": 1}, 16)),
    ("layout option", lambda: options.parse_options({"layout": "nhd"}, 16)),
    ("chunk_tokens option", lambda: options.parse_options({"chunk_tokens": 0}, 16)),
]


@pytest.mark.parametrize("what, call", BAD, ids=[b[0] for b in BAD])
def test_bad_value_is_invalid_argument(what, call):
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is kvbridge.InvalidArgumentError, (
        f"{what}: {type(info.value).__name__}: {info.value}")
