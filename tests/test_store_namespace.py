"""Namespace digests: what must change them (any canonical byte or its meaning) and what must not."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest

from canonical_ops.units import LayerGeometry, ModelIdentity, StoreNamespace
from layouts import LayerSpec, RankContext, derive_group_mappings

MODEL = ModelIdentity("llama", "abc123", {"rope": {"theta": 500000, "scaling": None}})


def full(tp: int, heads: int = 8, *, block: int = 16, dtype: str = "bfloat16", **kw) -> LayerSpec:
    return LayerSpec(
        "full",
        block,
        max(1, heads // tp),
        kw.pop("head_size", 128),
        dtype,
        kw.pop("packing", "packed"),
        kw.pop("order", "NHD"),
        **kw,
    )


def ns_full(tp: int, heads: int = 8, layers: int = 4, model=MODEL, kv_quant="none", **kw):
    spec = full(tp, heads, **kw)
    return StoreNamespace.from_specs(
        model, [spec] * layers, RankContext(tp, heads, 0), kv_quant=kv_quant
    )


def test_tp_of_a_certified_model_does_not_change_the_digest() -> None:
    digests = {ns_full(tp).digest for tp in (1, 2, 4, 8)}
    # TP=16 over 8 heads replicates them: still the same canonical pages.
    digests.add(ns_full(16).digest)
    assert len(digests) == 1
    assert len(ns_full(1).digest) == 32 and ns_full(1).hex == ns_full(1).digest.hex()


def test_cp_folds_only_its_token_span_into_the_digest() -> None:
    mla = LayerSpec("mla", 16, 1, 576, "bfloat16", "packed", "NHD")
    mla_32 = LayerSpec("mla", 32, 1, 576, "bfloat16", "packed", "NHD")

    def ns(spec, tp, dcp, interleave=1):
        return StoreNamespace.from_specs(
            MODEL, [spec] * 3, RankContext(tp, 1, 0, dcp_size=dcp, interleave=interleave)
        )

    # 16 tokens per rank x dcp=2 is the same 32-token canonical page as 32 tokens at dcp=1,
    # whatever the interleave: canonical pages are in token order.
    assert ns(mla, 4, 2).digest == ns(mla_32, 8, 1).digest == ns(mla, 4, 2, 4).digest
    assert ns(mla, 4, 2).digest != ns(mla, 4, 1).digest  # 32 vs 16 tokens per page


@pytest.mark.parametrize(
    "change",
    [
        dict(dtype="float16"),
        dict(order="HND"),  # format family v1-nhd -> v1-hnd
        dict(packing="split"),
        dict(head_size=64),
        dict(heads=16),
        dict(block=32),  # tokens per page
        dict(layers=5),
        dict(kv_quant="fp8_e4m3"),
        dict(model=ModelIdentity("llama", "def456", MODEL.extra)),
        dict(model=ModelIdentity("mistral", "abc123", MODEL.extra)),
        dict(model=ModelIdentity("llama", "abc123", {"rope": {"theta": 10000}})),
        dict(model=ModelIdentity("llama", "abc123")),
    ],
    ids=lambda c: next(iter(c)) + "=" + str(next(iter(c.values())))[:24],
)
def test_anything_that_changes_bytes_or_meaning_changes_the_digest(change) -> None:
    base = ns_full(2)
    assert ns_full(2, **change).digest != base.digest


def test_format_ids() -> None:
    assert ns_full(2).format_id == "v1-nhd"
    assert ns_full(2, order="HND").format_id == "v1-hnd"
    layer = LayerGeometry.from_spec(full(2), RankContext(2, 8, 0))
    with pytest.raises(ValueError, match="does not match format_id"):
        StoreNamespace("v1-hnd", MODEL, "none", (layer,))
    with pytest.raises(ValueError, match="format_id"):
        StoreNamespace("v2-nhd", MODEL, "none", (layer,))


def test_model_extra_is_canonical() -> None:
    a = ModelIdentity("m", "", {"b": [1, 2.5], "a": {"theta": 10000.0, "z": None}})
    b = ModelIdentity("m", "", {"a": {"z": None, "theta": 10000}, "b": (1, np.float64(2.5))})
    assert a == b and a.describe() == b.describe()
    assert ns_full(2, model=a).digest == ns_full(2, model=b).digest
    # booleans are not numbers, and a float is not rounded
    c = ModelIdentity("m", "", {"b": [True, 2.5], "a": {"theta": 10000, "z": None}})
    d = ModelIdentity("m", "", {"b": [1, 2.5000000000000004], "a": {"theta": 10000, "z": None}})
    assert len({ns_full(2, model=m).digest for m in (a, c, d)}) == 3
    # later changes to the caller's dict do not reach the identity
    extra = {"k": [1]}
    e = ModelIdentity("m", "", extra)
    extra["k"].append(2)
    assert dict(e.extra) == {"k": [1]}
    with pytest.raises(TypeError):
        e.extra["k"] = 3  # read-only


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"x": float("nan")}, ValueError),
        ({"x": float("inf")}, ValueError),
        ({"x": {1, 2}}, TypeError),
        ({1: "int key"}, TypeError),
        ([("a", 1)], TypeError),
    ],
)
def test_model_extra_must_be_json(extra, error) -> None:
    with pytest.raises(error, match="extra"):
        ModelIdentity("m", "", extra)


def test_model_identity_arguments() -> None:
    with pytest.raises(TypeError, match="name: expected a non-empty str"):
        ModelIdentity("")
    with pytest.raises(TypeError, match="revision"):
        ModelIdentity("m", None)
    with pytest.raises(TypeError, match="kv_quant"):
        StoreNamespace(
            "v1-nhd", MODEL, "", (LayerGeometry.from_spec(full(1), RankContext(1, 8, 0)),)
        )


def test_opaque_layer_puts_the_topology_in_the_digest() -> None:
    # Per-token-head scales are never certified: the layer is stored opaque.
    def ns(tp, **kw):
        spec = full(tp, per_token_head_scales=True, **kw)
        return StoreNamespace.from_specs(MODEL, [full(tp), spec], RankContext(tp, 8, 0, **kw))

    assert ns(2).layers[1].opaque and not ns(2).layers[0].opaque
    assert ns(2).layers[1].topology == (2, 1, 1, 1)
    assert ns(2).describe()["layers"][1]["topology"] == {
        "tp": 2,
        "dcp": 1,
        "pcp": 1,
        "interleave": 1,
    }
    assert "topology" not in ns(2).describe()["layers"][0]
    assert ns(2).digest != ns(4).digest
    assert ns(2).topology_bound and not ns_full(2).topology_bound
    # the opaque page is the group's local pages side by side, as the fallback mapping stores it
    spec = full(2, per_token_head_scales=True)
    mapping = derive_group_mappings(spec, 2, 8)[0]
    assert ns(2).layers[1].canonical_page_size_bytes == mapping.canonical_page_size_bytes
    # an interleave change matters for opaque CP pages (local token order)
    cp = dict(dcp_size=2)
    spec_cp = LayerSpec("full", 8, 4, 128, "bfloat16", "packed", "NHD", per_token_head_scales=True)

    def ns_cp(interleave):
        return StoreNamespace.from_specs(
            MODEL, [spec_cp], RankContext(2, 8, 0, interleave=interleave, **cp)
        )

    assert ns_cp(1).digest != ns_cp(2).digest


def test_opaque_from_bytes() -> None:
    ctx = RankContext(4, 8, 0, pcp_size=2)
    layer = LayerGeometry.opaque_from_bytes(1000, ctx, block_size=16)
    assert layer.opaque and layer.canonical_page_size_bytes == 8 * 1000
    assert layer.tokens_per_page == 32 and layer.topology == (4, 1, 2, 1)
    ns = StoreNamespace.from_specs(
        MODEL,
        [None, full(4)],
        RankContext(4, 8, 0),
        fallback_page_sizes=[300, 0],
        fallback_layouts=["uint8 block [300] strides [300, 1]", None],
        block_size=16,
    )
    assert ns.layers[0].attention == "unknown" and ns.layer_bytes(0, 1) == 4 * 300
    with pytest.raises(ValueError, match="fallback_page_sizes"):
        StoreNamespace.from_specs(MODEL, [None], RankContext(4, 8, 0))


def test_pages_of_unknown_layout_laid_out_differently_never_share_a_namespace() -> None:
    """Two engines at one topology whose unrecognised pages have the same size but another
    physical layout (dtype, shape, strides) must not read each other's units: fail closed."""

    def ns(physical, size=256):
        return StoreNamespace.from_specs(
            MODEL,
            [full(2), None],
            RankContext(2, 8, 0),
            fallback_page_sizes=[0, size],
            fallback_layouts=[None, physical],
            block_size=16,
        )

    nhd, hnd = (
        "bfloat16 block [16, 4, 2] strides [128, 8, 2, 1]",
        "bfloat16 block [4, 16, 2] strides [128, 32, 2, 1]",
    )
    assert ns(nhd).digest == ns(nhd).digest
    assert ns(nhd).digest != ns(hnd).digest
    assert ns(nhd).layers[1].physical == nhd and ns(nhd).layers[0].physical is None
    assert StoreNamespace.from_description(ns(hnd).describe()).digest == ns(hnd).digest
    with pytest.raises(ValueError, match=r"fallback_layouts\[1\]"):  # a None spec names its layout
        StoreNamespace.from_specs(
            MODEL,
            [full(2), None],
            RankContext(2, 8, 0),
            fallback_page_sizes=[0, 256],
            block_size=16,
        )
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match=r"fallback_layouts\[1\]: expected"):
            ns(bad)
    with pytest.raises(ValueError, match="fallback_layouts: expected one entry per layer"):
        StoreNamespace.from_specs(
            MODEL, [full(2), None], RankContext(2, 8, 0), fallback_page_sizes=[0, 256],
            fallback_layouts=[nhd], block_size=16,
        )  # fmt: skip
    with pytest.raises(ValueError, match="physical: expected None for a certified layer"):
        LayerGeometry.from_description({**ns(nhd).layers[0].describe(), "physical": nhd})
    # a certified layer's description has no "physical": its digest is what it always was
    assert not ns(nhd).layers[0].opaque and "physical" not in ns(nhd).describe()["layers"][0]


