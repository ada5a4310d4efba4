"""Fail-closed cases: no certified mapping, and the group falls back to opaque pages."""

from fractions import Fraction

import numpy as np
import pytest

from layouts import (
    CANONICAL_FORMAT_VERSION,
    LayerSpec,
    RankContext,
    canonical_format_id,
    certification_failure,
    derive_group_mappings,
    derive_layer_mapping,
    opaque_fallback_mapping,
)


def full(heads: int, **kw) -> LayerSpec:
    return LayerSpec(
        "full",
        kw.pop("block_size", 16),
        heads,
        128,
        "bfloat16",
        kw.pop("packing", "packed"),
        kw.pop("order", "NHD"),
        **kw,
    )


def mla(**kw) -> LayerSpec:
    return LayerSpec("mla", kw.pop("block_size", 16), 1, 576, "bfloat16", "packed", "NHD", **kw)


CASES = {
    "heads mismatch": (full(2), RankContext(tp_size=2, total_kv_heads=8, rank=0), "num_kv_heads=2"),
    "indivisible tp": (
        full(2),
        RankContext(tp_size=3, total_kv_heads=8, rank=0),
        "does not divide",
    ),
    "indivisible replication": (
        full(1),
        RankContext(tp_size=6, total_kv_heads=4, rank=0),
        "does not divide tp_size=6",
    ),
    "dcp not dividing replication": (
        full(2),
        RankContext(tp_size=4, total_kv_heads=8, rank=0, dcp_size=2),
        "dcp_size=2",
    ),
    "interleave over block": (
        full(8, block_size=4),
        RankContext(1, 8, 0, pcp_size=2, interleave=8),
        "interleave=8",
    ),
    "interleave not dividing block": (
        full(8, block_size=12),
        RankContext(1, 8, 0, pcp_size=2, interleave=8),
        "interleave=8",
    ),
    "per-token-head scales": (
        full(8, per_token_head_scales=True),
        RankContext(1, 8, 0),
        "per-token-head",
    ),
    "mla per-token-head scales": (
        mla(per_token_head_scales=True),
        RankContext(2, 1, 0),
        "per-token-head",
    ),
    "mla tokens_per_state": (mla(tokens_per_state=2), RankContext(2, 1, 0), "tokens_per_state=2"),
    "full tokens_per_state fraction": (
        full(8, tokens_per_state=Fraction(1, 2)),
        RankContext(1, 8, 0),
        "tokens_per_state=1/2",
    ),
    "mla dcp not dividing tp": (mla(), RankContext(6, 1, 0, dcp_size=4), "dcp_size=4"),
    "unrecognised layout": (None, RankContext(1, 8, 0), "unrecognised"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fail_closed(case: str) -> None:
    spec, ctx, reason = CASES[case]
    assert derive_layer_mapping(spec, ctx) is None
    assert reason in certification_failure(spec, ctx)


def test_valid_cases_have_no_failure_reason() -> None:
    assert certification_failure(full(2), RankContext(4, 8, 3)) is None
    # interleave is irrelevant without context parallelism
    assert derive_layer_mapping(full(8, block_size=4), RankContext(1, 8, 0, interleave=8))


@pytest.mark.parametrize(
    "case",
    [
        "heads mismatch",
        "per-token-head scales",
        "mla tokens_per_state",
        "indivisible tp",
        "mla dcp not dividing tp",
    ],
)
def test_group_falls_back_to_opaque(case: str) -> None:
    spec, ctx, _ = CASES[case]
    mappings = derive_group_mappings(
        spec, ctx.tp_size, ctx.total_kv_heads, ctx.dcp_size, ctx.pcp_size, ctx.interleave
    )
    assert len(mappings) == ctx.tp_size * ctx.pcp_size
    for rank, m in enumerate(mappings):
        assert m == opaque_fallback_mapping(spec.page_size_bytes, len(mappings), rank)
        assert not m.parallelism_agnostic and m.num_writers == 1


def test_fallback_page_size_counts_states() -> None:
    # tokens_per_state 2 halves the stored states; the opaque page is the unpadded page.
    spec = mla(tokens_per_state=2)
    assert spec.page_size_bytes == 8 * 1152
    assert derive_group_mappings(spec, 2, 1)[1].runs[0].canonical_offset == 8 * 1152


def test_opaque_fallback_mapping_shape_and_errors() -> None:
    m = opaque_fallback_mapping(4096, 4, 3)
    assert m.canonical_page_size_bytes == 16384 and m.fragments().tolist() == [[0, 12288, 4096]]
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 4\)"):
        opaque_fallback_mapping(4096, 4, 4)
    with pytest.raises(ValueError, match="page_size_bytes"):
        opaque_fallback_mapping(-1, 4, 0)
    assert opaque_fallback_mapping(0, 2, 1).fragments().shape == (1, 3)  # 0-byte page, as vLLM


def test_format_id() -> None:
    assert CANONICAL_FORMAT_VERSION == 1
    assert canonical_format_id("NHD") == "v1-nhd"
    assert canonical_format_id("HND") == "v1-hnd"
    with pytest.raises(ValueError, match="order: expected 'NHD' or 'HND'"):
        canonical_format_id("NDH")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(attention="sparse"), "attention: expected one of"),
        (dict(packing="interleaved"), "packing: expected one of"),
        (dict(order="nhd"), "order: expected one of"),
        (dict(block_size=0), "block_size: expected a positive int"),
        (dict(num_kv_heads=2, attention="mla"), "num_kv_heads: expected 1"),
        (dict(dtype="complex64"), "dtype: expected one of"),
        (dict(tokens_per_state=0), "tokens_per_state"),
    ],
)
def test_layer_spec_validation(kwargs: dict, message: str) -> None:
    args = dict(
        attention="full",
        block_size=16,
        num_kv_heads=1,
        head_size=128,
        dtype="bfloat16",
        packing="packed",
        order="NHD",
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        LayerSpec(**args)


@pytest.mark.parametrize(
    ("packing", "order", "name", "want"),
    [("packed", "HND", "order", "NHD"), ("split", "NHD", "packing", "packed")],
)
def test_mla_spec_has_one_spelling(packing: str, order: str, name: str, want: str) -> None:
    """An MLA latent has one layout: another packing or order is refused up front (it was
    accepted, derived a mapping equal to the packed NHD one, then make_plan refused every
    MLA tensor), and the one accepted spelling plans the tensor from_tensor recognises."""
    with pytest.raises(ValueError, match=rf"^{name}: expected '{want}' for attention='mla'"):
        LayerSpec("mla", 16, 1, 64, "bfloat16", packing, order)
    torch = pytest.importorskip("torch")
    from canonical_ops import make_plan

    latent = torch.zeros(4, 16, 64, dtype=torch.bfloat16)
    spec = LayerSpec.from_tensor(
        latent, attention="mla", block_size=16, num_kv_heads=1, head_size=64
    )
    assert spec == LayerSpec("mla", 16, 1, 64, "bfloat16", "packed", "NHD")
    mapping = derive_layer_mapping(spec, RankContext(2, 1, 1))
    make_plan(
        [mapping], [latent], torch.zeros(4, mapping.canonical_page_size_bytes, dtype=torch.uint8)
    )


def test_rank_context_validation() -> None:
    with pytest.raises(
        ValueError, match=r"rank: expected an int in \[0, tp_size \* pcp_size = 4\)"
    ):
        RankContext(tp_size=2, total_kv_heads=8, rank=4, pcp_size=2)
    with pytest.raises(ValueError, match="dcp_size: expected a positive int"):
        RankContext(tp_size=2, total_kv_heads=8, rank=0, dcp_size=0)


def test_dtype_spellings() -> None:
    assert LayerSpec("full", 16, 1, 8, np.float16, "packed", "NHD").dtype == "float16"
    assert LayerSpec("full", 16, 1, 8, "torch.bfloat16", "packed", "NHD").element_size == 2
    assert LayerSpec("full", 16, 1, 8, "fp8", "packed", "NHD").dtype == "float8_e4m3fn"
