"""layouts.state: canonical units of Mamba / GDN state, checked against first principles.

The reference here shards an unsharded state the way vLLM's weight loaders do
(per conv segment a contiguous 1/tp of its units, Mamba2's single group
replicated on every rank, SSM heads split) with plain numpy slicing, never
through the mappings; the mappings must then move exactly those bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from layouts import TilingError
from layouts.mapping import CanonicalPageMapping, CopyRun
from layouts.state import (
    StateLayerMappings,
    StateSegmentMapping,
    StateSpec,
    derive_state_group_mappings,
    derive_state_mappings,
    opaque_state_mappings,
    state_certification_failure,
    verify_state_tiling,
)

DTYPES = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}


STATE_DTYPES = dict(conv_dtype="bfloat16", ssm_dtype="float32")


def make_specs(layout: str) -> dict[str, StateSpec]:
    common = dict(conv_kernel=4, conv_layout=layout)
    spec1 = dict(num_spec=1, **common)
    return {
        "mamba2-1group": StateSpec.mamba2(
            num_heads=8, head_dim=4, n_groups=1, state_size=6, **STATE_DTYPES, **common
        ),
        "mamba2-8groups": StateSpec.mamba2(
            num_heads=16, head_dim=2, n_groups=8, state_size=4, conv_dtype="float16", **spec1
        ),
        "gdn": StateSpec.gdn(
            num_k_heads=8, num_v_heads=16, head_k_dim=4, head_v_dim=6, **STATE_DTYPES, **common
        ),
        "mamba1": StateSpec.mamba1(
            intermediate_size=16, state_size=5, conv_dtype="float32", **common
        ),
    }


def truth(spec: StateSpec, seed: int) -> dict[str, np.ndarray]:
    """The unsharded state of one slot: conv segments and SSM, as (outer, channels, inner)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, dtype, shape, _ in spec.canonical_layout():
        out[name] = rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(DTYPES[dtype])
    return out


def rank_slot(spec: StateSpec, full: dict[str, np.ndarray], tp: int, rank: int) -> list[bytes]:
    """Rank ``rank``'s conv and SSM slot bytes at ``tp``, sliced as vLLM's loaders shard."""
    tensors: list[list[np.ndarray]] = [[], []]
    for seg in spec.segments:
        data = full[seg.name]
        if seg.units % tp == 0:
            per = seg.channels // tp
            part = data[:, rank * per : (rank + 1) * per, :]
        else:
            assert seg.units == 1 and seg.replicable  # the one group, on every rank
            part = data
        tensors[seg.tensor].append(part)
    out = []
    for parts in tensors:
        joined = np.concatenate(parts, axis=1)  # channels of the segments side by side
        out.append(np.ascontiguousarray(joined).tobytes())
    return out


def canonical_truth(spec: StateSpec, full: dict[str, np.ndarray]) -> bytes:
    return b"".join(np.ascontiguousarray(full[seg.name]).tobytes() for seg in spec.segments)


def store(group, slots, page_id: int, size: int) -> tuple[bytearray, np.ndarray]:
    """Every elected writer's bytes into one canonical slot; counts of writes per byte."""
    unit = bytearray(size)
    writes = np.zeros(size, dtype=np.int64)
    for layer, local in zip(group, slots):
        for seg, area in zip(layer.segments, layer.area_offsets):
            if not seg.mapping.is_writer(page_id):
                continue
            for lo, co, n in seg.mapping.fragments():
                unit[area + co : area + co + n] = local[seg.tensor][lo : lo + n]
                writes[area + co : area + co + n] += 1
    return unit, writes