def test_description_round_trip_and_strictness() -> None:
    spec_opaque = full(2, per_token_head_scales=True, tokens_per_state=Fraction(1, 1))
    ns = StoreNamespace.from_specs(
        MODEL, [full(2), spec_opaque], RankContext(2, 8, 0), kv_quant="fp8"
    )
    text = json.dumps(ns.describe())
    again = StoreNamespace.from_description(json.loads(text))
    assert again == ns and again.digest == ns.digest
    forged = json.loads(text)
    forged["layers"][0]["canonical_page_size_bytes"] += 2
    with pytest.raises(ValueError, match="canonical_page_size_bytes"):
        StoreNamespace.from_description(forged)
    for mutate in (
        lambda d: d.pop("kv_quant"),
        lambda d: d.update(extra=1),
        lambda d: d.update(num_layers=3),
        lambda d: d.update(schema="other"),
        lambda d: d["layers"][1].pop("topology"),
        lambda d: d["layers"][0].update(topology={"tp": 2, "dcp": 1, "pcp": 1, "interleave": 1}),
        lambda d: d["layers"][0].update(opaque="yes"),
    ):
        bad = json.loads(text)
        mutate(bad)
        with pytest.raises(ValueError):
            StoreNamespace.from_description(bad)


def test_certified_geometry_is_checked() -> None:
    good = LayerGeometry.from_spec(full(2), RankContext(2, 8, 0))
    assert good.canonical_page_size_bytes == 8 * 16 * 2 * 128 * 2
    args = good.describe()
    args["canonical_page_size_bytes"] = 1
    with pytest.raises(ValueError, match="expected 65536"):
        LayerGeometry(**args)
    args = good.describe() | {"per_token_head_scales": True}
    with pytest.raises(ValueError, match="never certified"):
        LayerGeometry(**args)
    with pytest.raises(ValueError, match="topology"):
        LayerGeometry(**(good.describe() | {"topology": (2, 1, 1, 1)}))


