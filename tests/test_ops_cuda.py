"""canonical_ops on CUDA: reference suite with pinned and cudaHostRegister'ed pages, CUDA
graphs, one kernel per call, device-side id checks, CUDA-specific validation.

Every test but ``test_cuda_kernels_registered`` is marked ``cuda`` (tests/conftest.py skips it,
with the reason, without a GPU); that one runs everywhere the extension was built with CUDA
kernels.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers.layout_truth import Topology
from helpers.ops import (
    Case,
    LayerConfig,
    Pages,
    build_setup,
    check_store_and_load,
    family_cases,
    full_and_mla_case,
    ids_tensor,
    random_bytes,
    random_case,
    ref_load,
    ref_store,
    run_cross_topology,
)

import canonical_ops


@pytest.mark.skipif(not canonical_ops.BUILT_WITH_CUDA, reason="extension built without CUDA")
def test_cuda_kernels_registered():
    for op in ("canonical::canonical_store", "canonical::canonical_load"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op


# --------------------------------------------------------------------------- reference on GPU

FAMILY_CASES = family_cases()[::3]


def _sync_and_check(plan: torch.Tensor) -> None:
    torch.cuda.synchronize()
    canonical_ops.check_device_errors(plan)


@pytest.mark.cuda
@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: f"seed{c.seed}")
def test_families_match_reference_pinned(case):
    check_store_and_load(build_setup(case, device="cuda", pin=True))


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(60))
def test_random_cases_match_reference_pinned(seed):
    check_store_and_load(build_setup(random_case(seed), device="cuda", pin=True))


@pytest.mark.cuda
@pytest.mark.parametrize("sms", [1, 132])
def test_large_call_matches_reference_under_sm_budget(sms):
    """A multi-MiB call, with one SM's worth of blocks (grid-stride loops) and with many."""
    case = Case(
        layers=(
            LayerConfig("full", "packed", "HND", 128, "bfloat16", 8, pad_elems=8),
            LayerConfig("full", "split", "NHD", 64, "float8_e4m3fn", 8),
            LayerConfig("mla", "packed", "NHD", 576, "bfloat16", 1),
        ),
        tp=2,
        block_size=16,
        rank=1,
        num_blocks=96,
        num_rows=40,
        pages_per_row=2,
        num_pairs=80,
        seed=17,
    )
    previous = canonical_ops.set_sm_budget(sms)
    try:
        check_store_and_load(build_setup(case, device="cuda", pin=True))
    finally:
        canonical_ops.set_sm_budget(previous)


def pages_view(flat: torch.Tensor, like: Pages) -> torch.Tensor:
    """``like.tensor``'s rows over ``flat`` (a view that may start inside its storage):
    as_strided's offset counts from the STORAGE, so add flat's own offset to the lead."""
    return flat.as_strided(
        tuple(like.tensor.shape), tuple(like.tensor.stride()), flat.storage_offset() + like.lead
    )


def test_pages_view_starts_at_the_lead_of_a_view_inside_its_storage():
    """The registered-pages test builds cpu_pages over a view that starts inside a larger
    allocation (page-aligned); the rows must start ``lead`` bytes into that view."""
    rng = np.random.default_rng(0)
    old = Pages(torch.zeros(1), torch.zeros(3, 40, dtype=torch.uint8)[:, :37], 5, 40)
    raw = torch.from_numpy(rng.integers(0, 256, 4096 + 200, dtype=np.uint8))
    flat = raw[1000 : 1000 + 5 + 3 * 40]
    view = pages_view(flat, old)
    assert view.data_ptr() == flat.data_ptr() + 5
    assert torch.equal(view[2], flat[5 + 80 : 5 + 80 + 37])


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [0, 1, 2, 7, 13])
def test_host_registered_pages_match_reference(seed):
    """cpu_pages in ordinary CPU memory, page-locked with cudaHostRegister."""
    setup = build_setup(random_case(seed), device="cuda", pin=False)
    cudart = torch.cuda.cudart()
    old = setup.pages
    page = 4096
    size = -(-old.flat.numel() // page) * page
    raw = torch.empty(size + page, dtype=torch.uint8)
    start = (-raw.data_ptr()) % page
    region = raw[start : start + size]
    region[: old.flat.numel()].copy_(old.flat)
    mapped = 2  # cudaHostRegisterMapped: the device address is valid on every system
    assert int(cudart.cudaHostRegister(region.data_ptr(), size, mapped)) == 0
    try:
        flat = region[: old.flat.numel()]
        tensor = pages_view(flat, old)
        assert tensor.data_ptr() == flat.data_ptr() + old.lead
        assert tensor.is_pinned()
        setup.pages = Pages(flat, tensor, old.lead, old.row_stride)
        check_store_and_load(setup)
    finally:
        torch.cuda.synchronize()
        assert int(cudart.cudaHostUnregister(region.data_ptr())) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [3, 8])
