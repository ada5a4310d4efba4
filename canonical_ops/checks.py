"""The one checker of integer arguments (and id arrays) used across canonical_ops.

Every public entry point that takes a count, an index or an id goes through here, so
they all agree: Python and numpy integers are accepted; anything else (floats, bools,
strings, None) raises ``TypeError``; a value out of range raises ``ValueError`` (or a
subclass such as ``PageStateError``). Messages name the argument and the expected value.
Pure Python + numpy (torch only when a tensor is passed): no compiled extension needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["check_ids", "check_int", "check_seconds"]


def _describe_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[ValueError] = ValueError,
) -> int:
    """``value`` as a Python int, after checking its type and range.

    Parameters
    ----------
    name : str
        The argument's name, as the caller spells it (used in the message).
    value : Any
        A Python or numpy integer; ``bool`` is refused (``True`` is not a count).
    minimum, maximum : int, optional
        Inclusive bounds.
    error : type[ValueError]
        Exception raised for a value out of range (a ``ValueError`` subclass).

    Raises
    ------
    TypeError
        ``value`` is not an integer (float, bool, str, None, ...).
    ValueError
        ``value`` is out of ``[minimum, maximum]`` (or ``error``).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name}: expected {_describe_range(minimum, maximum)}, got "
            f"{type(value).__name__} {value!r}"
        )
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise error(f"{name}: expected {_describe_range(minimum, maximum)}, got {number}")
    return number


def check_seconds(name: str, value: Any, *, optional: bool = False) -> float | None:
    """``value`` as float seconds > 0 (finite); None passes when ``optional``.

    TypeError for a non-number (bool, str, ...), ValueError for 0, a negative, inf or nan.
    """
    if value is None and optional:
        return None
    what = "a number of seconds > 0" + (" or None" if optional else "")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name}: expected {what}, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return float(value)


_INT_KINDS = ("i", "u")


def check_ids(name: str, ids: Any) -> np.ndarray | torch.Tensor:
    """An id array as int64, refusing anything that is not made of integers.

    Parameters
    ----------
    name : str
        The argument's name (used in messages).
    ids : torch.Tensor | numpy.ndarray | Sequence[int]
        1-D integer ids. Tensors and arrays of any integer dtype are accepted (and
        converted to int64); floating point, bool or object dtypes are refused, as are
        sequences holding anything but Python / numpy integers. Nothing is rounded or
        coerced.

    Returns
    -------
    torch.Tensor | numpy.ndarray
        A tensor (on its device, int64) when given a tensor, else an int64 numpy array.

    Raises
    ------
    TypeError
        Not integers.
    ValueError
        Not 1-D.
    """
    if type(ids).__module__.startswith("torch") and hasattr(ids, "dtype"):
        import torch

        if not isinstance(ids, torch.Tensor):  # pragma: no cover - torch-like non-tensors
            raise TypeError(f"{name}: expected a tensor of integer ids, got {type(ids).__name__}")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{name}: expected integer ids, got a tensor of dtype {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor of ids, got {ids.dim()}-D")
        return ids if ids.dtype == torch.int64 else ids.to(torch.int64)
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in _INT_KINDS:
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
