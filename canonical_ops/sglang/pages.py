"""SGLang host KV pages <-> canonical unit bytes, through one plan per rank and the CPU kernel:
a host page of any pool ``layout`` is viewed as ``(layers, *block)`` (MHA: a ``split NHD`` page,
MLA: an ``mla`` one) and moved to and from unit rows by ``canonical_ops.ops.store`` / ``load``
(imported on first use: importing this module loads no extension)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layouts import LayerSpec, WriterElection, derive_group_mappings
from layouts.spec import dtype_name

__all__ = ["MHA_LAYOUTS", "MLA_LAYOUTS", "HostPageCodec", "PageTransfer"]

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# Scratch of one transfer: at most this many bytes of unit rows (and at most 16 pages).
_BATCH_BYTES = 32 << 20


@dataclass(frozen=True)
class HostPageCodec:
    """One rank's host pages of an SGLang pool: ``attention`` ``"full"`` or ``"mla"``, the
    pool's ``layout``, the stage's layers, the rank's KV ``heads`` (MLA: 1) of ``head_dim``
    elements (MLA: the latent width), its place in the TP group and the model's KV heads."""

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
        object.__setattr__(self, "mappings", mappings)

    @property
    def spec(self) -> LayerSpec:
        """Every layer's page on this rank, as ``layouts`` describes it (``mappings[r]``:
        rank ``r``'s mapping of it, verified to tile the canonical page)."""
        packing = "packed" if self.attention == "mla" else "split"
        args = (self.page_size, self.heads, self.head_dim, self.dtype, packing, "NHD")
        return LayerSpec(self.attention, *args)

    @property
    def local_page_bytes(self) -> int:
        return self.mappings[self.tp_rank].local_page_size_bytes

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One layer's page as the spec lays it out: (2, page, heads, dim) or (page, width)."""
        p, h, d = self.page_size, self.heads, self.head_dim
        return (p, d) if self.attention == "mla" else (2, p, h, d)

    def writer_ranks(self) -> list[int]:
        """TP ranks whose bytes together make a unit: the writers ``layouts`` elects for page 0,
        for every unit (so rank 0 is in it, as SGLang's MLA election of rank 0 requires)."""
        return sorted(WriterElection([self.mappings]).writers(0))

    def _page_shape(self) -> tuple[int, ...]:
        """One page as SGLang's ``get_data_page(index, flat=False)`` slices it (MLA: one head,
        and a leading K/V axis of 1 added here)."""
        p, n, h, d = self.page_size, self.num_layers, self.heads, self.head_dim
        return (2 - (self.attention == "mla"),) + {
            "layer_first": (n, p, h, d),
            "page_first": (p, n, h, d),
            "page_first_direct": (1, n, p, h, d),
            "page_head": (1, h, p, n, d),
        }[self.layout]

    def host_page(self, pool: Any, index: int):
        """A writable view of the pool's page starting at token slot ``index``."""
        p = self.page_size
        lead = () if self.attention == "mla" else (slice(None),)  # MHA: K and V first
        if self.layout == "layer_first":
            return pool.kv_buffer[(*lead, slice(None), slice(index, index + p))]
        if self.layout == "page_first":
            return pool.kv_buffer[(*lead, slice(index, index + p))]
        return pool.kv_buffer[(*lead, slice(index // p, index // p + 1))]  # one page per row

    def layer_view(self, page: Any):
        """``page`` (a host page, or SGLang's flat form of one) viewed as ``(layers, *block)``."""
        page = page.reshape(self._page_shape())
        if self.layout == "layer_first":
            view = page.permute(1, 0, 2, 3, 4)
        elif self.layout == "page_first":
            view = page.permute(2, 0, 1, 3, 4)
        elif self.layout == "page_first_direct":
            view = page[:, 0].permute(1, 0, 2, 3, 4)
        else:  # page_head: (2, H, P, L, D)
            view = page[:, 0].permute(3, 0, 2, 1, 4)
        return view[:, 0, :, 0] if self.attention == "mla" else view


class PageTransfer:
    """Scratch ``blocks`` (``batch`` + :attr:`spare` for another rank's share), unit ``rows``
    of layers ``[first, end)`` and the plans of ``ranks``, built once: host pages <-> canonical
    units. Not thread-safe: hold :attr:`lock` while using it."""

    def __init__(
        self, codec: HostPageCodec, namespace: Any, first: int, end: int, ranks: Sequence[int]
    ) -> None:
        unit_bytes = namespace.layer_bytes(first, end)
        self.batch = max(1, min(16, _BATCH_BYTES // unit_bytes))
        self.codec, self.spare, self.lock = codec, self.batch, threading.Lock()
        shape = (self.batch + 1, codec.num_layers, *codec.block_shape)
        self.blocks = torch.zeros(shape, dtype=getattr(torch, codec.dtype))
        self.rows = torch.zeros((self.batch, unit_bytes), dtype=torch.uint8)
        self.layers = [self.blocks[:, layer] for layer in range(codec.num_layers)]
        offsets = list(namespace.payload_offsets(first, end)[:-1])
        from ..plan import make_plan  # loads the extension

        self.plans = {
            rank: make_plan(
                [codec.mappings[rank]] * codec.num_layers,
                self.layers,
                self.rows,
                area_offsets=offsets,
            )
            for rank in ranks
        }

    def block_bytes(self, index: int):
        """Block ``index`` as flat bytes: a rank's fragment payload (a view)."""
        return self.blocks[index].reshape(-1).view(torch.uint8)

    def take(self, index: int, page: Any) -> None:
        """Copy a host page into block ``index``."""
        self.blocks[index].copy_(self.codec.layer_view(page))

    def give(self, index: int, page: Any) -> None:
        """Copy block ``index`` into a host page (a writable view)."""
        self.codec.layer_view(page).copy_(self.blocks[index])

    def place(self, rank: int, block: int, row: int) -> None:
        """Rank ``rank``'s share of block ``block`` into unit row ``row``, as page 0's writers."""
        from ..ops import store

        store(self.layers, self.rows[row : row + 1], self.plans[rank], [block], [0])

    def extract(self, count: int) -> None:
        """This rank's bytes of unit rows ``[0, count)`` into blocks ``[0, count)``."""
        from ..ops import load

        ids = list(range(count))
        load(self.layers, self.rows, self.plans[self.codec.tp_rank], ids, ids)
