"""torch.compile(fullgraph=True) around canonical_ops.store then load (CPU): no graph break,
the same bytes as eager. fullgraph=True raises on any graph break."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers.ops import (
    Case,
    LayerConfig,
    build_setup,
    ids_tensor,
)

import canonical_ops

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def step(kv_src, kv_dst, pages, plan_src, plan_dst, src_blocks, dst_blocks, page_ids):
    """Store blocks of one cache set into canonical pages, then load them into another."""
    canonical_ops.store(kv_src, pages, plan_src, src_blocks, page_ids)
    canonical_ops.load(kv_dst, pages, plan_dst, dst_blocks, page_ids)


# Padded, permuted views over raw bytes (packed NHD and split HND are permutes); TP 2 rank 0
# stores and an identical rank-0 cache set loads.
CASE = Case(
    layers=(
        LayerConfig("full", "packed", "NHD", 16, "bfloat16", 4, pad_elems=8),
        LayerConfig("full", "split", "HND", 8, "float32", 4, pad_elems=4),
        LayerConfig("mla", "packed", "NHD", 24, "float16", 1),
    ),
    tp=2,
    block_size=4,
    rank=0,
    num_blocks=6,
    num_rows=3,
    pages_per_row=2,
    row_pad=16,
    seed=21,
)


def _two_setups():
    """Fresh (src, dst) tensor sets; dst's plan is for an identical cpu_pages geometry, so
    dst loads from src's cpu_pages (the one shared page store)."""
    return build_setup(CASE), build_setup(dataclasses.replace(CASE, seed=CASE.seed + 1))


def _run(fn, seed: int, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run ``fn`` on fresh tensors; (bytes before, bytes after): kv_src..., kv_dst..., pages."""
    src, dst = _two_setups()
    rng = np.random.default_rng(seed)
    num_pages = CASE.num_rows * CASE.pages_per_row
    src_blocks = ids_tensor(rng.choice(CASE.num_blocks, n, replace=False))
    dst_blocks = ids_tensor(rng.choice(CASE.num_blocks, n, replace=False))
    page_ids = ids_tensor(rng.choice(num_pages, n, replace=False))

    def snapshot():
        return [c.host_bytes() for c in src.kv + dst.kv] + [src.pages.host_bytes()]

    before = snapshot()
    fn(
        src.kv_tensors,
        dst.kv_tensors,
        src.pages.tensor,
        src.plan,
        dst.plan,
        src_blocks,
        dst_blocks,
        page_ids,
    )
    return before, snapshot()


def _assert_same(eager, compiled) -> None:
    (eager_before, eager_after), (compiled_before, compiled_after) = eager, compiled
    layers = len(CASE.layers)
    names = [f"kv_src[{i}]" for i in range(layers)] + [f"kv_dst[{i}]" for i in range(layers)]
    for i, name in enumerate([*names, "cpu_pages"]):
        assert np.array_equal(eager_before[i], compiled_before[i]), f"{name}: inputs differ"
        assert np.array_equal(eager_after[i], compiled_after[i]), (
            f"{name}: compiled bytes differ from eager"
        )
        # kv_src is only read; every dst layer and the pages are written.
        changed = not np.array_equal(eager_after[i], eager_before[i])
        assert changed == (not name.startswith("kv_src")), name


def test_compiled_store_then_load_matches_eager():
    eager = _run(step, seed=1, n=4)
    compiled_step = torch.compile(step, fullgraph=True)
    compiled = _run(compiled_step, seed=1, n=4)
    _assert_same(eager, compiled)


def test_compiled_with_dynamic_pair_count_matches_eager():
    compiled_step = torch.compile(step, fullgraph=True, dynamic=True)
    for n in (2, 5, 3):
        _assert_same(_run(step, seed=n, n=n), _run(compiled_step, seed=n, n=n))


def test_compiled_loaded_bytes_are_the_stored_local_pages():
    """End to end under compile: dst blocks hold exactly src blocks' local pages afterwards."""
    compiled_step = torch.compile(step, fullgraph=True)
    src, dst = _two_setups()
    # Even pages: rank 0 is the elected MLA writer of those (2 writers over TP 2).
    src_blocks, dst_blocks, page_ids = ids_tensor([5, 1]), ids_tensor([0, 4]), ids_tensor([2, 4])
    compiled_step(
        src.kv_tensors,
        dst.kv_tensors,
        src.pages.tensor,
        src.plan,
        dst.plan,
        src_blocks,
        dst_blocks,
        page_ids,
    )
    for layer, (s, d) in enumerate(zip(src.kv, dst.kv)):
        page = src.layout.mappings[layer].local_page_size_bytes
        s_bytes, d_bytes = s.host_bytes(), d.host_bytes()
        for sb, db in zip(src_blocks.tolist(), dst_blocks.tolist()):
            assert np.array_equal(d_bytes[db, :page], s_bytes[sb, :page]), (layer, sb, db)
