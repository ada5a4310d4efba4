"""SGLang host KV pages <-> canonical unit bytes (torch and numpy; SGLang is never imported).

An SGLang HiCache host pool holds, per TP rank, every layer of its pipeline
stage for ``page_size`` tokens per page:

* MHA (``MHATokenToKVPoolHost``): separate K and V buffers, each token's
  ``[heads, head_dim]`` rows; one layer's page is K ``[page, heads, dim]``
  then V ``[page, heads, dim]``: a ``split`` ``NHD`` page in ``layouts`` terms.
* MLA (``MLATokenToKVPoolHost``): one latent row per token, ``[page, 1,
  width]``: an ``mla`` page (described as ``packed`` ``NHD``, as the frontend
  engine describes MLA).

The pool's ``layout`` only orders these same rows differently in memory
(``layer_first``, ``page_first``, ``page_first_direct``, MHA ``page_head``);
:class:`HostPageCodec` views one page of any of them as ``(layers, local page)``
and converts it to and from the canonical unit (layers ``[first, end)`` of
the stage, the frontend's region row) through the rank's
:class:`layouts.CanonicalPageMapping`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from layouts import CanonicalPageMapping, LayerSpec, derive_group_mappings
from layouts.spec import dtype_name

__all__ = ["MHA_LAYOUTS", "MLA_LAYOUTS", "HostPageCodec", "byte_index"]

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def byte_index(mapping: CanonicalPageMapping) -> np.ndarray:
    """int64 ``(local_page_size_bytes,)``: the canonical offset of every local byte."""
    frags = mapping.fragments()
    out = np.empty(mapping.local_page_size_bytes, dtype=np.int64)
    if not len(frags):
        return out
    local, canonical, size = frags[:, 0], frags[:, 1], frags[:, 2]
    # Byte j of fragment f sits at local[f] + j and canonical[f] + j.
    within = np.arange(int(size.sum()), dtype=np.int64) - np.repeat(np.cumsum(size) - size, size)
    out[np.repeat(local, size) + within] = np.repeat(canonical, size) + within
    return out


@dataclass(frozen=True)
class HostPageCodec:
    """One rank's host pages of one SGLang pool, as canonical unit bytes.

    Parameters
    ----------
    attention : {"full", "mla"}
    layout : str
        The pool's ``layout``.
    page_size : int
        Tokens per host page.
    num_layers : int
        Layers in the pool (the stage's layers).
    heads : int
        KV heads held by this rank (1 for MLA).
    head_dim : int
        Elements per head (MLA: the latent width).
    dtype : str
        Storage dtype name.
    tp_size, tp_rank, total_kv_heads : int
        This rank's place in its TP group and the model's KV heads (1 for MLA).
    """

    attention: str
    layout: str
    page_size: int
    num_layers: int
    heads: int
    head_dim: int
    dtype: str
    tp_size: int
    tp_rank: int
    total_kv_heads: int

    def __post_init__(self) -> None:
        allowed = MLA_LAYOUTS if self.attention == "mla" else MHA_LAYOUTS
        if self.layout not in allowed:
            raise ValueError(
                f"layout: expected one of {allowed} for a {self.attention} host pool, "
                f"got {self.layout!r}"
            )
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        mappings = derive_group_mappings(
            self.spec, self.tp_size, self.total_kv_heads, layer_name="sglang host page"
        )
        object.__setattr__(self, "_mappings", mappings)
        object.__setattr__(self, "_indices", {})

    # ------------------------------------------------------------------ geometry

    @property
    def spec(self) -> LayerSpec:
        """Every layer's page on this rank, as ``layouts`` describes it."""
        if self.attention == "mla":
            return LayerSpec("mla", self.page_size, 1, self.head_dim, self.dtype, "packed", "NHD")
        return LayerSpec(
            "full", self.page_size, self.heads, self.head_dim, self.dtype, "split", "NHD"
        )

    @property
    def mappings(self) -> tuple[CanonicalPageMapping, ...]:
        """Every rank's mapping, indexed by TP rank (verified to tile the canonical page)."""
        return self._mappings

    @property
    def mapping(self) -> CanonicalPageMapping:
        """This rank's mapping."""
        return self._mappings[self.tp_rank]

    @property
    def certified(self) -> bool:
        """Whether the pages are canonical (readable by any TP); else opaque (same TP only)."""
        return self.mapping.parallelism_agnostic

    @property
    def local_page_bytes(self) -> int:
        return self.mapping.local_page_size_bytes

    @property
    def canonical_page_bytes(self) -> int:
        return self.mapping.canonical_page_size_bytes

    def writer_ranks(self) -> list[int]:
        """TP ranks whose bytes together make a unit: the writers elected for page 0.

        One fixed election (page 0) for every unit: rank 0 is always in it, as
        SGLang's own MLA writer election (only rank 0 stores) requires.
        """
        return [r for r, m in enumerate(self._mappings) if m.is_writer(0)]

    def index(self, rank: int) -> np.ndarray:
        """:func:`byte_index` of ``rank``'s mapping (cached)."""
        cached = self._indices.get(rank)
        if cached is None:
            cached = byte_index(self._mappings[rank])
            cached.setflags(write=False)
            self._indices[rank] = cached
        return cached

    # ------------------------------------------------------------------ host pages

    def _page_shape(self) -> tuple[int, ...]:
        """Shape of one page as SGLang's ``get_data_page(index, flat=False)`` slices it."""
        p, n, h, d = self.page_size, self.num_layers, self.heads, self.head_dim
        if self.attention == "mla":
            return {
                "layer_first": (n, p, 1, d),
                "page_first": (p, n, 1, d),
                "page_first_direct": (1, n, p, 1, d),
            }[self.layout]
        return {
            "layer_first": (2, n, p, h, d),
            "page_first": (2, p, n, h, d),
            "page_first_direct": (2, 1, n, p, h, d),
            "page_head": (2, 1, h, p, n, d),
        }[self.layout]

    def host_page(self, pool: Any, index: int):
        """A writable view of the pool's page starting at token slot ``index``."""
        p = self.page_size
        kv = pool.kv_buffer
        if self.attention == "mla":
            if self.layout == "layer_first":
                return kv[:, index : index + p]
            if self.layout == "page_first":
                return kv[index : index + p]
            return kv[index // p : index // p + 1]
        if self.layout == "layer_first":
            return kv[:, :, index : index + p]
        if self.layout == "page_first":
            return kv[:, index : index + p]
        return kv[:, index // p : index // p + 1]

    def layer_view(self, page: Any):
        """``page`` (a host page, or SGLang's flat form of one) viewed as
        ``(layers, 2, page, heads, dim)`` (MHA) or ``(layers, page, 1, dim)`` (MLA)."""
        page = page.reshape(self._page_shape())
        if self.attention == "mla":
            if self.layout == "layer_first":
                return page
            if self.layout == "page_first":
                return page.permute(1, 0, 2, 3)
            return page[0]
        if self.layout == "layer_first":
            return page.permute(1, 0, 2, 3, 4)
        if self.layout == "page_first":
            return page.permute(2, 0, 1, 3, 4)
        if self.layout == "page_first_direct":
            return page[:, 0].permute(1, 0, 2, 3, 4)
        return page[:, 0].permute(3, 0, 2, 1, 4)  # page_head: (2, H, P, L, D)

    def read_local(self, page: Any) -> np.ndarray:
        """uint8 ``(layers, local page bytes)``: a copy of this rank's pages of every layer."""
        import torch

        local = self.layer_view(page).contiguous().reshape(self.num_layers, -1)
        return local.view(torch.uint8).numpy().reshape(self.num_layers, self.local_page_bytes)

    def write_local(self, page: Any, local: np.ndarray) -> None:
        """Copy uint8 ``(layers, local page bytes)`` into ``page`` (a writable view)."""
        import torch

        view = self.layer_view(page)
        source = torch.from_numpy(np.ascontiguousarray(local)).view(view.dtype)
        view.copy_(source.reshape(view.shape))

    # ------------------------------------------------------------------ canonical units

    def scatter(self, rank: int, local: np.ndarray, unit: np.ndarray, offsets: Any) -> None:
        """Place ``rank``'s local pages (``(layers, local bytes)``) into ``unit``.

        ``offsets[l]`` is layer ``l``'s canonical page in the unit payload.
        """
        index = self.index(rank)
        for layer, offset in enumerate(offsets):
            unit[offset + index] = local[layer]

    def gather(self, unit: np.ndarray, offsets: Any) -> np.ndarray:
        """This rank's local pages of every layer, read from a unit payload."""
        index = self.index(self.tp_rank)
        out = np.empty((self.num_layers, self.local_page_bytes), dtype=np.uint8)
        for layer, offset in enumerate(offsets):
            out[layer] = unit[offset + index]
        return out
