"""layouts.tokens: a canonical page of k*B tokens is k pages of B tokens, in every layout,
checked against pages built from first principles (helpers.layout_truth)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.layout_truth import canonical_page, random_truth

from layouts import LayerSpec
from layouts.tokens import join_units, split_unit, token_runs

LAYOUTS = [("full", p, o) for p in ("packed", "split") for o in ("NHD", "HND")] + [
    ("mla", "packed", "NHD")
]


def _spec(attention, packing, order, tokens, heads=4, head_size=8):
    heads = 1 if attention == "mla" else heads
    return LayerSpec(attention, tokens, heads, head_size, "bfloat16", packing, order)


def _tokens(truth: np.ndarray, attention: str, start: int, stop: int) -> np.ndarray:
    return truth[start:stop] if attention == "mla" else truth[:, :, start:stop]


@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_split_and_join_match_pages_built_from_the_truth(layout, parts):
    attention, packing, order = layout
    rng = np.random.default_rng([parts, len(packing), len(order)])
    small_tokens, layers = 4, 3
    big = [_spec(*layout, small_tokens * parts, heads=4 + 2 * i) for i in range(layers)]
    small = [_spec(*layout, small_tokens, heads=4 + 2 * i) for i in range(layers)]
    truths = [
        random_truth(rng, attention, s.num_kv_heads, s.block_size, 2 * s.head_size) for s in big
    ]
    big_unit = np.concatenate([canonical_page(t, s) for t, s in zip(truths, big)])
    small_units = [
        np.concatenate(
            [
                canonical_page(_tokens(t, attention, p * small_tokens, (p + 1) * small_tokens), s)
                for t, s in zip(truths, small)
            ]
        )
        for p in range(parts)
    ]
    assert np.array_equal(join_units(small_units, small), big_unit)
    assert all(np.array_equal(a, b) for a, b in zip(split_unit(big_unit, big, parts), small_units))
    # Token-major pages (packed NHD, MLA) are one run: they simply concatenate.
    outer = {("packed", "NHD"): 1, ("split", "NHD"): 2, ("packed", "HND"): 4, ("split", "HND"): 8}
    assert token_runs(big[0])[0] == (1 if attention == "mla" else outer[packing, order])


def test_bad_arguments_are_refused():
    spec = _spec("full", "split", "NHD", 8)
    unit = np.zeros(spec.page_size_bytes, np.uint8)
    with pytest.raises(ValueError, match="parts: expected a divisor"):
        split_unit(unit, [spec], 3)
    with pytest.raises(ValueError, match="unit: expected 1024 bytes"):
        split_unit(unit[:-1], [spec], 2)
    with pytest.raises(ValueError, match="units: expected at least one"):
        join_units([], [spec])
    with pytest.raises(ValueError, match="per token"):
        token_runs(
            LayerSpec("full", 8, 4, 8, "bfloat16", "split", "NHD", per_token_head_scales=True)
        )
    with pytest.raises(TypeError, match="LayerSpec"):
        token_runs("split")
