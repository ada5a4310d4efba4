"""Hand-computed canonical placements for every layouts family (format v1).

Sizes used throughout: head_size 128, bfloat16 (2 bytes), block_size 16, so a
(token, head) cell is 512 B packed (K and V) and 256 B split (K or V); an MLA
latent row is 576 * 2 = 1152 B.
"""

import pytest

from layouts import (
    CanonicalPageMapping,
    CopyRun,
    LayerSpec,
    RankContext,
    derive_group_mappings,
    derive_layer_mapping,
)


def spec(packing: str, order: str, heads: int, attention: str = "full", head_size: int = 128):
    return LayerSpec(attention, 16, heads, head_size, "bfloat16", packing, order)


def run(local: int, canonical: int, size: int, count: int = 1, local_stride=None, stride=None):
    return CopyRun(
        local, canonical, size, count, local_stride or size, stride if stride is not None else size
    )


@pytest.mark.parametrize(("tp", "row"), [(1, 4096), (2, 2048), (4, 1024), (8, 512)])
def test_packed_nhd_tp(tp: int, row: int) -> None:
    # A token's row holds all 8 heads (4096 B); rank r owns the r-th slice of each row.
    mappings = derive_group_mappings(spec("packed", "NHD", 8 // tp), tp, 8)
    assert len(mappings) == tp
    for r, m in enumerate(mappings):
        assert m.canonical_page_size_bytes == 65536
        assert m.local_page_size_bytes == 65536 // tp
        assert (m.num_writers, m.writer_index, m.parallelism_agnostic) == (1, 0, True)
        if tp == 1:  # single rank: one whole-page run
            assert m.runs == (run(0, 0, 65536),)
        else:
            assert m.runs == (run(0, r * row, row, 16, row, 4096),)
        assert m.is_writer(0) and m.is_writer(7)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_packed_hnd_tp(tp: int) -> None:
    # Head-major: each head is 16 tokens * 512 B = 8 KiB, a rank's heads are contiguous.
    heads = 8 // tp
    for r, m in enumerate(derive_group_mappings(spec("packed", "HND", heads), tp, 8)):
        size = heads * 8192
        assert m.runs == (run(0, r * size, size),)
        assert m.canonical_page_size_bytes == 65536


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_split_nhd_tp(tp: int) -> None:
    # K half then V half; a canonical half is 16 tokens * 8 heads * 256 B = 32 KiB.
    heads = 8 // tp
    row = heads * 256
    for r, m in enumerate(derive_group_mappings(spec("split", "NHD", heads), tp, 8)):
        if tp == 1:
            assert m.runs == (run(0, 0, 65536),)
        else:
            assert m.runs == (
                run(0, r * row, row, 16, row, 2048),
                run(16 * row, 32768 + r * row, row, 16, row, 2048),
            )


def test_split_hnd_tp2() -> None:
    # (half, head) blocks of 16 * 256 = 4 KiB; rank r holds heads 4r..4r+3 of each half.
    m0, m1 = derive_group_mappings(spec("split", "HND", 4), 2, 8)
    assert m0.runs == (run(0, 0, 16384), run(16384, 32768, 16384))
    assert m1.runs == (run(0, 16384, 16384), run(16384, 49152, 16384))


def test_split_hnd_tp8() -> None:
    for r, m in enumerate(derive_group_mappings(spec("split", "HND", 1), 8, 8)):
        assert m.runs == (run(0, r * 4096, 4096), run(4096, (8 + r) * 4096, 4096))


def test_replicated_gqa_tp4_of_2_heads() -> None:
    # 2 KV heads at TP 4: ranks 0,1 hold head 0 and ranks 2,3 head 1; they take turns writing.
    mappings = derive_group_mappings(spec("packed", "NHD", 1), 4, 2)
    for r, m in enumerate(mappings):
        assert m.runs == (run(0, (r // 2) * 512, 512, 16, 512, 1024),)
        assert (m.num_writers, m.writer_index) == (2, r % 2)
        assert m.canonical_page_size_bytes == 16384 and m.local_page_size_bytes == 8192
    assert [m.is_writer(0) for m in mappings] == [True, False, True, False]
    assert [m.is_writer(5) for m in mappings] == [False, True, False, True]


def test_replicated_gqa_tp8_of_1_head_split_hnd() -> None:
    for r, m in enumerate(derive_group_mappings(spec("split", "HND", 1), 8, 1)):
        assert m.runs == (run(0, 0, 8192),)
        assert (m.num_writers, m.writer_index, m.canonical_page_size_bytes) == (8, r, 8192)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_mla_tp_replicated_latent(tp: int) -> None:
    mla = spec("packed", "NHD", 1, attention="mla", head_size=576)
    mappings = derive_group_mappings(mla, tp, 1)
    for r, m in enumerate(mappings):
        assert m.runs == (run(0, 0, 18432),)
        assert (m.num_writers, m.writer_index) == (tp, r)
        assert m.canonical_page_size_bytes == m.local_page_size_bytes == 18432
    for page in range(2 * tp):  # exactly one writer per page, rotating
        assert [r for r, m in enumerate(mappings) if m.is_writer(page)] == [page % tp]


def test_mla_dcp2_tp4_token_interleave() -> None:
    # DCP 2: rank r holds canonical tokens 2t + r % 2; ranks {0,1} and {2,3} alternate pages.
    mla = spec("packed", "NHD", 1, attention="mla", head_size=576)
    mappings = derive_group_mappings(mla, 4, 1, dcp_size=2)
    for r, m in enumerate(mappings):
        assert m.runs == tuple(run(t * 1152, (2 * t + r % 2) * 1152, 1152) for t in range(16))
        assert (m.num_writers, m.writer_index) == (2, r // 2)
        assert m.canonical_page_size_bytes == 36864
        assert not m.parallelism_agnostic


def test_mla_dcp2_interleave4() -> None:
    mla = spec("packed", "NHD", 1, attention="mla", head_size=576)
    ctx = RankContext(tp_size=4, total_kv_heads=1, rank=3, dcp_size=2, interleave=4)
    m = derive_layer_mapping(mla, ctx)
    # Chunks of 4 tokens (4608 B); rank 3 is DCP rank 1, so its chunk c is canonical chunk 2c+1.
    assert m.runs == tuple(run(c * 4608, (2 * c + 1) * 4608, 4608) for c in range(4))


def test_attention_dcp_inside_replication() -> None:
    # 2 heads, TP 4, DCP 2: replication 2 is exactly the DCP group -> one writer per page.
    mappings = derive_group_mappings(spec("packed", "NHD", 1), 4, 2, dcp_size=2)
    for r, m in enumerate(mappings):
        shard, cp_rank = r // 2, r % 2
        assert m.runs == tuple(
            # one-token runs keep the canonical token stride (1024 B), as vLLM's do
            run(t * 512, (2 * t + cp_rank) * 1024 + shard * 512, 512, 1, 512, 1024)
            for t in range(16)
        )
        assert (m.num_writers, m.writer_index) == (1, 0)
        assert m.canonical_page_size_bytes == 32768


def test_pcp2_tp2_split_nhd() -> None:
    # rank = pcp_rank * 2 + tp_rank; 32 canonical tokens per page, pcp_rank owns 2t + pcp_rank.
    mappings = derive_group_mappings(spec("split", "NHD", 4), 2, 8, pcp_size=2)
    assert len(mappings) == 4
    for rank, m in enumerate(mappings):
        pcp_rank, tp_rank = divmod(rank, 2)
        expected = [
            run(
                half * 16384 + t * 1024,
                half * 65536 + (2 * t + pcp_rank) * 2048 + tp_rank * 1024,
                1024,
                1,
                1024,
                2048,
            )
            for half in range(2)
            for t in range(16)
        ]
        assert m.runs == tuple(expected)
        assert m.canonical_page_size_bytes == 131072 and m.local_page_size_bytes == 32768


def test_fragments_coalesced_and_sorted() -> None:
    (m,) = derive_group_mappings(spec("packed", "HND", 8), 1, 8)
    assert m.fragments().tolist() == [[0, 0, 65536]]
    m = derive_group_mappings(spec("split", "NHD", 2), 4, 8)[1]
    frags = m.fragments()
    assert frags.dtype.name == "int64" and frags.shape == (32, 3)
    assert frags[:3].tolist() == [[0, 512, 512], [512, 2560, 512], [1024, 4608, 512]]
    assert (frags[:, 2].sum()) == m.local_page_size_bytes
    assert not frags.flags.writeable


def test_is_writer_rotation_and_types() -> None:
    m = CanonicalPageMapping(10, 10, (run(0, 0, 10),), 3, 2, True)
    assert [m.is_writer(p) for p in range(6)] == [False, False, True, False, False, True]
