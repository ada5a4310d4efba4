"""Pipeline parallelism: which contiguous layers each stage owns (vLLM's split). Pure Python,
so a front end can check a topology before it loads any engine."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["pp_layer_range", "pp_layer_ranges"]


def _int_in(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` (a Python or numpy integer, not a bool) as an int in ``[minimum, maximum]``:
    TypeError for a non-integer, ValueError naming ``name`` for one out of range."""
    wanted = f"an int in [{minimum}, {maximum}]" if maximum is not None else f"an int >= {minimum}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected {wanted}, got {type(value).__name__} {value!r}")
    number = int(value)
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"{name}: expected {wanted}, got {number}")
    return number


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[first, end)`` of pipeline stage ``pp_rank``: vLLM's ``get_pp_indices``
    without ``VLLM_PP_LAYER_PARTITION`` (the remainder goes one layer each to the stages
    before the last, from the second-to-last backwards)."""
    num_layers = _int_in("num_layers", num_layers, 1)
    pp_size = _int_in("pp_size", pp_size, 1, num_layers)
    pp_rank = _int_in("pp_rank", pp_rank, 0, pp_size - 1)
    partitions = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partitions[-i] += 1
    first = sum(partitions[:pp_rank])
    return first, first + partitions[pp_rank]


def pp_layer_ranges(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Every stage's :func:`pp_layer_range`, stage 0 first."""
    return [pp_layer_range(num_layers, rank, pp_size) for rank in range(pp_size)]
