"""Validation of canonical_store / canonical_load (CPU) and make_plan, plus torch.library.opcheck.

Every bad call must raise ONE Python exception of the contract's type whose
message names the offending argument, before anything is written: the
destination is compared byte for byte with its state before the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from helpers.ops import KVCache, PageLayout, ids_tensor, make_kv_cache, make_pages, typed_view

import canonical_ops
from canonical_ops import _extension  # noqa: F401  (registers torch.ops.canonical)
from layouts import LayerSpec, derive_group_mappings

PAGES_PER_ROW = 2
NUM_ROWS = 3
NUM_BLOCKS = 5
NUM_PAGES = PAGES_PER_ROW * NUM_ROWS


@dataclass
class Env:
    specs: list[LayerSpec]
    mappings: list
    kv: list[KVCache]
    pages: object  # helpers.ops.Pages
    layout: PageLayout
    plan: torch.Tensor
    rng: np.random.Generator

    @property
    def kv_tensors(self) -> list[torch.Tensor]:
        return [c.tensor for c in self.kv]

    def snapshot(self) -> list[np.ndarray]:
        return [self.pages.host_bytes()] + [c.host_bytes() for c in self.kv]

    def good_args(self) -> dict:
        return dict(
            kv_caches=self.kv_tensors,
            cpu_pages=self.pages.tensor,
            plan=self.plan,
            block_ids=ids_tensor([0, 3, 4]),
            page_ids=ids_tensor([5, 0, 2]),
        )


@pytest.fixture
def env() -> Env:
    """Two layers with different page sizes and dtypes, padded blocks, TP 2 rank 1."""
    rng = np.random.default_rng(0)
    specs = [
        LayerSpec("full", 4, 2, 8, "bfloat16", "packed", "NHD"),
        LayerSpec("full", 4, 2, 4, "float32", "split", "HND"),
    ]
    mappings = [derive_group_mappings(spec, 2, 4)[1] for spec in specs]
    kv = [make_kv_cache(spec, NUM_BLOCKS, rng, pad_bytes=16) for spec in specs]
    layout = PageLayout.default(mappings, PAGES_PER_ROW)
    pages = make_pages(NUM_ROWS, layout.row_bytes, rng, row_pad=8)
    plan = canonical_ops.make_plan(
        mappings, [c.tensor for c in kv], pages.tensor, pages_per_row=PAGES_PER_ROW
    )
    return Env(specs, mappings, kv, pages, layout, plan, rng)


OPS = {
    "store": torch.ops.canonical.canonical_store,
    "load": torch.ops.canonical.canonical_load,
}
WRAPPERS = {"store": canonical_ops.store, "load": canonical_ops.load}


def call(op: str, args: dict, wrapper: bool = False) -> None:
    fn = WRAPPERS[op] if wrapper else OPS[op]
    fn(
        list(args["kv_caches"]),
        args["cpu_pages"],
        args["plan"],
        args["block_ids"],
        args["page_ids"],
    )


def expect_rejected(env: Env, op: str, args: dict, exc: type, *names: str) -> str:
    """The call raises ``exc`` naming one of ``names``, and no byte changes."""
    before = env.snapshot()
    with pytest.raises(exc) as info:
        call(op, args)
    message = str(info.value)
    assert any(name in message for name in names), (
        f"message should name {' or '.join(names)}: {message!r}"
    )
    for i, (a, b) in enumerate(zip(env.snapshot(), before)):
        assert np.array_equal(a, b), f"{op} wrote into {'cpu_pages' if i == 0 else f'kv[{i - 1}]'}"
    return message


both_ops = pytest.mark.parametrize("op", ["store", "load"])


@both_ops
def test_good_call_writes(env, op):
    """Control: the unmodified arguments do write, so 'nothing written' below is meaningful."""
    before = env.snapshot()
    call(op, env.good_args(), wrapper=True)
    after = env.snapshot()
    changed = [not np.array_equal(a, b) for a, b in zip(after, before)]
    assert changed == ([True, False, False] if op == "store" else [False, True, True])


# --------------------------------------------------------------------------- cpu_pages


@both_ops
def test_cpu_pages_wrong_dtype(env, op):
    args = env.good_args()
    args["cpu_pages"] = env.pages.tensor.view(torch.int8)
    expect_rejected(env, op, args, TypeError, "cpu_pages")


@both_ops
@pytest.mark.parametrize("dims", [1, 3])
def test_cpu_pages_not_2d(env, op, dims):
    args = env.good_args()
    pages = env.pages.tensor
    args["cpu_pages"] = pages[0] if dims == 1 else pages.unsqueeze(0)
    expect_rejected(env, op, args, ValueError, "cpu_pages")


@both_ops
def test_cpu_pages_rows_not_contiguous(env, op):
    args = env.good_args()
    flat = env.pages.flat
    row_bytes = env.pages.tensor.shape[1]
    # Same row stride as the plan, but every other byte: stride(1) == 2.
    args["cpu_pages"] = flat.as_strided((NUM_ROWS, row_bytes // 2), (env.pages.row_stride, 2))
    expect_rejected(env, op, args, ValueError, "cpu_pages")


@both_ops
def test_cpu_pages_different_row_stride(env, op):
    """Plan built for other rows: same shape, rows further apart."""
    args = env.good_args()
    row_bytes = env.pages.tensor.shape[1]
    wide = torch.zeros(NUM_ROWS, env.pages.row_stride + 16, dtype=torch.uint8)
    args["cpu_pages"] = wide[:, :row_bytes]
    before = wide.clone()
    expect_rejected(env, op, args, ValueError, "cpu_pages", "plan")
    assert torch.equal(wide, before)


@both_ops
def test_cpu_pages_rows_too_short(env, op):
    args = env.good_args()
    args["cpu_pages"] = env.pages.tensor[:, : env.layout.row_bytes - 1]
    expect_rejected(env, op, args, ValueError, "cpu_pages")


# --------------------------------------------------------------------------- plan


@both_ops
def test_plan_for_other_layer_count(env, op):
    args = env.good_args()
    args["plan"] = canonical_ops.make_plan(
        env.mappings[:1], env.kv_tensors[:1], env.pages.tensor, pages_per_row=PAGES_PER_ROW
    )
    expect_rejected(env, op, args, ValueError, "plan")


@both_ops
def test_plan_for_other_block_stride(env, op):
    """kv_caches[1] has the same page but a different block stride than the plan's."""
    args = env.good_args()
    other = make_kv_cache(env.specs[1], NUM_BLOCKS, env.rng, pad_bytes=32)
    args["kv_caches"] = [env.kv_tensors[0], other.tensor]
    before = other.host_bytes()
    expect_rejected(env, op, args, ValueError, "kv_caches[1]")
    assert np.array_equal(other.host_bytes(), before)


