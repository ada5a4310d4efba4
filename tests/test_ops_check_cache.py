"""The CPU op's checks made cheap (#18) stay checks: a plan is verified once per identity and
contents (an edit in place is seen, whatever the tensor's version counter says), and repeated
destinations are found on both paths of the duplicate check (bitmap and sort)."""

from __future__ import annotations

import pytest
import torch

import canonical_ops
from canonical_ops.plan import HEADER_WORDS
from layouts import LayerSpec, derive_group_mappings

SPEC = LayerSpec("full", 4, 1, 8, "float16", "split", "NHD")


def setup(num_blocks: int = 8, num_rows: int = 8):
    mapping = derive_group_mappings(SPEC, 2, 2)[0]
    kv = torch.randn(num_blocks, 2, 4, 1, 8).to(torch.float16)
    pages = torch.zeros(num_rows, mapping.canonical_page_size_bytes, dtype=torch.uint8)
    plan = canonical_ops.make_plan([mapping], [kv], pages)
    return mapping, kv, pages, plan


def test_plan_edited_in_place_after_a_call_is_verified_again():
    """The first call caches the verified copy; a later edit through the raw memory (no
    version bump) is not followed: the edited plan is verified again and refused."""
    _, kv, pages, plan = setup()
    ids = torch.arange(4, dtype=torch.int64)
    canonical_ops.store([kv], pages, plan, ids, ids)
    first_fragment = HEADER_WORDS + 8  # one layer record, then the fragment table
    version = plan._version
    plan.numpy()[first_fragment + 1] = 1 << 40  # canonical offset far outside the page
    assert plan._version == version
    before = pages.clone()
    with pytest.raises(ValueError, match=r"plan: corrupt fragment 0 of layer 0"):
        canonical_ops.store([kv], pages, plan, ids, ids)
    assert torch.equal(pages, before)


def test_plan_restored_after_an_edit_is_used_again():
    _, kv, pages, plan = setup()
    ids = torch.arange(4, dtype=torch.int64)
    good = plan.clone()
    canonical_ops.store([kv], pages, plan, ids, ids)
    plan[HEADER_WORDS + 8 + 2] = 0  # a 0-byte fragment: corrupt
    with pytest.raises(ValueError, match=r"plan: corrupt fragment 0 of layer 0, word 2"):
        canonical_ops.load([kv], pages, plan, ids, ids)
    plan.copy_(good)
    canonical_ops.load([kv], pages, plan, ids, ids)


def test_same_words_in_another_tensor_are_verified_on_their_own():
    """A copy is another identity: it is verified (and then cached) by itself."""
    _, kv, pages, plan = setup()
    ids = torch.arange(2, dtype=torch.int64)
    canonical_ops.store([kv], pages, plan, ids, ids)
    copy = plan.clone()
    copy[1] = 99  # version word
    with pytest.raises(ValueError, match=r"expected plan version"):
        canonical_ops.store([kv], pages, copy, ids, ids)
    canonical_ops.store([kv], pages, plan, ids, ids)


def test_many_plans_stay_correct_past_the_cache_size():
    """More live plans than the cache holds: every one still verified and usable."""
    mapping, kv, pages, _ = setup()
    plans = [canonical_ops.make_plan([mapping], [kv], pages) for _ in range(300)]
    ids = torch.arange(3, dtype=torch.int64)
    for plan in plans + plans[:5]:
        canonical_ops.load([kv], pages, plan, ids, ids)


@pytest.mark.parametrize("num_rows", [16, 600_000], ids=["bitmap", "sort"])
def test_repeated_page_ids_found_for_small_and_huge_page_ranges(num_rows):
    """Few pages: the bitmap path; a page range far larger than the call: the sort path.
    Both name the first repeated pair."""
    mapping = derive_group_mappings(SPEC, 2, 2)[0]
    kv = torch.randn(8, 2, 4, 1, 8).to(torch.float16)
    pages = torch.zeros(num_rows, mapping.canonical_page_size_bytes, dtype=torch.uint8)
    plan = canonical_ops.make_plan([mapping], [kv], pages)
    page_ids = torch.tensor([num_rows - 1, 3, 5, num_rows - 1], dtype=torch.int64)
    blocks = torch.arange(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"page_ids\[0\] and page_ids\[3\] are both"):
        torch.ops.canonical.canonical_store([kv], pages, plan, blocks, page_ids)
    assert not pages.any()
    canonical_ops.store([kv], pages, plan, blocks[:3], page_ids[:3])  # distinct: fine


def test_repeated_block_ids_in_a_load_with_distinct_neighbours():
    _, kv, pages, plan = setup(num_blocks=8)
    before = kv.clone()
    blocks = torch.tensor([0, 7, 5, 2, 5], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"block_ids\[2\] and block_ids\[4\] are both 5"):
        torch.ops.canonical.canonical_load([kv], pages, plan, blocks, torch.arange(5))
    assert torch.equal(kv, before)