def test_unit_geometry() -> None:
    spec = LayerSpec("full", 16, 1, 64, "bfloat16", "packed", "NHD")
    mla = LayerSpec("mla", 16, 1, 576, "bfloat16", "packed", "NHD")
    ns = StoreNamespace.from_specs(MODEL, [spec, mla, spec], RankContext(8, 8, 0))
    page, latent = 8 * 16 * 2 * 64 * 2, 16 * 576 * 2
    assert [g.canonical_page_size_bytes for g in ns.layers] == [page, latent, page]
    assert ns.total_bytes == 2 * page + latent
    assert ns.layer_bytes(1, 3) == latent + page
    assert ns.payload_offsets(0, 3) == (0, page, page + latent, 2 * page + latent)
    assert ns.payload_offsets(1, 2) == (0, latent)
    assert ns.layer_span(1, 3) == (page, 2 * page + latent)
    assert ns.unit_ends(0, page + latent) == [2]
    assert ns.unit_ends(0, 7) == []
    with pytest.raises(ValueError, match="end: expected an int in"):
        ns.layer_bytes(1, 1)
    with pytest.raises(ValueError, match="first: expected an int in"):
        ns.layer_bytes(-1, 2)
    with pytest.raises(TypeError, match="first"):
        ns.layer_bytes(0.0, 2)
    with pytest.raises(TypeError, match="end"):
        ns.layer_bytes(0, True)
    assert ns.layer_bytes(np.int64(0), np.int32(3)) == ns.total_bytes
    # zero-byte (empty opaque) layers make the end of a payload ambiguous
    ns0 = StoreNamespace.from_specs(
        MODEL,
        [spec, None],
        RankContext(8, 8, 0),
        fallback_page_sizes=[0, 0],
        fallback_layouts=[None, "uint8 block [0] strides [1, 1]"],
        block_size=16,
    )
    assert ns0.unit_ends(0, page) == [1, 2]


def test_namespace_is_hashable_and_frozen() -> None:
    ns = ns_full(2)
    assert {ns: 1}[ns_full(4)] == 1
    with pytest.raises(AttributeError):
        ns.kv_quant = "x"
