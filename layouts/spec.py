"""Descriptions of one layer's KV page on one rank, and of that rank's place in its group.
Pure data: nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["LayerSpec", "RankContext", "check_choice", "dtype_name", "element_size", "is_int"]

ATTENTION_KINDS = ("full", "mla")
PACKINGS = ("packed", "split")
ORDERS = ("NHD", "HND")

# Byte widths of the dtypes a KV cache is stored in. The ops move bytes, so only
# the width matters; names follow torch's spelling without the "torch." prefix.
_ELEMENT_SIZES = {
    **dict.fromkeys(("float64", "int64"), 8),
    **dict.fromkeys(("float32", "int32"), 4),
    **dict.fromkeys(("float16", "bfloat16", "int16"), 2),
    **dict.fromkeys(("int8", "uint8", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"), 1),
    **dict.fromkeys(("float8_e5m2fnuz", "float8_e8m0fnu"), 1),
}
_ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp8_e4m3fnuz": "float8_e4m3fnuz",
    "fp8_e5m2fnuz": "float8_e5m2fnuz",
}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype given as a string, a torch dtype or a numpy dtype; ValueError
    if it is not one a KV cache is stored in."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif type(dtype).__module__ == "torch":  # torch.dtype, without importing torch
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = _ALIASES.get(name, name)
    if name not in _ELEMENT_SIZES:
        raise ValueError(
            f"dtype: expected one of {sorted(_ELEMENT_SIZES)} (or a torch/numpy dtype), got {dtype!r}"
        )
    return name


def element_size(dtype: Any) -> int:
    """Bytes per element of ``dtype``."""
    return _ELEMENT_SIZES[dtype_name(dtype)]


def is_int(value: Any) -> bool:
    """An int or numpy integer, never a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