def test_pinned_cpu_ids_accepted(seed):
    check_store_and_load(build_setup(random_case(seed), device="cuda", pin=True), ids_device="cpu")


@pytest.mark.cuda
@pytest.mark.parametrize(("tp_a", "tp_b"), [(2, 4), (8, 1)])
@pytest.mark.parametrize(("packing", "order"), [("packed", "NHD"), ("split", "HND")])
def test_cross_topology_on_gpu(tp_a, tp_b, packing, order):
    run_cross_topology(
        "full", 8, Topology(tp_a), Topology(tp_b), packing, order, device="cuda", pin=True
    )


@pytest.mark.cuda
def test_cross_topology_mla_on_gpu():
    run_cross_topology(
        "mla",
        1,
        Topology(4),
        Topology(2),
        "packed",
        "NHD",
        layers=((32, "bfloat16"), (24, "float8_e4m3fn")),
        device="cuda",
        pin=True,
    )


# --------------------------------------------------------------------------- CUDA graphs


GRAPH_CASE = Case(
    layers=(
        LayerConfig("full", "packed", "NHD", 16, "bfloat16", 8, pad_elems=8),
        LayerConfig("full", "split", "HND", 8, "float32", 8),
    ),
    tp=4,
    block_size=8,
    rank=2,
    num_blocks=10,
    num_rows=4,
    pages_per_row=2,
    seed=31,
)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay_of_store_then_load():
    src = build_setup(GRAPH_CASE, device="cuda", pin=True)
    dst = build_setup(dataclasses.replace(GRAPH_CASE, seed=32), device="cuda", pin=True)
    n = 4
    src_blocks = torch.zeros(n, dtype=torch.int64, device="cuda")
    dst_blocks = torch.zeros(n, dtype=torch.int64, device="cuda")
    page_ids = torch.zeros(n, dtype=torch.int64, device="cuda")

    def step():
        canonical_ops.store(src.kv_tensors, src.pages.tensor, src.plan, src_blocks, page_ids)
        canonical_ops.load(dst.kv_tensors, src.pages.tensor, dst.plan, dst_blocks, page_ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()

    rng = np.random.default_rng(0)
    num_pages = GRAPH_CASE.num_rows * GRAPH_CASE.pages_per_row
    for _ in range(3):  # new data and new ids each replay: the graph reads them at replay
        sb = rng.choice(GRAPH_CASE.num_blocks, n, replace=False)
        db = rng.choice(GRAPH_CASE.num_blocks, n, replace=False)
        pids = rng.choice(num_pages, n, replace=False)
        src_blocks.copy_(ids_tensor(sb))
        dst_blocks.copy_(ids_tensor(db))
        page_ids.copy_(ids_tensor(pids))
        for c in src.kv + dst.kv:
            c.base.copy_(random_bytes(rng, tuple(c.base.shape)).cuda())
        src.pages.flat.copy_(random_bytes(rng, tuple(src.pages.flat.shape)))
        torch.cuda.synchronize()
        src_bytes = [c.host_bytes() for c in src.kv]
        expected_pages = src.pages.host_bytes()
        ref_store(src.layout, src_bytes, expected_pages, src.pages, sb, pids)
        expected_dst = [c.host_bytes() for c in dst.kv]
        ref_load(dst.layout, expected_dst, expected_pages, src.pages, db, pids)

        graph.replay()
        _sync_and_check(src.plan)
        canonical_ops.check_device_errors(dst.plan)
        assert np.array_equal(src.pages.host_bytes(), expected_pages)
        for c, expected in zip(dst.kv, expected_dst):
            assert np.array_equal(c.host_bytes(), expected)
        for c, before in zip(src.kv, src_bytes):
            assert np.array_equal(c.host_bytes(), before)


# --------------------------------------------------------------------------- one launch


def _canonical_kernels(fn) -> list[str]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        e.name
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and "canonical" in e.name.lower()
    ]


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["store", "load"])
def test_one_kernel_launch_per_call(op):
    """Three layers, many pairs, many fragments: still exactly one kernel."""
    case = Case(
        layers=(
            LayerConfig("full", "split", "HND", 64, "bfloat16", 8, pad_elems=8),
            LayerConfig("full", "packed", "NHD", 128, "float16", 8),
            LayerConfig("mla", "packed", "NHD", 512, "bfloat16", 1),
        ),
        tp=4,
        block_size=16,
        rank=1,
        num_blocks=40,
        num_rows=40,
        num_pairs=32,
        seed=41,
    )
    setup = build_setup(case, device="cuda", pin=True)
    ids = ids_tensor(np.arange(32), "cuda")
    fn = canonical_ops.store if op == "store" else canonical_ops.load
    fn(setup.kv_tensors, setup.pages.tensor, setup.plan, ids, ids)  # warm-up
    kernels = _canonical_kernels(
        lambda: fn(setup.kv_tensors, setup.pages.tensor, setup.plan, ids, ids)
    )
    assert len(kernels) == 1, kernels