@both_ops
def test_plan_for_other_block_count(env, op):
    args = env.good_args()
    fewer = KVCache(env.kv[1].base[:4], typed_view(env.kv[1].base[:4], env.specs[1]), env.specs[1])
    args["kv_caches"] = [env.kv_tensors[0], fewer.tensor]
    expect_rejected(env, op, args, ValueError, "kv_caches[1]")


@both_ops
def test_plan_wrong_dtype(env, op):
    args = env.good_args()
    args["plan"] = env.plan.to(torch.int32)
    expect_rejected(env, op, args, TypeError, "plan")


@both_ops
@pytest.mark.parametrize("corruption", ["magic", "truncated", "2-D", "fragment", "writer"])
def test_plan_corrupt(env, op, corruption):
    args = env.good_args()
    plan = env.plan.clone()
    if corruption == "magic":
        plan[0] += 1
    elif corruption == "truncated":
        plan = plan[:-4].clone()
    elif corruption == "2-D":
        plan = plan.view(1, -1)
    elif corruption == "fragment":
        plan[-2] = 1 << 40  # last fragment's size: leaves its pages
    else:
        plan[16 + 6] = 99  # layer 0's writer_index >= num_writers
    args["plan"] = plan
    expect_rejected(env, op, args, ValueError, "plan")


# --------------------------------------------------------------------------- kv_caches


@both_ops
def test_kv_caches_empty(env, op):
    args = env.good_args()
    args["kv_caches"] = []
    expect_rejected(env, op, args, ValueError, "kv_caches")


@both_ops
@pytest.mark.parametrize("arg", ["kv_caches[1]", "plan", "cpu_pages", "block_ids"])
def test_device_mix_with_meta(env, op, arg):
    """A meta tensor among CPU tensors is a device mix: rejected, not silently skipped.

    (A CPU-only machine has one real device; meta stands in for the other. With a
    meta argument the dispatcher picks the Meta kernel, so the check must be there.)
    """
    args = env.good_args()
    if arg == "kv_caches[1]":
        args["kv_caches"] = [env.kv_tensors[0], env.kv_tensors[1].to("meta")]
    else:
        args[arg] = args[arg].to("meta")
    expect_rejected(env, op, args, ValueError, arg)


