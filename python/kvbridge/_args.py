"""The one place where Python arguments become the native core's integers, numbers and strings.

Each kind of argument has one check here, used by every call that takes one: the wrong type is a
TypeError (a float, bool or str is never truncated to an int), a value the core's type cannot
hold (or a position past what RoPE computes exactly) a kvbridge.InvalidArgumentError naming the
argument. The core still checks the ranges that depend on more than one value.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from kvbridge import _core

INT64_MAX = 2**63 - 1
MAX_POSITION = 2**53  # positions are exact in float64 up to here (RoPE angles)


def integer(name: str, value: Any, lo: int = 0, hi: int = INT64_MAX) -> int:
    """An int (Python or numpy, not bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise _core.InvalidArgumentError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def size(name: str, value: Any) -> int:
    """A count or byte size: an int in [0, 2^63)."""
    return integer(name, value)


def position(name: str, value: Any) -> int:
    """An absolute token position: an int in [0, 2^53]."""
    return integer(name, value, 0, MAX_POSITION)


def seed(name: str, value: Any) -> int:
    """A random seed: an int in [0, 2^64)."""
    return integer(name, value, 0, 2**64 - 1)


def number(name: str, value: Any) -> float:
    """A real number (int or float, not bool or str)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def flag(name: str, value: Any) -> bool:
    """A bool (numpy's too); anything else is a TypeError rather than its truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def text(name: str, value: Any) -> str:
    """A str the core can take as UTF-8 (no lone surrogates)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__} {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _core.InvalidArgumentError(
            f"{name}: not valid text ({e.reason} at index {e.start}: {value[e.start]!r})"
        ) from None
    return value


def int_list(name: str, value: Any) -> list:
    """A 1-D sequence or array of ints (an alignment, token ids), as a list of ints."""
    arr = np.asarray(value)
    if arr.size == 0 and arr.ndim == 1:
        return []
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected a 1-D sequence of ints, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise _core.InvalidArgumentError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > INT64_MAX:
        raise _core.InvalidArgumentError(f"{name}: entries must fit int64")
    return arr.astype(np.int64).tolist()


def _matrix(name: str, value: Any, dtype: Any) -> np.ndarray:
    """A 2-D array of real numbers (a tensor, an array or nested sequences) in `dtype`; the core
    checks the shape it needs and that each is finite."""
    if hasattr(value, "detach"):  # a torch tensor, on any device
        value = value.detach().cpu().float().numpy()  # bfloat16 has no numpy dtype
    arr = np.asarray(value)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{name}: expected a 2-D array of numbers, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise _core.InvalidArgumentError(f"{name}: expected a 2-D array, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=dtype)


def float32_matrix(name: str, value: Any) -> np.ndarray:
    """_matrix as a C-contiguous float32 array (large tables pass to the core without a list)."""
    return _matrix(name, value, np.float32)


def float_rows(name: str, value: Any) -> list:
    """_matrix as lists of floats."""
    return _matrix(name, value, np.float64).tolist()


def option(name: str, default: Any, value: Any) -> Any:
    """An options-struct field, checked as the kind of its default value."""
    if isinstance(default, bool):
        return flag(name, value)
    if isinstance(default, int):
        return integer(name, value, -INT64_MAX - 1)
    if isinstance(default, float):
        return number(name, value)
    if isinstance(default, str):
        return text(name, value)
    return value
