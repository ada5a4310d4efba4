"""canonical_store / canonical_load (CPU) against an independent numpy reference, bit-exact.

The reference (tests/helpers/ops.py) is built only from ``mapping.fragments()``,
``is_writer`` and the page-address rule of the API contract. Cross-topology
tests check the ops end to end against ``layout_truth`` (first principles).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers.layout_truth import Topology
from helpers.ops import (
    FAMILIES,
    Case,
    LayerConfig,
    PageLayout,
    build_setup,
    check_store_and_load,
    family_cases,
    fragment_indices,
    ids_tensor,
    make_kv_cache,
    make_pages,
    random_case,
    random_pairs,
    ref_load,
    ref_store,
    run_cross_topology,
    typed_view,
)

import canonical_ops
from layouts import LayerSpec, derive_group_mappings

FAMILY_CASES = family_cases()


def _case_id(case: Case) -> str:
    kinds = "+".join(
        f"{layer.attention}-{layer.packing}-{layer.order}-h{layer.total_heads}"
        for layer in case.layers
    )
    return f"{kinds}-tp{case.tp}-dcp{case.dcp}-pcp{case.pcp}-r{case.rank}"


# --------------------------------------------------------------------------- helper sanity


@pytest.mark.parametrize("case", FAMILY_CASES[::7], ids=_case_id)
def test_helper_views_are_the_layouts_the_specs_describe(case):
    """The typed views built over raw bytes are recognised as their spec by layouts."""
    rng = np.random.default_rng(0)
    for layer in case.layers:
        spec = case.spec(layer)
        cache = make_kv_cache(spec, 3, rng, pad_bytes=4 * spec.element_size)
        got = LayerSpec.from_tensor(
            cache.tensor,
            attention=spec.attention,
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
        )
        assert got == spec
        assert cache.tensor.data_ptr() == cache.base.data_ptr()
        assert cache.tensor.stride(0) * cache.tensor.element_size() == cache.block_stride_bytes


@pytest.mark.parametrize("case", FAMILY_CASES, ids=_case_id)
def test_reference_fragments_cover_each_local_page_once(case):
    for mapping in case.mappings():
        local_idx, canonical_idx = fragment_indices(mapping)
        assert np.array_equal(np.sort(local_idx), np.arange(mapping.local_page_size_bytes))
        assert np.unique(canonical_idx).size == canonical_idx.size
        assert canonical_idx.max() < mapping.canonical_page_size_bytes


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("case", FAMILY_CASES, ids=_case_id)
def test_families_match_reference(case):
    check_store_and_load(build_setup(case))


@pytest.mark.parametrize("seed", range(120))
def test_random_cases_match_reference(seed):
    check_store_and_load(build_setup(random_case(seed)))


def test_random_cases_cover_the_knobs():
    """The random cases exercise every knob the reference suite claims to cover."""
    cases = [random_case(seed) for seed in range(120)]
    layers = [layer for case in cases for layer in case.layers]
    assert {(layer.packing, layer.order) for layer in layers if layer.attention == "full"} == set(
        FAMILIES
    )
    assert any(layer.attention == "mla" for layer in layers)
    assert {case.tp for case in cases} == {1, 2, 4, 8}
    assert any(case.dcp > 1 for case in cases) and any(case.pcp > 1 for case in cases)
    assert {1, 4} <= {case.pages_per_row for case in cases}
    assert any(layer.pad_elems for layer in layers)
    assert any(len(case.layers) > 1 for case in cases)
    mappings = [m for case in cases for m in case.mappings()]
    assert any(m.num_writers > 1 for m in mappings)  # replicated GQA / MLA
    assert any(not m.parallelism_agnostic and m.num_writers == 1 for m in mappings)


@pytest.mark.parametrize("pages_lead", [0, 1], ids=["aligned", "unaligned"])
def test_large_multi_layer_call_matches_reference(pages_lead):
    """A call moving > 4 MiB (the CPU kernel's streaming-store path), aligned or not."""
    layers = (
        LayerConfig("full", "packed", "HND", 128, "bfloat16", 8),
        LayerConfig("full", "split", "NHD", 64, "float32", 8, pad_elems=16),
    )
    case = Case(
        layers=layers,
        tp=2,
        block_size=16,
        rank=1,
        num_blocks=80,
        num_rows=40,
        pages_per_row=2,
        lead=pages_lead,
        num_pairs=72,
        seed=11,
    )
    setup = build_setup(case)
    assert case.num_pairs * sum(m.local_page_size_bytes for m in setup.layout.mappings) >= 4 << 20
    check_store_and_load(setup)


def test_large_call_with_unaligned_kv_blocks_matches_reference():
    """> 4 MiB with kv blocks 2 bytes out of 16-byte alignment: the streaming load (and
    store) paths must fall back per fragment where the destination is not aligned."""
    case = Case(
        layers=(LayerConfig("full", "split", "NHD", 128, "bfloat16", 8, pad_elems=1),),
        tp=4,
        block_size=32,
        rank=3,
        num_blocks=600,
        num_rows=600,
        num_pairs=560,
        seed=17,
    )
    setup = build_setup(case)
    stride = setup.kv[0].block_stride_bytes
    assert stride % 16 == 2 and case.num_pairs * stride >= 4 << 20
    check_store_and_load(setup)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_copies_on_its_own_threads_without_hanging(two_torch_threads):
    """libgomp cannot run a parallel region in a child forked after its parent ran one (torch's
    own CPU ops hang there): the CPU kernel then splits its work over its own threads. The
    child only calls our ops and numpy (a torch op with 2 threads would hang it), and must
    reproduce the bytes the parent's OpenMP calls wrote, on 2 threads."""
    case = Case(
        layers=(LayerConfig("full", "packed", "HND", 128, "bfloat16", 8),),
        tp=2,
        block_size=16,
        num_blocks=96,
        num_rows=96,
        num_pairs=90,
        seed=23,
    )
    setup = build_setup(case)
    rng = np.random.default_rng(3)
    blocks, page_ids = random_pairs(rng, case.num_blocks, case.num_rows, case.num_pairs)
    ids = (ids_tensor(blocks), ids_tensor(page_ids))
    kv = [cache.tensor for cache in setup.kv]
    kv_bytes = [cache.base.numpy() for cache in setup.kv]
    pages_bytes = setup.pages.flat.numpy()
    before = (pages_bytes.copy(), [b.copy() for b in kv_bytes])

    def store_then_load() -> tuple[np.ndarray, list[np.ndarray]]:
        pages_bytes[:] = before[0]
        for b, original in zip(kv_bytes, before[1]):
            b[:] = original
        canonical_ops.store(kv, setup.pages.tensor, setup.plan, *ids)
        stored = pages_bytes.copy()
        for b in kv_bytes:
            b[:] = 0
        canonical_ops.load(kv, setup.pages.tensor, setup.plan, *ids)
        return stored, [b.copy() for b in kv_bytes]

    assert case.num_pairs * setup.kv[0].block_stride_bytes > 1 << 20  # a parallel call
    expected_pages, expected_kv = store_then_load()  # the parent runs parallel regions
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 3
        try:
            stored, loaded = store_then_load()
            same = np.array_equal(stored, expected_pages) and all(
                np.array_equal(a, b) for a, b in zip(loaded, expected_kv)
            )
            threads = torch.ops.canonical._cpu_threads_used(64) == min(2, os.cpu_count() or 1)
            code = 0 if same and threads else (1 if not same else 2)
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in a CPU transfer")
        time.sleep(0.05)
    # 1: different bytes, 2: not on 2 threads, 3: raised
    assert os.waitstatus_to_exitcode(status) == 0


def _threads_used_with_two() -> int:
    torch.set_num_threads(2)
    return int(torch.ops.canonical._cpu_threads_used(64))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs at least 2 CPU cores")
def test_forkserver_children_keep_every_thread(forkserver):
    """Children of a forkserver that preloaded the ops core are forked children: the CPU
    kernel must still use every thread there."""
    with forkserver.Pool(1) as pool:
        assert pool.apply_async(_threads_used_with_two).get(timeout=120) == 2


def test_large_store_replicated_writers_match_reference():
    """Streaming path with elected writers (TP 8 over 2 heads: 4 writers per page)."""
    case = Case(
        layers=(LayerConfig("full", "packed", "NHD", 256, "float32", 2),),
        tp=8,
        block_size=64,
        rank=6,
        num_blocks=80,
        num_rows=80,
        num_pairs=80,
        seed=5,
    )
    setup = build_setup(case)
    assert setup.layout.mappings[0].num_writers == 4
    check_store_and_load(setup)


def test_zero_pairs_touch_nothing():
    setup = build_setup(random_case(3))
    before_pages = setup.pages.host_bytes()
    before_kv = [c.host_bytes() for c in setup.kv]
    empty = torch.empty(0, dtype=torch.int64)
    canonical_ops.store(setup.kv_tensors, setup.pages.tensor, setup.plan, empty, empty)
    canonical_ops.load(setup.kv_tensors, setup.pages.tensor, setup.plan, empty, empty)
    assert np.array_equal(setup.pages.host_bytes(), before_pages)
    for c, before in zip(setup.kv, before_kv):
        assert np.array_equal(c.host_bytes(), before)


def test_ops_move_bytes_of_any_dtype_view():
    """A derived mapping refuses uint8 / int16 views of the bf16 cache it was derived for;
    the same runs in a hand-built mapping (no page of its own) move the same bytes through
    such views; a plan refuses a view of another dtype than the one it was built for (it
    records each tensor)."""
    rng = np.random.default_rng(1)
    spec = LayerSpec("full", 4, 2, 16, "bfloat16", "split", "HND")
    derived = derive_group_mappings(spec, 2, 4)[1]
    mapping = dataclasses.replace(derived, derived_for=None)
    cache = make_kv_cache(spec, 6, rng, pad_bytes=6)
    layout = PageLayout.default([mapping], 1)
    pages = make_pages(5, layout.row_bytes, rng)
    bf16_plan = canonical_ops.make_plan([derived], [cache.tensor], pages.tensor)
    blocks, page_ids = np.array([4, 0, 2]), np.array([3, 1, 4])
    b, p = ids_tensor(blocks), ids_tensor(page_ids)
    for view in (cache.base, cache.base.view(torch.int16)):
        assert view.stride(0) * view.element_size() == cache.block_stride_bytes
        with pytest.raises(ValueError, match=r"kv_caches\[0\]: plan built for a BFloat16"):
            canonical_ops.store([view], pages.tensor, bf16_plan, b, p)
        with pytest.raises(ValueError, match=r"kv_caches\[0\]: does not match mappings\[0\]"):
            canonical_ops.make_plan([derived], [view], pages.tensor)
        plan = canonical_ops.make_plan([mapping], [view], pages.tensor)
        expected = pages.host_bytes()
        ref_store(layout, [cache.host_bytes()], expected, pages, blocks, page_ids)
        canonical_ops.store([view], pages.tensor, plan, b, p)
        assert np.array_equal(pages.host_bytes(), expected)
        pages.flat.copy_(torch.from_numpy(rng.integers(0, 256, pages.flat.shape, dtype=np.uint8)))
        expected_kv = [cache.host_bytes()]
        ref_load(layout, expected_kv, pages.host_bytes(), pages, blocks, page_ids)
        canonical_ops.load([view], pages.tensor, plan, b, p)
        assert np.array_equal(cache.host_bytes(), expected_kv[0])


def test_store_writes_only_elected_writer_pages():
    """Replicated heads: each rank writes exactly the pages it is elected for, all ranks tile."""
    rng = np.random.default_rng(2)
    spec = LayerSpec("full", 4, 1, 8, "float16", "packed", "NHD")
    group = derive_group_mappings(spec, 4, 2)  # 2 writers per page
    layout = PageLayout.default([group[0]], 1)
    page_bytes = group[0].canonical_page_size_bytes
    pages = make_pages(4, layout.row_bytes, rng)
    poison = pages.host_bytes()
    for rank, mapping in enumerate(group):
        assert mapping.num_writers == 2
        cache = make_kv_cache(spec, 4, rng)
        plan = canonical_ops.make_plan([mapping], [cache.tensor], pages.tensor)
        before = pages.host_bytes()
        canonical_ops.store(
            [cache.tensor], pages.tensor, plan, ids_tensor([0, 1, 2, 3]), ids_tensor([0, 1, 2, 3])
        )
        after = pages.host_bytes()
        for page in range(4):
            changed = not np.array_equal(
                after[page * page_bytes : (page + 1) * page_bytes],
                before[page * page_bytes : (page + 1) * page_bytes],
            )
            assert changed == mapping.is_writer(page), (rank, page)
    # Every byte of every page was written by some rank (random data: a gap would keep poison).
    assert (pages.host_bytes() != poison).mean() > 0.9


def test_check_device_errors_is_a_noop_for_cpu_plans():
    setup = build_setup(random_case(4))
    assert canonical_ops.check_device_errors(setup.plan) is None


def test_set_sm_budget_returns_previous():
    previous = canonical_ops.set_sm_budget(3)
    try:
        assert isinstance(previous, int) and previous >= 1
        assert canonical_ops.set_sm_budget(5) == 3
    finally:
        assert canonical_ops.set_sm_budget(previous) == 5


def test_built_with_cuda_is_a_bool():
    assert isinstance(canonical_ops.BUILT_WITH_CUDA, bool)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs at least 2 CPU cores")
def test_cpu_kernel_runs_on_several_threads(two_torch_threads):
    """at::parallel_for is inline OpenMP: built without -fopenmp it silently runs serially."""
    assert torch.ops.canonical._cpu_threads_used(64) == 2


# --------------------------------------------------------------------------- cross-topology


CROSS_TP = [(1, 2), (2, 1), (2, 4), (4, 2), (4, 8), (8, 1)]


@pytest.mark.parametrize(("packing", "order"), FAMILIES)
@pytest.mark.parametrize(("tp_a", "tp_b"), CROSS_TP)
def test_cross_topology_full_attention(tp_a, tp_b, packing, order):
    run_cross_topology(
        "full", 8, Topology(tp_a), Topology(tp_b), packing, order, seed=tp_a * 10 + tp_b
    )


@pytest.mark.parametrize(("packing", "order"), FAMILIES)
def test_cross_topology_replicated_gqa(packing, order):
    run_cross_topology("full", 2, Topology(4), Topology(8), packing, order, seed=3)


def test_cross_topology_mla():
    run_cross_topology(
        "mla",
        1,
        Topology(4),
        Topology(2),
        "packed",
        "NHD",
        layers=((32, "bfloat16"), (24, "float8_e4m3fn")),
        seed=4,
    )


@pytest.mark.parametrize(("packing", "order"), FAMILIES)
def test_cross_topology_dcp_writers_plain_readers(packing, order):
    """TP 4 with DCP 2 (2 heads replicated) stores; TP 2 without DCP loads the same pages."""
    run_cross_topology(
        "full",
        2,
        Topology(4, dcp=2, interleave=2),
        Topology(2),
        packing,
        order,
        canonical_tokens=8,
        seed=5,
    )


def test_layers_interleaved_in_one_allocation():
    """Caches as views into ONE buffer (block b holds every layer's page back to back):
    nonzero storage offsets, block stride = all layers' pages. Bytes of other layers,
    which sit between a layer's blocks, must stay untouched."""
    rng = np.random.default_rng(8)
    specs = [
        LayerSpec("full", 4, 2, 8, "bfloat16", "split", "NHD"),
        LayerSpec("full", 4, 2, 8, "float16", "packed", "HND"),
        LayerSpec("full", 4, 2, 4, "float32", "split", "HND"),
    ]
    mappings = [derive_group_mappings(spec, 2, 4)[0] for spec in specs]
    widths = [spec.page_size_bytes + 8 for spec in specs]
    starts = np.cumsum([0, *widths])
    num_blocks = 7
    shared = torch.from_numpy(rng.integers(0, 256, (num_blocks, starts[-1]), dtype=np.uint8))
    tensors = []
    for spec, begin, width in zip(specs, starts, widths):
        view = typed_view(shared[:, begin : begin + width], spec)
        assert view.storage_offset() > 0 or begin == 0
        tensors.append(view)
    layout = PageLayout.default(mappings, 2)
    pages = make_pages(3, layout.row_bytes, rng, row_pad=32)
    plan = canonical_ops.make_plan(mappings, tensors, pages.tensor, pages_per_row=2)
    blocks, page_ids = np.array([6, 2, 0, 3]), np.array([1, 5, 2, 0])

    raw = shared.numpy().copy()
    kv_bytes = [raw[:, b : b + w] for b, w in zip(starts, widths)]  # numpy views into raw
    expected_pages = pages.host_bytes()
    ref_store(layout, kv_bytes, expected_pages, pages, blocks, page_ids)
    canonical_ops.store(tensors, pages.tensor, plan, ids_tensor(blocks), ids_tensor(page_ids))
    assert np.array_equal(pages.host_bytes(), expected_pages)
    assert np.array_equal(shared.numpy(), raw)

    pages.flat.copy_(torch.from_numpy(rng.integers(0, 256, pages.flat.shape, dtype=np.uint8)))
    ref_load(layout, kv_bytes, pages.host_bytes(), pages, blocks, page_ids)
    canonical_ops.load(tensors, pages.tensor, plan, ids_tensor(blocks), ids_tensor(page_ids))
    assert np.array_equal(shared.numpy(), raw)


def test_plan_serves_cpu_pages_with_more_rows():
    """The plan fixes the row geometry, not the row count: page ids range over the call's rows."""
    rng = np.random.default_rng(9)
    spec = LayerSpec("mla", 4, 1, 16, "bfloat16", "packed", "NHD")
    mapping = derive_group_mappings(spec, 1, 1)[0]
    cache = make_kv_cache(spec, 4, rng)
    layout = PageLayout.default([mapping], 2)
    big = make_pages(5, layout.row_bytes, rng, row_pad=16)
    # Built for the first 2 rows of the same geometry (same row stride).
    plan = canonical_ops.make_plan([mapping], [cache.tensor], big.tensor[:2], pages_per_row=2)
    blocks, page_ids = np.array([3, 0]), np.array([9, 4])
    expected = big.host_bytes()
    ref_store(layout, [cache.host_bytes()], expected, big, blocks, page_ids)
    canonical_ops.store([cache.tensor], big.tensor, plan, ids_tensor(blocks), ids_tensor(page_ids))
    assert np.array_equal(big.host_bytes(), expected)