# --------------------------------------------------------------------------- device ids


def _device_id_setup():
    case = full_and_mla_case(num_blocks=6, seed=51)
    return build_setup(case, device="cuda", pin=True)


def _all_bytes(setup) -> list[np.ndarray]:
    torch.cuda.synchronize()
    return [setup.pages.host_bytes()] + [c.host_bytes() for c in setup.kv]


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["store", "load"])
@pytest.mark.parametrize(
    ("blocks", "pages"),
    [([6], [0]), ([-1], [1]), ([2], [6]), ([3], [-5]), ([1 << 40], [1 << 40])],
    ids=["block-high", "block-negative", "page-high", "page-negative", "both"],
)
def test_out_of_range_device_ids_touch_nothing_and_are_reported(op, blocks, pages):
    setup = _device_id_setup()
    fn = canonical_ops.store if op == "store" else canonical_ops.load
    before = _all_bytes(setup)
    fn(
        setup.kv_tensors,
        setup.pages.tensor,
        setup.plan,
        ids_tensor(blocks, "cuda"),
        ids_tensor(pages, "cuda"),
    )
    torch.cuda.synchronize()
    for a, b in zip(_all_bytes(setup), before):
        assert np.array_equal(a, b)
    with pytest.raises(canonical_ops.CanonicalTransferError):
        canonical_ops.check_device_errors(setup.plan)
    canonical_ops.check_device_errors(setup.plan)  # cleared by the previous check
    # The plan still works afterwards.
    check_store_and_load(setup)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["store", "load"])
def test_out_of_range_device_id_among_valid_pairs(op):
    """The refused pair touches nothing; the others are copied or (at most) nothing is."""
    setup = _device_id_setup()
    blocks, pages = np.array([0, 7, 4]), np.array([5, 1, 2])
    fn = canonical_ops.store if op == "store" else canonical_ops.load
    before = _all_bytes(setup)
    valid_only = [x.copy() for x in before]
    if op == "store":
        ref_store(setup.layout, valid_only[1:], valid_only[0], setup.pages, [0, 4], [5, 2])
    else:
        ref_load(setup.layout, valid_only[1:], valid_only[0], setup.pages, [0, 4], [5, 2])
    fn(
        setup.kv_tensors,
        setup.pages.tensor,
        setup.plan,
        ids_tensor(blocks, "cuda"),
        ids_tensor(pages, "cuda"),
    )
    after = _all_bytes(setup)
    for a, b in zip(after, valid_only):  # the refused pair skipped whole, the others copied
        assert np.array_equal(a, b)
    with pytest.raises(canonical_ops.CanonicalTransferError, match=r"block id.*pair: 1"):
        canonical_ops.check_device_errors(setup.plan)


# --------------------------------------------------------------------------- validation