@both_ops
@pytest.mark.parametrize(
    ("arg", "bad", "exc"),
    [
        (None, None, None),  # control: the good call traces
        ("cpu_pages", "int8", TypeError),
        ("cpu_pages", "3-D", ValueError),
        ("plan", "int32", TypeError),
        ("block_ids", "int32", TypeError),
        ("page_ids", "int32", TypeError),
        ("block_ids", "2-D", ValueError),
    ],
)
def test_fake_kernel_raises_like_eager(env, op, arg, bad, exc):
    """Tracing (FakeTensorMode, as torch.compile does) rejects what eager rejects, with
    the same exception type."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = env.good_args()
    if arg is not None:
        value = args[arg]
        if bad == "int8":
            value = value.view(torch.int8)
        elif bad == "int32":
            value = value.to(torch.int32)
        else:
            value = value.unsqueeze(0)
        args[arg] = value
        with pytest.raises(exc):
            call(op, args)  # eager: the contract's type
    with FakeTensorMode() as mode:
        fake = {
            k: [mode.from_tensor(t) for t in v] if k == "kv_caches" else mode.from_tensor(v)
            for k, v in args.items()
        }
        if exc is None:
            call(op, fake)
        else:
            with pytest.raises(exc, match=arg):
                call(op, fake)


# --------------------------------------------------------------------------- ids


@both_ops
@pytest.mark.parametrize("name", ["block_ids", "page_ids"])
def test_ids_wrong_dtype(env, op, name):
    args = env.good_args()
    args[name] = args[name].to(torch.int32)
    expect_rejected(env, op, args, TypeError, name)


@both_ops
@pytest.mark.parametrize("name", ["block_ids", "page_ids"])
def test_ids_not_1d(env, op, name):
    args = env.good_args()
    args[name] = args[name].view(1, -1)
    expect_rejected(env, op, args, ValueError, name)


@both_ops
def test_ids_different_lengths(env, op):
    args = env.good_args()
    args["page_ids"] = args["page_ids"][:2]
    expect_rejected(env, op, args, ValueError, "page_ids", "block_ids")


@both_ops
@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS, NUM_BLOCKS + 100, -(1 << 62)])
def test_block_id_out_of_range(env, op, bad):
    """The bad id comes LAST: an op validating while copying would already have written."""
    args = env.good_args()
    args["block_ids"] = ids_tensor([0, 3, bad])
    expect_rejected(env, op, args, IndexError, "block_ids")


@both_ops
@pytest.mark.parametrize("bad", [-1, NUM_PAGES, 1 << 40])
def test_page_id_out_of_range(env, op, bad):
    """Page ids range over num_rows * pages_per_row; the bad one comes last."""
    args = env.good_args()
    args["page_ids"] = ids_tensor([5, 0, bad])
    expect_rejected(env, op, args, IndexError, "page_ids")


@both_ops
def test_last_page_and_block_accepted(env, op):
    args = env.good_args()
    args["block_ids"] = ids_tensor([NUM_BLOCKS - 1])
    args["page_ids"] = ids_tensor([NUM_PAGES - 1])
    call(op, args)


@both_ops
def test_block_id_checked_against_smallest_layer(op):
    """Layers with different block counts: a block id must exist in every layer."""
    rng = np.random.default_rng(3)
    spec = LayerSpec("mla", 4, 1, 16, "float16", "packed", "NHD")
    mapping = derive_group_mappings(spec, 1, 1)[0]
    kv = [make_kv_cache(spec, 6, rng), make_kv_cache(spec, 4, rng)]
    layout = PageLayout.default([mapping, mapping], 1)
    pages = make_pages(4, layout.row_bytes, rng)
    plan = canonical_ops.make_plan([mapping, mapping], [c.tensor for c in kv], pages.tensor)
    before = [pages.host_bytes()] + [c.host_bytes() for c in kv]
    with pytest.raises(IndexError, match="block_ids"):
        OPS[op]([c.tensor for c in kv], pages.tensor, plan, ids_tensor([1, 4]), ids_tensor([0, 1]))
    after = [pages.host_bytes()] + [c.host_bytes() for c in kv]
    assert all(np.array_equal(a, b) for a, b in zip(after, before))


# --------------------------------------------------------------------------- make_plan


def test_make_plan_local_page_larger_than_block_stride(env):
    small = torch.zeros(NUM_BLOCKS, env.mappings[1].local_page_size_bytes - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]|mappings\[1\]"):
        canonical_ops.make_plan(
            env.mappings,
            [env.kv_tensors[0], small],
            env.pages.tensor,
            pages_per_row=PAGES_PER_ROW,
        )


def test_make_plan_areas_overflow_row(env):
    with pytest.raises(ValueError, match="cpu_pages"):
        canonical_ops.make_plan(
            env.mappings, env.kv_tensors, env.pages.tensor, pages_per_row=PAGES_PER_ROW + 1
        )
    with pytest.raises(ValueError, match=r"cpu_pages|area_offsets"):
        canonical_ops.make_plan(
            env.mappings,
            env.kv_tensors,
            env.pages.tensor,
            pages_per_row=PAGES_PER_ROW,
            area_offsets=[0, env.layout.area_offsets[1] + 1],
        )


def test_make_plan_overlapping_areas(env):
    with pytest.raises(ValueError, match="area_offsets"):
        canonical_ops.make_plan(
            env.mappings,
            env.kv_tensors,
            env.pages.tensor,
            pages_per_row=PAGES_PER_ROW,
            area_offsets=[0, 1],
        )


@pytest.mark.parametrize("count", [1, 3])
def test_make_plan_wrong_mapping_count(env, count):
    with pytest.raises(ValueError, match="mappings"):
        canonical_ops.make_plan(
            (env.mappings * 2)[:count], env.kv_tensors, env.pages.tensor, pages_per_row=2
        )


def test_make_plan_wrong_area_offset_count(env):
    with pytest.raises(ValueError, match="area_offsets"):
        canonical_ops.make_plan(
            env.mappings, env.kv_tensors, env.pages.tensor, pages_per_row=2, area_offsets=[0]
        )


def test_make_plan_rejects_bad_cpu_pages(env):
    with pytest.raises(TypeError, match="cpu_pages"):
        canonical_ops.make_plan(env.mappings, env.kv_tensors, env.pages.tensor.view(torch.int8))
    with pytest.raises(ValueError, match="cpu_pages"):
        canonical_ops.make_plan(env.mappings, env.kv_tensors, env.pages.flat)


def test_make_plan_returns_int64_plan_on_kv_device(env):
    assert env.plan.dtype == torch.int64
    assert env.plan.dim() == 1
    assert env.plan.device == env.kv_tensors[0].device


# --------------------------------------------------------------------------- opcheck


def _opcheck_args(contiguous: bool):
    rng = np.random.default_rng(9)
    specs = [
        LayerSpec("full", 4, 1, 8, "float16", "packed", "HND"),
        LayerSpec("full", 4, 1, 4, "float32", "split", "NHD"),
    ]
    mappings = [derive_group_mappings(spec, 2, 2)[0] for spec in specs]
    kv = [make_kv_cache(spec, 4, rng, pad_bytes=0 if contiguous else 8) for spec in specs]
    kv_tensors = [c.tensor.contiguous() if contiguous else c.tensor for c in kv]
    layout = PageLayout.default(mappings, 2)
    pages = torch.from_numpy(rng.integers(0, 256, (3, layout.row_bytes), dtype=np.uint8))
    plan = canonical_ops.make_plan(mappings, kv_tensors, pages, pages_per_row=2)
    return kv_tensors, pages, plan, ids_tensor([2, 0, 3]), ids_tensor([5, 1, 2])


@both_ops
def test_opcheck(op):
    """All default opcheck checks, on contiguous (unpadded) caches."""
    kv, pages, plan, blocks, page_ids = _opcheck_args(contiguous=True)
    torch.library.opcheck(OPS[op].default, (kv, pages, plan, blocks, page_ids))


@both_ops
def test_opcheck_padded_views(op):
    """Padded, permuted cache views: every default check but test_aot_dispatch_dynamic.

    That one runs the op on ``torch.clone``s of the inputs, and cloning a non-dense
    view yields a contiguous tensor with another block stride, which the plan
    rightly refuses. Compiled calls on padded views are covered by test_ops_compile.
    """
    kv, pages, plan, blocks, page_ids = _opcheck_args(contiguous=False)
    assert kv[0].stride(0) * kv[0].element_size() > kv[0][0].numel() * kv[0].element_size()
    torch.library.opcheck(
        OPS[op].default,
        (kv, pages, plan, blocks, page_ids),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
