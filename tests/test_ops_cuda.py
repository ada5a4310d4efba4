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
        tensor = flat.as_strided(tuple(old.tensor.shape), tuple(old.tensor.stride()), old.lead)
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
    case = Case(
        layers=(
            LayerConfig("full", "packed", "HND", 16, "bfloat16", 8, pad_elems=8),
            LayerConfig("mla", "packed", "NHD", 24, "float16", 1),
        ),
        tp=1,
        block_size=4,
        num_blocks=6,
        num_rows=3,
        pages_per_row=2,
        seed=51,
    )
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
    untouched = all(np.array_equal(a, b) for a, b in zip(after, before))
    copied_valid = all(np.array_equal(a, b) for a, b in zip(after, valid_only))
    assert untouched or copied_valid
    with pytest.raises(canonical_ops.CanonicalTransferError, match="block"):
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
