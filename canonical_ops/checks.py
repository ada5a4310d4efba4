"""The one checker of typed, boolean and integer arguments and id arrays across canonical_ops, so
every entry point agrees: ``TypeError`` for a wrong type, ``ValueError`` (or a subclass) out of
range, naming the argument and the expected value."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["check_bool", "check_ids", "check_int", "check_seconds", "check_type"]


def check_type(name: str, value: Any, cls: type) -> Any:
    """``value`` if it is a ``cls``, else ``TypeError`` naming ``name``."""
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected a {cls.__name__}, got {type(value).__name__}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` (a Python or numpy bool) as a bool, else ``TypeError`` naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def _describe_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None or maximum is not None:
        return f"an int >= {minimum}" if minimum is not None else f"an int <= {maximum}"
    return "an int"


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[ValueError] = ValueError,
) -> int:
    """``value`` (a Python or numpy integer; ``bool`` is refused: ``True`` is not a count)
    as a Python int. TypeError for a non-integer; ``error`` (a ValueError subclass, default
    ValueError) for a value out of the inclusive ``[minimum, maximum]``. ``name``: the
    argument as the caller spells it, named in the message."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name}: expected {_describe_range(minimum, maximum)}, got "
            f"{type(value).__name__} {value!r}"
        )
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise error(f"{name}: expected {_describe_range(minimum, maximum)}, got {number}")
    return number


def check_seconds(
    name: str, value: Any, *, optional: bool = False, zero: bool = False
) -> float | None:
    """``value`` as finite float seconds > 0 (>= 0 with ``zero``); None passes when
    ``optional``. TypeError for a non-number (bool, str, ...), ValueError out of range."""
    if value is None and optional:
        return None
    what = f"a number of seconds {'>=' if zero else '>'} 0" + (" or None" if optional else "")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name}: expected {what}, got {value!r}")
    if not (math.isfinite(value) and (value > 0 or (zero and value == 0))):
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return float(value)


def check_ids(name: str, ids: Any) -> np.ndarray | torch.Tensor:
    """1-D integer ids as int64: a tensor stays a tensor (on its device), anything else
    becomes a numpy array. Tensors and arrays of any integer dtype are converted; floating
    point, bool, complex or object dtypes and sequences holding anything but Python / numpy
    integers raise TypeError (nothing is rounded or coerced); not 1-D raises ValueError."""
    torch = sys.modules.get("torch")  # loaded already if ids is a tensor
    if torch is not None and isinstance(ids, torch.Tensor):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{name}: expected integer ids, got a tensor of dtype {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor of ids, got {ids.dim()}-D")
        return ids if ids.dtype == torch.int64 else ids.to(torch.int64)
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected integer ids, got an array of dtype {ids.dtype}")
        if ids.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D array of ids, got {ids.ndim}-D")
        return ids.astype(np.int64, copy=False)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(
            f"{name}: expected a 1-D tensor, array or sequence of integer ids, got "
            f"{type(ids).__name__}"
        )
    for index, value in enumerate(ids):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(
                f"{name}[{index}]: expected an int id, got {type(value).__name__} {value!r}"
            )
    try:
        return np.asarray(ids, dtype=np.int64).reshape(len(ids))
    except OverflowError:
        raise ValueError(f"{name}: ids must fit in int64") from None
