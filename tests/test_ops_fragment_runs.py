"""The CPU kernel walks a plan's fragments as strided runs: every way a run can start,
break and end must move exactly the bytes of the fragments, on any thread split.

The kernel derives runs (consecutive fragments of one layer and size whose offsets
step by constants) from the verified plan once, and walks them; a thread's share of
the work may start anywhere inside a run. These tests build plans whose fragments
form runs with negative canonical steps, runs broken by a size or step change,
single-fragment runs and runs that cross nothing but a layer boundary, then check
stores and loads against a numpy reference built from the fragments alone, with the
work split over 1 to 7 threads (chunk boundaries fall inside runs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import canonical_ops
from layouts import CanonicalPageMapping, CopyRun

PAGE_BYTES = 4096


def _single(local: int, canonical: int, size: int) -> CopyRun:
    return CopyRun(local, canonical, size, 1, size, size)


def _mapping(runs: list[CopyRun], canonical_page_bytes: int) -> CanonicalPageMapping:
    return CanonicalPageMapping(
        canonical_page_size_bytes=canonical_page_bytes,
        local_page_size_bytes=PAGE_BYTES,
        runs=tuple(runs),
        num_writers=1,
        writer_index=0,
        parallelism_agnostic=False,
    )


def _reversed_heads(size: int) -> CanonicalPageMapping:
    """Local fragments in order, canonical ones in reverse: one run, negative canonical step
    (the plan lists fragments by local offset). Canonical page twice the local one."""
    count = PAGE_BYTES // size
    return _mapping(
        [_single(i * size, 2 * (count - 1 - i) * size, size) for i in range(count)],
        2 * PAGE_BYTES,
    )


def _broken_runs() -> CanonicalPageMapping:
    """Runs broken by a step change, a size change and lone fragments: 64 B x 8 at canonical
    stride 256, then 64 B x 8 at stride 128 from elsewhere, then 512 B, 256 B, 2 KiB... ."""
    runs = [CopyRun(0, 0, 64, 8, 64, 256)]  # local [0, 512), canonical 0, 256, ..., 1792
    runs.append(CopyRun(512, 2048 + 64, 64, 8, 64, 128))  # local [512, 1024)
    runs.append(_single(1024, 8192 - 512, 512))  # local [1024, 1536)
    runs.append(_single(1536, 4096, 256))  # local [1536, 1792)
    runs.append(_single(1792, 4096 + 1024, 256))  # local [1792, 2048): step breaks the pair
    runs.append(CopyRun(2048, 6144, 512, 4, 512, -512))  # local [2048, 4096), canonical down
    return _mapping(runs, 8192)


MAPPINGS = {
    "reversed-256": lambda: [_reversed_heads(256)],
    "reversed-4096": lambda: [_reversed_heads(4096)],
    "broken": lambda: [_broken_runs()],
    "layers": lambda: [_reversed_heads(256), _broken_runs(), _reversed_heads(1024)],
}


def _fragments(mapping: CanonicalPageMapping) -> list[tuple[int, int, int]]:
    out = []
    for run in mapping.runs:
        for i in range(run.num_fragments):
            out.append(
                (
                    run.local_offset + i * run.local_stride,
                    run.canonical_offset + i * run.canonical_stride,
                    run.fragment_size,
                )
            )
    return out


def _areas(mappings: list[CanonicalPageMapping]) -> list[int]:
    return [int(x) for x in np.cumsum([0] + [m.canonical_page_size_bytes for m in mappings])]


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("name", sorted(MAPPINGS))
def test_runs_move_exactly_the_fragments_on_any_thread_split(name, threads):
    mappings = MAPPINGS[name]()
    rng = np.random.default_rng(len(name) * 10 + threads)
    num_blocks, num_pairs = 700, 600  # >= 2.3 MiB a call: several 256 KiB chunks per thread
    kv = [torch.from_numpy(rng.integers(0, 256, (num_blocks, PAGE_BYTES), dtype=np.uint8))]
    kv += [
        torch.from_numpy(rng.integers(0, 256, (num_blocks, PAGE_BYTES), dtype=np.uint8))
        for _ in mappings[1:]
    ]
    areas = _areas(mappings)
    row_bytes = areas[-1]
    pages = torch.from_numpy(rng.integers(0, 256, (num_pairs + 5, row_bytes), dtype=np.uint8))
    plan = canonical_ops.make_plan(mappings, kv, pages)
    blocks = rng.permutation(num_blocks)[:num_pairs]
    page_ids = rng.permutation(num_pairs + 5)[:num_pairs]

    expected_pages = pages.numpy().copy()
    for layer, mapping in enumerate(mappings):
        kv_np = kv[layer].numpy()
        for local, canonical, size in _fragments(mapping):
            start = areas[layer] + canonical
            expected_pages[page_ids, start : start + size] = kv_np[blocks, local : local + size]

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        canonical_ops.store(kv, pages, plan, torch.from_numpy(blocks), torch.from_numpy(page_ids))
        assert np.array_equal(pages.numpy(), expected_pages)

        pages.copy_(torch.from_numpy(rng.integers(0, 256, pages.shape, dtype=np.uint8)))
        source = pages.numpy()
        expected_kv = [t.numpy().copy() for t in kv]
        for layer, mapping in enumerate(mappings):
            for local, canonical, size in _fragments(mapping):
                start = areas[layer] + canonical
                expected_kv[layer][blocks, local : local + size] = source[
                    page_ids, start : start + size
                ]
        canonical_ops.load(kv, pages, plan, torch.from_numpy(blocks), torch.from_numpy(page_ids))
    finally:
        torch.set_num_threads(previous)
    for got, want in zip(kv, expected_kv):
        assert np.array_equal(got.numpy(), want)