def load(layer: StateLayerMappings, unit: bytes) -> list[bytes]:
    out = [bytearray(n) for n in layer.tensor_bytes]
    for seg, area in zip(layer.segments, layer.area_offsets):
        for lo, co, n in seg.mapping.fragments():
            out[seg.tensor][lo : lo + n] = unit[area + co : area + co + n]
    return [bytes(b) for b in out]


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("kind", ["mamba2-1group", "mamba2-8groups", "gdn", "mamba1"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_writers_cover_once_and_readers_get_their_shard(kind, layout, tp):
    spec = make_specs(layout)[kind]
    full = truth(spec, seed=tp)
    group = derive_state_group_mappings(spec, tp)
    assert len(group) == tp
    slots = [rank_slot(spec, full, tp, r) for r in range(tp)]
    for rank, layer in enumerate(group):
        assert layer.fallback_reason is None
        assert list(layer.tensor_bytes) == [len(b) for b in slots[rank]]
        assert layer.canonical_bytes == spec.canonical_bytes
    expected = canonical_truth(spec, full)
    assert len(expected) == spec.canonical_bytes
    for page_id in range(max(tp, 2)):  # every writer rotation of replicated groups
        unit, writes = store(group, slots, page_id, spec.canonical_bytes)
        assert writes.min() == 1 and writes.max() == 1, "every canonical byte exactly once"
        assert bytes(unit) == expected
    # Read back at every other TP: each rank gets exactly its own shard.
    for reader_tp in (1, 2, 4, 8):
        readers = derive_state_group_mappings(spec, reader_tp)
        for rank, layer in enumerate(readers):
            assert load(layer, expected) == rank_slot(spec, full, reader_tp, rank)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_local_shapes_follow_vllm_sizes(tp):
    """Sizes from vLLM's formulas (conv_dim with extended groups over tp; heads over tp)."""
    spec = make_specs("SD")["mamba2-1group"]
    heads, head_dim, groups, ss = 8, 4, 1, 6
    extended = groups if groups % tp == 0 else tp  # groups extended to follow head shards
    conv_dim = heads * head_dim + 2 * extended * ss
    assert spec.local_shapes(tp) == ((3, conv_dim // tp), (heads // tp, head_dim, ss))
    gdn = make_specs("DS")["gdn"]
    conv = (8 * 4 * 2 + 16 * 6) // tp
    assert gdn.local_shapes(tp) == ((conv, 3), (16 // tp, 6, 4))


def test_replicated_group_writers_take_turns():
    spec = make_specs("SD")["mamba2-1group"]
    group = derive_state_group_mappings(spec, 4)
    b = [layer.segments[1] for layer in group]
    assert [s.name for s in b] == ["conv.B"] * 4
    assert [s.mapping.num_writers for s in b] == [4] * 4
    assert [[s.mapping.is_writer(p) for s in b] for p in range(4)] == np.eye(4, dtype=bool).tolist()
    x = [layer.segments[0].mapping for layer in group]
    assert all(m.num_writers == 1 and m.is_writer(3) for m in x)


_BF16 = dict(conv_kernel=4, conv_dtype="bfloat16")


@pytest.mark.parametrize(
    ("spec", "tp", "words"),
    [
        (
            StateSpec.mamba2(num_heads=8, head_dim=4, n_groups=2, state_size=6, **_BF16),
            4,
            ["n_groups=2", "tp_size=4", "n_groups == 1"],
        ),
        (
            StateSpec.mamba2(num_heads=6, head_dim=4, n_groups=1, state_size=6, **_BF16),
            4,
            ["conv.x", "tp_size=4", "6 units"],
        ),
        (
            StateSpec.gdn(num_k_heads=2, num_v_heads=8, head_k_dim=4, head_v_dim=4, **_BF16),
            4,
            ["gdn conv.q", "tp_size=4", "2 units"],
        ),
    ],
)
def test_refused_topologies_say_why(spec, tp, words):
    reason = state_certification_failure(spec, tp)
    assert reason is not None and all(w in reason for w in words), reason
    assert spec.local_shapes(tp) is None
    assert derive_state_mappings(spec, tp, 0) is None
    with pytest.raises(ValueError, match="cannot be resharded") as info:
        derive_state_group_mappings(spec, tp, layer_name="layers.3")
    assert words[0] in str(info.value) and "layers.3" in str(info.value)
    group = derive_state_group_mappings(spec, tp, tensor_bytes=(100, 64))
    assert all(layer.fallback_reason == reason for layer in group)
    for rank, layer in enumerate(group):
        assert [s.name for s in layer.segments] == ["conv.opaque", "ssm.opaque"]
        assert [s.mapping.parallelism_agnostic for s in layer.segments] == [False, False]
        assert layer.canonical_bytes == tp * 164
        assert [s.mapping.runs[0].canonical_offset for s in layer.segments] == [
            rank * 100,
            rank * 64,
        ]


def test_context_parallelism_is_refused():
    spec = make_specs("SD")["gdn"]
    assert "context parallelism" in state_certification_failure(spec, 2, dcp_size=2)
    assert "context parallelism" in state_certification_failure(spec, 2, pcp_size=2)
    group = derive_state_group_mappings(spec, 2, pcp_size=2, tensor_bytes=(8, 8))
    assert len(group) == 4 and group[3].segments[0].mapping.runs[0].canonical_offset == 24


def test_spec_is_checked():
    with pytest.raises(ValueError, match="kind"):
        StateSpec("mamba3", (), "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="dims: expected exactly"):
        StateSpec("gdn", (("num_k_heads", 2),), "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        StateSpec.mamba1(intermediate_size=8, state_size=4, conv_kernel=4, conv_dtype="int4")
    with pytest.raises(ValueError, match="conv_layout"):
        StateSpec.mamba1(
            intermediate_size=8, state_size=4, conv_kernel=4, conv_dtype="bf16", conv_layout="SDS"
        )
    with pytest.raises(ValueError, match="n_groups: expected a divisor"):
        StateSpec.mamba2(
            num_heads=6, head_dim=2, n_groups=4, state_size=4, conv_kernel=4, conv_dtype="bf16"
        )
    with pytest.raises(ValueError, match="head_dim: expected an int >= 1"):
        StateSpec.mamba2(
            num_heads=6, head_dim=0, n_groups=1, state_size=4, conv_kernel=4, conv_dtype="bf16"
        )
    heads = dict(head_k_dim=2, head_v_dim=2, conv_dtype="bf16")
    with pytest.raises(ValueError, match="conv_kernel"):
        StateSpec.gdn(num_k_heads=2, num_v_heads=2, conv_kernel=1, **heads)
    with pytest.raises(ValueError, match="num_k_heads: expected a divisor"):
        StateSpec.gdn(num_k_heads=3, num_v_heads=4, conv_kernel=4, **heads)
    with pytest.raises(ValueError, match="tp_size"):
        state_certification_failure(make_specs("SD")["gdn"], 0)
    with pytest.raises(ValueError, match="rank"):
        derive_state_mappings(make_specs("SD")["gdn"], 2, 2)
    with pytest.raises(TypeError, match="spec"):
        derive_state_group_mappings("gdn", 2)
    spec = make_specs("SD")["gdn"]
    assert spec == StateSpec.gdn(
        num_k_heads=8,
        num_v_heads=16,
        head_k_dim=4,
        head_v_dim=6,
        conv_kernel=4,
        **STATE_DTYPES,
    )
    assert hash(spec) == hash(make_specs("SD")["gdn"])


def test_planted_defects_are_caught():
    spec = make_specs("SD")["mamba2-1group"]
    group = list(derive_state_group_mappings(spec, 2))
    # Rank 1's conv.x shifted one byte: a gap in its slot and an overlap canonically.
    seg = group[1].segments[0]
    run = seg.mapping.runs[0]
    shifted = CanonicalPageMapping(
        seg.mapping.canonical_page_size_bytes,
        seg.mapping.local_page_size_bytes,
        (
            CopyRun(
                run.local_offset + 1,
                run.canonical_offset,
                run.fragment_size - 1,
                run.num_fragments,
                run.local_stride,
                run.canonical_stride,
            ),
        ),
        1,
        0,
        True,
    )
    group[1] = StateLayerMappings(
        (StateSegmentMapping(0, "conv.x", shifted), *group[1].segments[1:]),
        group[1].tensor_bytes,
    )
    with pytest.raises(TilingError, match="rank 1's segments leave a gap in its conv slot"):
        verify_state_tiling(group, "layers.1")
    # Both ranks electing themselves for the replicated group: an overlap.
    good = derive_state_group_mappings(spec, 2)
    b0 = good[0].segments[1].mapping
    twice = [
        StateLayerMappings(
            (
                layer.segments[0],
                StateSegmentMapping(0, "conv.B", b0),
                *layer.segments[2:],
            ),
            layer.tensor_bytes,
        )
        for layer in good
    ]
    with pytest.raises(TilingError, match=r"conv\.B: writers \[0, 1\] .* an overlap"):
        verify_state_tiling(twice)


def test_opaque_mappings_are_checked():
    layer = opaque_state_mappings((10, 0), 3, 2, reason="why")
    assert layer.canonical_bytes == 30 and layer.segments[1].mapping.runs == ()
    with pytest.raises(ValueError, match="rank"):
        opaque_state_mappings((10,), 2, 2, reason="why")
    with pytest.raises(ValueError, match="tensor_bytes"):
        opaque_state_mappings((), 2, 0, reason="why")
