"""Independent ground truth for canonical pages, built from first principles.

Nothing here uses the mappings: given the unsharded KV of one block span
(every head, every canonical token), it builds what each rank physically
holds and what the canonical page must contain, straight from the sharding
rules (head shards and replicas over TP, token chunks over DCP x PCP) and the
four page layouts. Tests then check that the mappings move exactly these bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from layouts import LayerSpec


@dataclass(frozen=True)
class Topology:
    tp: int
    dcp: int = 1
    pcp: int = 1
    interleave: int = 1

    @property
    def cp(self) -> int:
        return self.dcp * self.pcp

    @property
    def ranks(self) -> int:
        return self.tp * self.pcp


def random_truth(
    rng: np.random.Generator, attention: str, total_heads: int, tokens: int, head_bytes: int
) -> np.ndarray:
    """Unsharded KV bytes: (2, heads, tokens, head_bytes) for full attention, (tokens, bytes) MLA."""
    shape = (tokens, head_bytes) if attention == "mla" else (2, total_heads, tokens, head_bytes)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def canonical_page(truth: np.ndarray, spec: LayerSpec) -> np.ndarray:
    """The canonical page (1-D uint8) of a block span: the single-rank page of all heads/tokens."""
    if spec.attention == "mla":
        return truth.reshape(-1).copy()
    k, v = truth[0], truth[1]  # (heads, tokens, bytes)
    if spec.packing == "packed":
        cells = np.concatenate([k, v], axis=-1)  # (heads, tokens, 2*bytes)
        page = cells.transpose(1, 0, 2) if spec.order == "NHD" else cells
    else:
        halves = np.stack([k, v])  # (2, heads, tokens, bytes)
        page = halves.transpose(0, 2, 1, 3) if spec.order == "NHD" else halves
    return np.ascontiguousarray(page).reshape(-1)


def local_page(
    truth: np.ndarray, spec: LayerSpec, topo: Topology, total_heads: int, rank: int
) -> np.ndarray:
    """What ``rank`` physically holds of the block span, in its page layout (1-D uint8)."""
    tp_rank, pcp_rank = rank % topo.tp, rank // topo.tp
    cp_rank = pcp_rank * topo.dcp + tp_rank % topo.dcp
    bs = spec.block_size
    # Local token t is canonical token chunk (t // I) * cp + cp_rank, offset t % I.
    local = np.arange(bs)
    tokens = ((local // topo.interleave) * topo.cp + cp_rank) * topo.interleave + (
        local % topo.interleave
    )
    if spec.attention == "mla":
        return truth[tokens].reshape(-1).copy()
    heads_here = spec.num_kv_heads
    if total_heads >= topo.tp:
        heads = np.arange(tp_rank * heads_here, (tp_rank + 1) * heads_here)
    else:
        heads = np.array([tp_rank // (topo.tp // total_heads)])
    sub = truth[:, heads][:, :, tokens]  # (2, heads_here, bs, bytes)
    return canonical_page(sub, spec)  # same layout rules at the local shape