def _expect_rejected(setup, fn, args, exc, name):
    before = _all_bytes(setup)
    with pytest.raises(exc) as info:
        fn(*args)
    assert name in str(info.value), str(info.value)
    for a, b in zip(_all_bytes(setup), before):
        assert np.array_equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["store", "load"])
def test_cuda_validation(op):
    setup = _device_id_setup()
    fn = canonical_ops.store if op == "store" else canonical_ops.load
    ids = ids_tensor([1, 2], "cuda")
    kv, pages, plan = setup.kv_tensors, setup.pages.tensor, setup.plan

    unpinned = pages.clone()
    assert not unpinned.is_pinned()
    _expect_rejected(setup, fn, (kv, unpinned, plan, ids, ids), ValueError, "cpu_pages")
    _expect_rejected(setup, fn, (kv, pages.cuda(), plan, ids, ids), ValueError, "cpu_pages")
    _expect_rejected(setup, fn, (kv, pages, plan.cpu(), ids, ids), ValueError, "plan")
    mixed = [kv[0], kv[1].cpu()]
    _expect_rejected(setup, fn, (mixed, pages, plan, ids, ids), ValueError, "kv_caches[1]")
    _expect_rejected(setup, fn, (kv, pages, plan, ids.cpu(), ids), ValueError, "block_ids")
    _expect_rejected(setup, fn, (kv, pages, plan, ids, ids.cpu()), ValueError, "page_ids")
    bad = ids_tensor([1, 99]).pin_memory()
    _expect_rejected(setup, fn, (kv, pages, plan, bad, ids), IndexError, "block_ids")
    _expect_rejected(setup, fn, (kv, pages, plan, ids, bad), IndexError, "page_ids")
    canonical_ops.check_device_errors(plan)  # nothing was launched, nothing reported


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["store", "load"])
def test_device_block_id_in_range_for_one_layer_only_skips_the_whole_pair(op):
    """Layers with 6 and 4 blocks: device block id 5 exists in layer 0 only; the pair is
    skipped in BOTH layers (the README's "skips a bad pair"), the other pairs are copied."""
    setup = _device_id_setup()
    short = dataclasses.replace(
        setup.kv[1], base=setup.kv[1].base[:4], tensor=setup.kv[1].tensor[:4]
    )
    setup.kv[1] = short
    setup.plan = canonical_ops.make_plan(
        setup.layout.mappings, setup.kv_tensors, setup.pages.tensor, pages_per_row=2
    )
    blocks, pages = np.array([0, 5, 3]), np.array([5, 1, 2])
    fn = canonical_ops.store if op == "store" else canonical_ops.load
    expected = _all_bytes(setup)
    reference = ref_store if op == "store" else ref_load
    reference(setup.layout, expected[1:], expected[0], setup.pages, [0, 3], [5, 2])
    fn(setup.kv_tensors, setup.pages.tensor, setup.plan, ids_tensor(blocks, "cuda"),
       ids_tensor(pages, "cuda"))  # fmt: skip
    for a, b in zip(_all_bytes(setup), expected):
        assert np.array_equal(a, b)
    with pytest.raises(canonical_ops.CanonicalTransferError, match="block"):
        canonical_ops.check_device_errors(setup.plan)


# --------------------------------------------------------------------------- plan identity


@pytest.mark.cuda
def test_plan_edited_in_place_after_make_plan_is_never_followed():
    """The kernel reads the registry's own copy of the verified words: editing the plan
    tensor on the device (pages_per_row = 2**48, as in the overflow report) changes nothing."""
    setup = _device_id_setup()
    setup.plan[4] = 2**48
    setup.plan[16 + 4] = 2**63 - 1  # layer 0's area offset
    check_store_and_load(setup)


