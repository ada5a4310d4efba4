"""Property tests: exact tiling, and bytes stored by topology A read back by topology B."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.layout_truth import Topology, canonical_page, local_page, random_truth
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layouts import (
    LayerSpec,
    TilingError,
    derive_group_mappings,
    opaque_fallback_mapping,
    verify_tiling,
)

DTYPES = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}
CANONICAL_TOKENS = 32  # tokens per canonical page, shared by A and B


@st.composite
def topologies(draw, attention: str, total_heads: int) -> Topology:
    """A topology that certifies: head/TP divisibility, DCP inside replication, valid interleave."""
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    if attention == "mla":
        dcp_choices = [d for d in (1, 2, 4) if tp % d == 0]
    else:
        replication = max(1, tp // total_heads)
        dcp_choices = [d for d in (1, 2, 4) if replication % d == 0]
    dcp = draw(st.sampled_from(dcp_choices))
    pcp = draw(st.sampled_from([p for p in (1, 2, 4) if dcp * p <= 8]))
    block_size = CANONICAL_TOKENS // (dcp * pcp)
    interleave = draw(st.sampled_from([i for i in (1, 2, 4, 8, 16) if block_size % i == 0]))
    return Topology(tp, dcp, pcp, interleave)


def layer_spec(attention, packing, order, dtype, head_size, total_heads, topo) -> LayerSpec:
    heads = 1 if attention == "mla" else max(1, total_heads // topo.tp)
    if attention == "mla":  # one layout (LayerSpec refuses other spellings)
        packing, order = "packed", "NHD"
    return LayerSpec(
        attention, CANONICAL_TOKENS // topo.cp, heads, head_size, dtype, packing, order
    )


def store(mappings, pages: list[np.ndarray], page_ids: list[int], size: int) -> np.ndarray:
    """Pure-numpy store: each elected writer copies its fragments into each canonical page."""
    out = np.full((len(page_ids), size), 0xA5, dtype=np.uint8)  # poison: gaps would show
    for slot, page_id in enumerate(page_ids):
        for rank, mapping in enumerate(mappings):
            if not mapping.is_writer(page_id):
                continue
            for local, canonical, n in mapping.fragments():
                out[slot, canonical : canonical + n] = pages[slot][rank][local : local + n]
    return out


def load(mapping, canonical: np.ndarray) -> np.ndarray:
    out = np.full(mapping.local_page_size_bytes, 0x5A, dtype=np.uint8)
    for local, canon, n in mapping.fragments():
        out[local : local + n] = canonical[canon : canon + n]
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_store_by_a_load_by_b(data) -> None:
    attention = data.draw(st.sampled_from(["full", "mla"]), label="attention")
    packing = data.draw(st.sampled_from(["packed", "split"]), label="packing")
    order = data.draw(st.sampled_from(["NHD", "HND"]), label="order")
    dtype = data.draw(st.sampled_from(sorted(DTYPES)), label="dtype")
    head_size = data.draw(st.sampled_from([1, 2, 3, 8]), label="head_size")
    total_heads = 1 if attention == "mla" else data.draw(st.sampled_from([1, 2, 4, 8]))
    topo_a = data.draw(topologies(attention, total_heads), label="A")
    topo_b = data.draw(topologies(attention, total_heads), label="B")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))

    spec_a = layer_spec(attention, packing, order, dtype, head_size, total_heads, topo_a)
    spec_b = layer_spec(attention, packing, order, dtype, head_size, total_heads, topo_b)
    maps_a = derive_group_mappings(
        spec_a, topo_a.tp, total_heads, topo_a.dcp, topo_a.pcp, topo_a.interleave
    )
    maps_b = derive_group_mappings(
        spec_b, topo_b.tp, total_heads, topo_b.dcp, topo_b.pcp, topo_b.interleave
    )
    assert all(
        m.parallelism_agnostic == (t.cp == 1) for m, t in [(maps_a[0], topo_a), (maps_b[0], topo_b)]
    )
    size = maps_a[0].canonical_page_size_bytes
    assert size == maps_b[0].canonical_page_size_bytes

    page_ids = [0, 1, 2, 5, 7]  # several ids: replicated writers rotate
    head_bytes = head_size * DTYPES[dtype]
    truths = [
        random_truth(rng, attention, total_heads, CANONICAL_TOKENS, head_bytes) for _ in page_ids
    ]
    pages_a = [
        [local_page(t, spec_a, topo_a, total_heads, r) for r in range(topo_a.ranks)] for t in truths
    ]
    stored = store(maps_a, pages_a, page_ids, size)
    for slot, truth in enumerate(truths):
        np.testing.assert_array_equal(stored[slot], canonical_page(truth, spec_a))
        for rank, mapping in enumerate(maps_b):
            expected = local_page(truth, spec_b, topo_b, total_heads, rank)
            np.testing.assert_array_equal(load(mapping, stored[slot]), expected)


@settings(max_examples=100, deadline=None)
@given(
    attention=st.sampled_from(["full", "mla"]),
    packing=st.sampled_from(["packed", "split"]),
    order=st.sampled_from(["NHD", "HND"]),
    total_heads=st.sampled_from([1, 2, 4, 8, 16]),
    data=st.data(),
)
def test_tiling_exact_and_runs_cover_local_page(attention, packing, order, total_heads, data):
    total_heads = 1 if attention == "mla" else total_heads
    topo = data.draw(topologies(attention, total_heads))
    spec = layer_spec(attention, packing, order, "bfloat16", 4, total_heads, topo)
    mappings = derive_group_mappings(
        spec, topo.tp, total_heads, topo.dcp, topo.pcp, topo.interleave
    )
    verify_tiling(mappings)
    for m in mappings:
        assert m.fragments()[:, 2].sum() == m.local_page_size_bytes == spec.page_size_bytes
    # Every canonical byte is written num_writers times over num_writers pages: once per page.
    writes = sum(m.local_page_size_bytes for m in mappings)
    assert writes == mappings[0].num_writers * mappings[0].canonical_page_size_bytes


def test_opaque_fallback_roundtrip_same_topology() -> None:
    mappings = [opaque_fallback_mapping(100, 4, r) for r in range(4)]
    verify_tiling(mappings)
    pages = [[np.full(100, r, dtype=np.uint8) for r in range(4)]]
    stored = store(mappings, pages, [3], 400)
    assert stored[0].tolist() == [r for r in range(4) for _ in range(100)]
    for r, m in enumerate(mappings):
        np.testing.assert_array_equal(load(m, stored[0]), pages[0][r])


def test_verify_tiling_names_layer_and_gap() -> None:
    good = derive_group_mappings(LayerSpec("full", 16, 4, 128, "bfloat16", "packed", "HND"), 2, 8)
    with pytest.raises(TilingError, match=r"layer L7: writers \[0\] .* gap .*\[32768, 65536\)"):
        verify_tiling(good[:1], layer_name="L7")
    with pytest.raises(TilingError, match=r"overlap .*\[0, 32768\).*ranks touching it: \[0, 1\]"):
        verify_tiling([good[0], good[0]], layer_name="L7")


def test_verify_tiling_local_gap_and_disagreement() -> None:
    from dataclasses import replace

    good = derive_group_mappings(LayerSpec("full", 16, 4, 128, "bfloat16", "packed", "HND"), 2, 8)
    short = replace(good[1], local_page_size_bytes=good[1].local_page_size_bytes + 8)
    with pytest.raises(TilingError, match=r"rank 1's runs leave a gap in its local page"):
        verify_tiling([good[0], short], layer_name="x")
    other = replace(good[1], canonical_page_size_bytes=1)
    with pytest.raises(TilingError, match="rank 1 has canonical_page_size_bytes=1"):
        verify_tiling([good[0], other])
    writers = replace(good[1], num_writers=2)
    with pytest.raises(TilingError, match="rank 1 has num_writers=2"):
        verify_tiling([good[0], writers])
