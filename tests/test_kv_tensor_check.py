"""The kv-tensor check is on by default: a mapping derived by ``layouts`` knows the page it
was derived for, and ``make_plan`` and both ops refuse a tensor that is not that page before
any byte moves, with no ``specs=`` from the caller (#20)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import canonical_ops
from canonical_ops.plan import spec_geometry
from layouts import LayerSpec, derive_group_mappings, derive_layer_mapping
from layouts.spec import RankContext

NHD = LayerSpec("full", 16, 2, 64, "bfloat16", "packed", "NHD")  # TP=4 of 8 heads
NUM_BLOCKS = 8


def cache_for(spec: LayerSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A kv cache laid out exactly as ``spec`` says (``dtype`` overrides the element type)."""
    shape, strides = spec_geometry(spec)
    per_block = 1
    for size in shape:
        per_block *= size
    flat = torch.randn(NUM_BLOCKS * per_block).to(dtype or getattr(torch, spec.dtype))
    return flat.as_strided((NUM_BLOCKS, *shape), (per_block, *strides))


def hnd_contiguous(spec: LayerSpec) -> torch.Tensor:
    """The same shape as an NHD packed cache, but contiguous: physically HND."""
    return cache_for(spec).contiguous()


def pages_for(mapping, rows: int = NUM_BLOCKS) -> torch.Tensor:
    return torch.randint(0, 256, (rows, mapping.canonical_page_size_bytes), dtype=torch.uint8)


def wrong_tensors() -> dict[str, tuple[object, torch.Tensor, str]]:
    """The issue's three cases: (mapping, tensor, what the error must name)."""
    tp8 = LayerSpec("full", 16, 1, 64, "bfloat16", "packed", "NHD")
    return {
        "hnd tensor, nhd mapping": (
            derive_group_mappings(NHD, 4, 8)[1],
            hnd_contiguous(NHD),
            r"kv_caches\[0\]: does not match mappings\[0\].*strides.*HND",
        ),
        "float32 tensor, bfloat16 mapping": (
            derive_group_mappings(NHD, 4, 8)[1],
            cache_for(NHD, torch.float32),
            r"kv_caches\[0\]: does not match mappings\[0\].*dtype bfloat16.*got float32",
        ),
        "tp8 mapping, two-head tensor": (
            derive_group_mappings(tp8, 8, 8)[3],
            cache_for(NHD),
            r"kv_caches\[0\]: does not match mappings\[0\].*shape \(num_blocks, 1, 16, 128\)",
        ),
    }


@pytest.mark.parametrize("case", list(wrong_tensors()))
def test_make_plan_refuses_tensor_the_mapping_was_not_derived_for(case):
    mapping, kv, message = wrong_tensors()[case]
    assert mapping.derived_for is not None
    with pytest.raises(ValueError, match=message):
        canonical_ops.make_plan([mapping], [kv], pages_for(mapping))


@pytest.mark.parametrize("case", list(wrong_tensors()))
@pytest.mark.parametrize("op", ["store", "load"])
def test_ops_refuse_tensor_other_than_the_one_planned(case, op):
    """The twins through each op: a plan built for the right tensor, a call with the wrong
    one of the same block stride and count: refused, and no byte of either side changes."""
    mapping, wrong, _ = wrong_tensors()[case]
    right = cache_for(mapping.derived_for)
    pages = pages_for(mapping)
    plan = canonical_ops.make_plan([mapping], [right], pages)
    pages_before, wrong_before = pages.clone(), wrong.clone()
    ids = torch.arange(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"kv_caches\[0\]: plan built for"):
        getattr(canonical_ops, op)([wrong], pages, plan, ids, ids)
    assert torch.equal(pages, pages_before)
    assert torch.equal(wrong.view(torch.uint8), wrong_before.view(torch.uint8))


def test_error_names_the_layer():
    """Of several layers, the one whose tensor does not fit is named."""
    mapping = derive_group_mappings(NHD, 4, 8)[0]
    kv = [cache_for(NHD), cache_for(NHD), hnd_contiguous(NHD)]
    pages = torch.zeros(NUM_BLOCKS, 3 * mapping.canonical_page_size_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_caches\[2\]: does not match mappings\[2\]"):
        canonical_ops.make_plan([mapping] * 3, kv, pages)


def test_right_tensor_moves_bytes_without_specs():
    mapping = derive_group_mappings(NHD, 4, 8)[2]
    kv = cache_for(NHD)
    pages = pages_for(mapping)
    plan = canonical_ops.make_plan([mapping], [kv], pages)
    ids = torch.arange(NUM_BLOCKS, dtype=torch.int64)
    canonical_ops.store([kv], pages, plan, ids, ids)
    back = torch.zeros_like(kv)
    canonical_ops.load([back], pages, canonical_ops.make_plan([mapping], [back], pages), ids, ids)
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


def test_single_rank_derivation_carries_its_page():
    ctx = RankContext(tp_size=4, total_kv_heads=8, rank=1)
    mapping = derive_layer_mapping(NHD, ctx)
    assert mapping.derived_for == NHD and mapping.fallback_reason is None
    with pytest.raises(ValueError, match=r"kv_caches\[0\].*float32"):
        canonical_ops.make_plan([mapping], [cache_for(NHD, torch.float32)], pages_for(mapping))


def test_opaque_mapping_checks_dtype_and_whole_page():
    """An uncertified layer (3 heads over TP=2) is stored opaquely: its tensor must hold the
    spec's dtype and one whole page per block, whatever the layout inside the block."""
    spec = LayerSpec("full", 16, 1, 64, "float16", "split", "NHD")
    group = derive_group_mappings(spec, 2, 3)
    mapping = group[1]
    assert mapping.fallback_reason is not None and "does not divide" in mapping.fallback_reason
    assert mapping.derived_for == spec
    pages = pages_for(mapping)
    canonical_ops.make_plan([mapping], [cache_for(spec)], pages)
    canonical_ops.make_plan([mapping], [cache_for(spec).flatten(1)], pages)  # any inner layout
    with pytest.raises(ValueError, match=r"kv_caches\[0\].*dtype float16.*got float32"):
        canonical_ops.make_plan([mapping], [cache_for(spec, torch.float32)], pages)
    two_heads = dataclasses.replace(spec, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"kv_caches\[0\].*4096 bytes per block.*8192"):
        canonical_ops.make_plan([mapping], [cache_for(two_heads)], pages)


def test_hand_built_mapping_is_checked_for_fit_only():
    """A mapping built from another program's runs has no page of its own: fit only, or
    the caller's ``specs=``."""
    bare = dataclasses.replace(derive_group_mappings(NHD, 4, 8)[1], derived_for=None)
    as_bytes = cache_for(NHD).view(torch.uint8).flatten(1)
    canonical_ops.make_plan([bare], [as_bytes], pages_for(bare))
    with pytest.raises(ValueError, match=r"kv_caches\[0\]: does not match specs\[0\]"):
        canonical_ops.make_plan([bare], [as_bytes], pages_for(bare), specs=[NHD])


def test_mapping_equality_ignores_what_it_was_derived_for():
    """Mappings compare by their bytes (as vLLM's do): the page they carry is a description."""
    derived = derive_group_mappings(NHD, 4, 8)[1]
    assert dataclasses.replace(derived, derived_for=None) == derived