@dataclass(frozen=True)
class LayerSpec:
    """One layer's KV page on ONE rank: ``attention`` "full" (K and V per head) or "mla" (one
    TP-replicated latent per token); ``block_size`` tokens; ``num_kv_heads`` on this rank (MLA:
    1) of ``head_size`` elements (MLA: the latent width); storage ``dtype`` (normalised to its
    name); ``packing`` "packed" (K and V adjacent per (token, head)) or "split" (K then V page
    halves); stride ``order`` "NHD" (token-major) or "HND" (MLA: packed NHD only, its one
    layout). Pages holding ``per_token_head_scales`` inside, or with ``tokens_per_state`` other
    than 1, are never certified (companion scales are: :class:`layouts.KVScales`)."""

    attention: str
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    packing: str
    order: str
    per_token_head_scales: bool = False
    tokens_per_state: int | Fraction = 1

    def __post_init__(self) -> None:
        check_choice("attention", self.attention, ATTENTION_KINDS)
        check_choice("packing", self.packing, PACKINGS)
        check_choice("order", self.order, ORDERS)
        for name in ("block_size", "num_kv_heads", "head_size"):
            _positive_int(name, getattr(self, name))
        if self.attention == "mla":
            # An MLA latent cache has one layout, (blocks, tokens, latent): one spelling.
            if self.num_kv_heads != 1:
                raise ValueError(
                    f"num_kv_heads: expected 1 for attention='mla' (one latent), "
                    f"got {self.num_kv_heads}"
                )
            for name, want in (("packing", "packed"), ("order", "NHD")):
                if getattr(self, name) != want:
                    raise ValueError(
                        f"{name}: expected {want!r} for attention='mla' (one latent row per "
                        f"token, as LayerSpec.from_tensor reports it), got {getattr(self, name)!r}"
                    )
        tps = self.tokens_per_state
        if not (is_int(tps) or isinstance(tps, Fraction)) or tps <= 0:
            raise ValueError(f"tokens_per_state: expected a positive int or Fraction, got {tps!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "per_token_head_scales", bool(self.per_token_head_scales))

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype``."""
        return _ELEMENT_SIZES[self.dtype]

    @property
    def num_states(self) -> int:
        """Stored states per block (``block_size`` unless tokens are compressed)."""
        return int(self.block_size // self.tokens_per_state)

    @property
    def state_bytes(self) -> int:
        """Bytes of one (head, state) cell: K and V for full attention, the latent for MLA."""
        width = self.head_size if self.attention == "mla" else 2 * self.head_size
        return width * self.element_size

    @property
    def page_size_bytes(self) -> int:
        """This rank's unpadded page of this layer, in bytes."""
        return self.num_kv_heads * self.num_states * self.state_bytes

    @classmethod
    def from_tensor(
        cls,
        kv_cache: Any,
        *,
        attention: str,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        per_token_head_scales: bool = False,
        tokens_per_state: int | Fraction = 1,
    ) -> LayerSpec | None:
        """Recognise packing and order from a KV cache's shape and strides (reading only
        ``shape``, ``stride()`` or numpy ``strides``, and ``dtype``), as vLLM does: ``packed``
        (num_blocks, heads, block_size, 2*head_size), ``split`` (num_blocks, 2, block_size,
        heads, head_size), MLA (num_blocks, block_size, head_size) as packed NHD; the last dim
        contiguous, no padding. None for any other layout (then never certify the layer)."""
        shape = tuple(int(s) for s in kv_cache.shape)
        strides = _element_strides(kv_cache)[1:]  # in elements, without the block's
        bs, heads, hs, row = block_size, num_kv_heads, head_size, 2 * head_size
        if attention == "mla":  # (blocks, tokens, latent) with contiguous rows
            packing, orders = "packed", ({"NHD": (hs, 1)} if shape[1:] == (bs, hs) else {})
        elif shape[1:] == (heads, bs, row):  # strides of (head, token, element)
            packing, orders = "packed", {"NHD": (row, heads * row, 1), "HND": (bs * row, row, 1)}
        elif shape[1:] == (2, bs, heads, hs):  # strides of (half, token, head, element)
            half = bs * heads * hs
            orders = {"NHD": (half, heads * hs, hs, 1), "HND": (half, hs, bs * hs, 1)}
            packing = "split"
        else:
            return None
        order = next((order for order, want in orders.items() if strides == want), None)
        fields = (attention, block_size, num_kv_heads, head_size, kv_cache.dtype, packing, order)
        flags = dict(per_token_head_scales=per_token_head_scales, tokens_per_state=tokens_per_state)
        return None if order is None else cls(*fields, **flags)


def _element_strides(tensor: Any) -> tuple[int, ...]:
    stride = getattr(tensor, "stride", None)
    if callable(stride):  # torch.Tensor: strides in elements
        return tuple(int(s) for s in stride())
    itemsize = np.dtype(tensor.dtype).itemsize  # numpy: strides in bytes
    return tuple(int(s) // itemsize for s in tensor.strides)


@dataclass(frozen=True)
class RankContext:
    """One rank's place in a TP x PCP worker group (``rank = pcp_rank * tp_size + tp_rank``),
    DCP inside TP (``dcp_rank = tp_rank % dcp_size``); context-parallel ranks own interleaved
    chunks of ``interleave`` tokens of each offloaded block."""

    tp_size: int
    total_kv_heads: int
    rank: int
    dcp_size: int = 1
    pcp_size: int = 1
    interleave: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "total_kv_heads", "dcp_size", "pcp_size", "interleave"):
            _positive_int(name, getattr(self, name))
        if not (is_int(self.rank) and 0 <= self.rank < self.group_size):
            raise ValueError(
                f"rank: expected an int in [0, tp_size * pcp_size = {self.group_size}), "
                f"got {self.rank!r}"
            )

    @property
    def group_size(self) -> int:
        """Ranks in the TP x PCP group."""
        return self.tp_size * self.pcp_size

    @property
    def cp_size(self) -> int:
        """Context-parallel ways a block's tokens are split (DCP x PCP)."""
        return self.dcp_size * self.pcp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pcp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.dcp_size

    @property
    def cp_rank(self) -> int:
        """Position of this rank's token chunks among all CP ranks."""
        return self.pcp_rank * self.dcp_size + self.dcp_rank

    def canonical_token(self, local_token: int) -> int:
        """Canonical token index of this rank's ``local_token`` within a block."""
        chunk, within = divmod(local_token, self.interleave)
        return (chunk * self.cp_size + self.cp_rank) * self.interleave + within
