"""The one integer checker, and that every entry point that takes counts or ids uses it:
Python and numpy integers accepted; floats, bools, strings refused with TypeError; values
out of range refused with ValueError (PageStateError for page ids, a ValueError)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from canonical_ops import checks
from canonical_ops.engine.pages import PageManager, PageStateError
from canonical_ops.engine.region import SharedOffloadRegion

NOT_INTS = [1.0, 1.9, True, np.bool_(True), "3", b"3", None, 2 + 0j]
INTS = [3, np.int64(3), np.int32(3), np.uint8(3)]


@pytest.mark.parametrize("value", INTS)
def test_integers_accepted_as_python_ints(value):
    got = checks.check_int("n", value, minimum=0, maximum=3)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", NOT_INTS)
def test_non_integers_are_type_errors(value):
    with pytest.raises(TypeError, match=r"^n: expected an int >= 0, got "):
        checks.check_int("n", value, minimum=0)


def test_range_errors_name_the_argument_and_the_range():
    with pytest.raises(ValueError, match=r"^n: expected an int in \[1, 4\], got 5$"):
        checks.check_int("n", 5, minimum=1, maximum=4)
    with pytest.raises(PageStateError, match=r"^p: expected an int <= 2, got 3$"):
        checks.check_int("p", 3, maximum=2, error=PageStateError)


@pytest.mark.parametrize(
    "ids",
    [[1.9, 2.0], [True, 0], ["3"], np.array([1.5]), torch.tensor([1.9, 2.7]), torch.tensor([True])],
)
def test_ids_are_never_coerced(ids):
    with pytest.raises(TypeError, match="ids"):
        checks.check_ids("ids", ids)


def test_integer_ids_of_any_width_become_int64():
    for ids in ([1, np.int64(2)], np.array([1, 2], dtype=np.int32), torch.tensor([1, 2]).int()):
        got = checks.check_ids("ids", ids)
        assert got.dtype in (np.int64, torch.int64) and list(got.tolist()) == [1, 2]
    with pytest.raises(ValueError, match="1-D"):
        checks.check_ids("ids", np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="ids: expected a 1-D"):
        checks.check_ids("ids", 3)


@pytest.mark.parametrize("bad", [2.0, True, "2"])
def test_region_and_page_manager_agree(bad, tmp_path):
    """Same argument, same wrong type, same exception everywhere."""
    with pytest.raises(TypeError, match="num_rows"):
        SharedOffloadRegion(uuid.uuid4().hex, bad, 8, world_size=1, rank=0, shm_dir=str(tmp_path))
    with pytest.raises(TypeError, match="num_pages"):
        PageManager(bad)
    manager = PageManager(4)
    with pytest.raises(TypeError, match="page_id"):
        manager.state(bad)
    with pytest.raises(ValueError, match="num_rows"):
        SharedOffloadRegion(uuid.uuid4().hex, 0, 8, world_size=1, rank=0, shm_dir=str(tmp_path))
    with pytest.raises(ValueError, match="num_pages"):
        PageManager(0)
    assert list(tmp_path.iterdir()) == []


def test_ops_wrappers_refuse_float_and_bool_ids():
    import canonical_ops
    from layouts import LayerSpec, derive_group_mappings

    spec = LayerSpec("full", 4, 1, 8, "float16", "packed", "NHD")
    mapping = derive_group_mappings(spec, 1, 1)[0]
    kv = [torch.arange(6 * 64, dtype=torch.int16).view(6, 1, 4, 16).to(torch.float16)]
    pages = torch.zeros(4, mapping.canonical_page_size_bytes, dtype=torch.uint8)
    plan = canonical_ops.make_plan([mapping], kv, pages)
    for blocks, page_ids in (([1.9], [0]), ([1], [0.7]), (["3"], [0]), ([True], [0])):
        with pytest.raises(TypeError, match=r"block_ids|page_ids"):
            canonical_ops.store(kv, pages, plan, blocks, page_ids)
    assert not pages.any()
    with pytest.raises(TypeError, match="pages_per_row"):
        canonical_ops.make_plan([mapping], kv, pages, pages_per_row=1.0)
    with pytest.raises(TypeError, match="sms"):
        canonical_ops.set_sm_budget(2.5)


@pytest.mark.parametrize("value", [1, 0.25, np.float32(2.5), np.int64(3)])
def test_seconds_accepted_as_floats(value):
    assert checks.check_seconds("deadline_s", value) == float(value)


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
     (True, TypeError), ("5", TypeError)],
)  # fmt: skip
def test_bad_seconds_name_the_argument(value, error):
    with pytest.raises(error, match=r"^deadline_s: expected a number of seconds > 0, got"):
        checks.check_seconds("deadline_s", value)
    with pytest.raises(error, match=r"^deadline_s: expected a number of seconds > 0 or None"):
        checks.check_seconds("deadline_s", value, optional=True)


def test_no_seconds_only_where_optional():
    assert checks.check_seconds("deadline_s", None, optional=True) is None
    with pytest.raises(TypeError, match=r"^deadline_s: expected a number of seconds > 0, got"):
        checks.check_seconds("deadline_s", None)