@pytest.mark.cuda
def test_plan_tensor_at_a_freed_plans_address_is_not_taken_for_it():
    """A tensor allocated where a freed plan was (same length) is verified on its own
    words: a corrupt one is refused, not validated against the dead plan's."""
    setup = _device_id_setup()
    words = setup.plan.clone()
    address, numel = setup.plan.data_ptr(), setup.plan.numel()
    ids = ids_tensor([1, 2], "cuda")
    canonical_ops.store(setup.kv_tensors, setup.pages.tensor, setup.plan, ids, ids)
    setup.plan = None
    torch.cuda.synchronize()
    reused = [torch.empty(numel, dtype=torch.int64, device="cuda") for _ in range(8)]
    same = [t for t in reused if t.data_ptr() == address]
    if not same:
        pytest.skip("the caching allocator did not reuse the freed plan's address")
    impostor = same[0]
    impostor.copy_(words)
    impostor[4] = 2**48  # corrupt: must be refused, not validated with the dead plan's words
    with pytest.raises(ValueError, match="plan: corrupt"):
        canonical_ops.store(setup.kv_tensors, setup.pages.tensor, impostor, ids, ids)


@pytest.mark.cuda
def test_registering_a_plan_tensor_twice_with_other_words_is_refused():
    setup = _device_id_setup()
    host = setup.plan.cpu()
    host[6] += 1  # required_row_bytes
    with pytest.raises(ValueError, match="plan"):
        torch.ops.canonical._register_plan(setup.plan, host, setup.pages.tensor)


# --------------------------------------------------------------------------- capture


@pytest.mark.cuda
def test_capture_refuses_pinned_host_ids_and_unregistered_pages():
    """A captured call only launches: what it would have to ask the driver for (pinned
    host ids' device address, pages never seen outside capture) is refused, not asked."""
    setup = _device_id_setup()
    pinned = ids_tensor([1, 2]).pin_memory()
    device_ids = ids_tensor([1, 2], "cuda")
    other_pages = setup.pages.tensor.clone().pin_memory()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        canonical_ops.store(
            setup.kv_tensors, setup.pages.tensor, setup.plan, device_ids, device_ids
        )
    torch.cuda.synchronize()
    for args, name in (
        ((setup.pages.tensor, pinned, device_ids), "block_ids"),
        ((other_pages, device_ids, device_ids), "cpu_pages"),
    ):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match=name), torch.cuda.graph(graph):
            canonical_ops.store(setup.kv_tensors, args[0], setup.plan, args[1], args[2])
        torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("variant", range(4))
def test_graph_replay_is_bit_exact_for_every_kernel_variant(variant):
    previous = torch.ops.canonical._set_kernel_variant(variant)
    try:
        test_cuda_graph_capture_and_replay_of_store_then_load()
    finally:
        torch.ops.canonical._set_kernel_variant(previous)


# --------------------------------------------------------------------------- build / variants


@pytest.mark.cuda
def test_kernel_image_and_properties_for_this_gpu():
    """The build runs on this GPU (SASS or JIT from the sm_80 PTX); every compiled kernel
    reports sane registers and occupancy."""
    device = torch.cuda.current_device()
    torch.ops.canonical._check_cuda_kernels(device)
    props = np.array(torch.ops.canonical._kernel_properties(device)).reshape(-1, 6)
    assert props.shape == (6, 6)
    lanes, min_blocks, regs, blocks_per_sm, binary, _ptx = props.T
    assert sorted(set(lanes)) == [8, 16, 32] and sorted(set(min_blocks)) == [1, 2]
    assert (regs > 0).all() and (regs[min_blocks == 2] <= 64).all()
    assert (blocks_per_sm >= 1).all() and (blocks_per_sm[min_blocks == 2] >= 2).all()
    assert (binary > 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("variant", range(4))
@pytest.mark.parametrize("seed", [0, 5, 9, 21])
def test_every_kernel_variant_matches_reference(variant, seed):
    previous = torch.ops.canonical._set_kernel_variant(variant)
    try:
        check_store_and_load(build_setup(random_case(seed), device="cuda", pin=True))
    finally:
        torch.ops.canonical._set_kernel_variant(previous)


def test_kernel_variants_are_listed_and_selectable():
    names = torch.ops.canonical._kernel_variants()
    assert names == ["base", "2blk", "deep", "deep2blk"]
    previous = torch.ops.canonical._set_kernel_variant(2)
    try:
        assert torch.ops.canonical._set_kernel_variant(3) == 2
    finally:
        torch.ops.canonical._set_kernel_variant(previous)
    with pytest.raises(ValueError, match="variant"):
        torch.ops.canonical._set_kernel_variant(4)
