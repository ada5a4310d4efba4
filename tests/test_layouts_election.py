"""layouts.WriterElection / RankShare: the one answer to "who writes page p, and how many bytes
does a rank move", checked against the rule itself (``mapping.is_writer(p)``) page by page."""

from __future__ import annotations

import numpy as np
import pytest

from layouts import (
    CanonicalPageMapping,
    CopyRun,
    LayerSpec,
    RankShare,
    WriterElection,
    derive_group_mappings,
    group_layer_mappings,
)
from layouts.spec import RankContext


def layers(tp: int, dcp: int = 1) -> list[tuple[CanonicalPageMapping, ...]]:
    """Replicated GQA (2 heads), MLA and a head-sharded layer over one TP group."""
    gqa = LayerSpec("full", 16, 1, 64, "bfloat16", "split", "HND")
    mla = LayerSpec("mla", 16, 1, 576, "bfloat16", "packed", "NHD")
    sharded = LayerSpec("full", 16, 16 // tp, 64, "bfloat16", "packed", "NHD")
    return [
        derive_group_mappings(gqa, tp, 2, dcp),
        derive_group_mappings(mla, tp, 1, dcp),
        derive_group_mappings(sharded, tp, 16),
    ]


@pytest.mark.parametrize(("tp", "dcp"), [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (4, 4)])
def test_election_is_the_rotation_rule(tp: int, dcp: int) -> None:
    groups = layers(tp, dcp)
    election = WriterElection(groups)
    assert election.num_ranks == tp
    rng = np.random.default_rng(tp * 10 + dcp)
    pages = rng.integers(0, 1 << 40, size=64)
    for page in [*range(3 * election.period), *pages.tolist()]:
        want = {r for group in groups for r, m in enumerate(group) if m.is_writer(page)}
        assert election.writers(page) == want
    for rank in range(tp):
        share = election.share(rank)
        mine = [group[rank] for group in groups]
        want = sum(m.local_page_size_bytes for p in pages for m in mine if m.is_writer(int(p)))
        assert share.store_bytes(pages) == want == RankShare(mine).store_bytes(pages.tolist())
        assert share.load_bytes(5) == 5 * sum(m.local_page_size_bytes for m in mine)
        assert share.writes(int(pages[0])) == any(m.is_writer(int(pages[0])) for m in mine)
    # every page of every layer has a writer; the MLA latent is written by one rank per DCP group
    mla_writers = {r for r, m in enumerate(groups[1]) if m.is_writer(5)}
    assert len(mla_writers) == dcp


def test_a_rank_writes_its_turn_of_replicated_heads() -> None:
    share = WriterElection(layers(4)[:1]).share(1)  # 2 heads over TP 4: ranks 0 and 1 share one
    page = layers(4)[0][1].local_page_size_bytes
    assert share.period == 2
    assert share.store_bytes([0, 1, 2, 3, 5]) == 3 * page  # odd pages only
    assert share.store_bytes(np.array([], dtype=np.int64)) == 0


def test_opaque_layers_elect_every_rank() -> None:
    ctx = RankContext(4, 6, 0)  # 6 heads over TP 4: uncertified, every rank writes its page
    spec = LayerSpec("full", 16, 1, 64, "bfloat16", "packed", "NHD")
    (group,) = group_layer_mappings([spec], ctx)
    assert group[0].fallback_reason is not None
    assert WriterElection([group]).writers(7) == frozenset(range(4))


def hand_built(writers: int, index: int) -> CanonicalPageMapping:
    run = CopyRun(0, 0, 64, 1, 64, 64)
    return CanonicalPageMapping(64, 64, (run,), writers, index, True)


@pytest.mark.parametrize(
    ("groups", "error", "match"),
    [
        ([], ValueError, r"layer_group_mappings: expected at least one layer"),
        ([()], ValueError, r"layer_group_mappings\[0\]: expected at least one rank"),
        (
            [(hand_built(1, 0),), (hand_built(1, 0), hand_built(1, 0))],
            ValueError,
            r"layer_group_mappings\[1\]: expected 1 ranks \(as layer 0\), got 2",
        ),
        (
            [(hand_built(2, 0), hand_built(2, 0))],
            ValueError,
            r"layer_group_mappings\[0\]: no rank is the elected writer of pages 1 mod 2",
        ),
        (
            [(hand_built(0, 0),)],
            ValueError,
            r"layer_group_mappings\[0\]\[0\]: expected num_writers",
        ),
        ([("mapping",)], TypeError, r"layer_group_mappings\[0\]\[0\]: expected a CanonicalPage"),
        ([hand_built(1, 0)], TypeError, r"layer_group_mappings\[0\]: expected a sequence"),
    ],
)
def test_bad_groups_are_refused(groups, error, match) -> None:
    with pytest.raises(error, match=match):
        WriterElection(groups)


def test_share_of_a_rank_outside_the_group() -> None:
    election = WriterElection(layers(2))
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 1\], got 2"):
        election.share(2)
    with pytest.raises(TypeError, match="rank: expected an int"):
        election.share(True)
