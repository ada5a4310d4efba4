"""No input, however wrong, corrupts a byte or crashes the process (CPU ops, make_plan).

* plans edited after make_plan, with values chosen to overflow int64 in the checks;
* ids and plan words changed by another thread while a call runs;
* kv tensors that are not what the mappings (and specs) describe, or no longer what the
  plan was built for;
* repeated destination ids;
* ids that are not integers, through every entry point;
* legal corner cases the checks must not refuse (a 0-byte opaque layer).

Calls that crashed the process before these fixes run in a child process, so a crash is
a test failure rather than the end of the test run.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from helpers.ops import PageLayout, ids_tensor, make_kv_cache, make_pages, ref_load, ref_store

import canonical_ops
from canonical_ops import _extension  # noqa: F401  (registers torch.ops.canonical)
from canonical_ops.plan import FRAGMENT_WORDS, HEADER_WORDS, LAYER_WORDS
from layouts import LayerSpec, derive_group_mappings, opaque_fallback_mapping

BIG_SPEC = LayerSpec("full", 16, 8, 128, "bfloat16", "packed", "NHD")  # 64 KiB pages
GUARD = 1 << 17  # bytes after cpu_pages inside its storage: a write past the rows lands here


def guarded_setup(num_rows: int = 6, num_blocks: int = 4):
    """One 64 KiB-page layer; cpu_pages is the first rows of a larger zeroed storage."""
    mapping = derive_group_mappings(BIG_SPEC, 1, 8)[0]
    kv = torch.randn(num_blocks, 16, 8, 256).to(torch.bfloat16).permute(0, 2, 1, 3)
    row = mapping.canonical_page_size_bytes
    storage = torch.zeros(num_rows * row + GUARD, dtype=torch.uint8)
    pages = storage[: num_rows * row].view(num_rows, row)
    plan = canonical_ops.make_plan([mapping], [kv], pages)
    return mapping, kv, storage, pages, plan


# --------------------------------------------------------------------------- edited plans


def _word(plan: torch.Tensor, layer: int | None = None, fragment: int | None = None) -> int:
    """Index of a layer record's or a fragment record's first word."""
    if layer is not None:
        return HEADER_WORDS + layer * LAYER_WORDS
    num_layers = int(plan[2])
    return HEADER_WORDS + num_layers * LAYER_WORDS + fragment * FRAGMENT_WORDS


@pytest.mark.parametrize(
    ("edit", "names"),
    [
        ("pages_per_row", "pages_per_row"),  # 2**48 x 64 KiB wraps to 0 in the area check
        ("row_bytes", "cpu_pages: plan built for rows"),  # not corrupt: another geometry
        ("area_offset", "area_offset"),
        ("fragment_offset", "canonical_offset"),
        ("fragment_size", "size"),
        ("min_blocks", "min_num_blocks"),
        ("num_writers", "num_writers"),  # memory-safe, but not a plan make_plan builds
        ("reserved", "reserved"),
    ],
)
@pytest.mark.parametrize("op", ["store", "load"])
def test_edited_plan_is_refused_and_writes_nothing(op, edit, names):
    """Each edit would move bytes past cpu_pages' rows (into the guard) if it were trusted."""
    _, kv, storage, pages, plan = guarded_setup()
    bad = plan.clone()
    layer0, frag0 = _word(plan, layer=0), _word(plan, fragment=0)
    if edit == "pages_per_row":
        bad[4] = 2**48
    elif edit == "row_bytes":
        bad[5] = 2**62
    elif edit == "area_offset":
        bad[layer0 + 4] = 2**63 - 2**16
    elif edit == "fragment_offset":
        bad[frag0 + 1] = 2**63 - 1
    elif edit == "fragment_size":
        bad[frag0 + 2] = 2**63 - 1
    elif edit == "min_blocks":
        bad[10] = 2**40
    elif edit == "num_writers":
        bad[layer0 + 5] = 2**63 - 1
    else:
        bad[12] = 7
    before_kv, before_storage = kv.clone(), storage.clone()
    fn = canonical_ops.store if op == "store" else canonical_ops.load
    with pytest.raises(ValueError) as info:
        fn([kv], pages, bad, [1], [5])
    message = str(info.value)
    assert names in message, message
    assert edit == "row_bytes" or message.startswith("plan: corrupt"), message
    assert torch.equal(storage, before_storage) and torch.equal(kv, before_kv)


def _overflowing_plans_child(queue) -> None:
    """In a child process: calls with plan words that crashed the process before."""
    _, kv, _, pages, plan = guarded_setup()
    cases = {
        "pages_per_row 2**48, page id 2**30": ((4, 2**48), [1], [2**30]),
        "fragment offset 2**63-1": ((_word(plan, fragment=0) + 1, 2**63 - 1), [1], [5]),
        "area offset 2**63-1": ((_word(plan, layer=0) + 4, 2**63 - 1), [1], [5]),
        "layer count 2**61": ((2, 2**61), [1], [5]),
        "fragment count 2**62": ((3, 2**62), [1], [5]),
    }
    for name, ((index, value), blocks, page_ids) in cases.items():
        for op in (canonical_ops.store, canonical_ops.load):
            bad = plan.clone()
            bad[index] = value
            try:
                op([kv], pages, bad, blocks, page_ids)
                queue.put(f"{name}: ACCEPTED")
            except ValueError as error:
                queue.put(f"{name}: refused: {str(error).splitlines()[0]}")
    queue.put(None)


def _run_child(forkserver, target, *args, timeout: float = 120) -> list[str]:
    """Run ``target(queue, *args)`` in a forkserver child; its messages, or a failure
    naming how it died."""
    queue = forkserver.Queue()
    child = forkserver.Process(target=target, args=(queue, *args))
    child.start()
    messages: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = queue.get(timeout=0.5)
        except Exception:  # queue.Empty: still running, or dead
            if not child.is_alive():
                break
            continue
        if message is None:
            break
        messages.append(message)
    child.join(10)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, f"child died with exit code {child.exitcode}: {messages}"
    return messages


def test_overflowing_plan_words_never_crash(forkserver):
    """Values that segfaulted the process before the checks were overflow-proof."""
    lines = _run_child(forkserver, _overflowing_plans_child)
    assert len(lines) == 10, lines
    assert all("refused: plan: corrupt" in line for line in lines), lines


EXTREME_WORDS = (-(2**63), -(2**62), -1, 0, 1, 2**31, 2**48, 2**62, 2**63 - 1)


def _every_word_child(queue) -> None:
    """In a child process: every word of a two-layer plan set, in turn, to extreme values;
    each call must be refused or stay inside the tensors (guards after both untouched)."""
    spec = LayerSpec("full", 16, 2, 64, "float16", "split", "HND")
    mappings = derive_group_mappings(spec, 4, 8)
    mapping = mappings[1]
    num_blocks, num_rows, guard = 4, 4, 4096
    kv_storage = [
        torch.zeros(num_blocks * mapping.local_page_size_bytes + guard, dtype=torch.uint8)
    ]
    kv_storage.append(kv_storage[0].clone())
    kv = [
        t[: num_blocks * mapping.local_page_size_bytes]
        .view(torch.float16)
        .view(num_blocks, 2, 2, 16, 64)
        .permute(0, 1, 3, 2, 4)
        for t in kv_storage
    ]
    row = 2 * mapping.canonical_page_size_bytes
    storage = torch.zeros(num_rows * row + guard, dtype=torch.uint8)
    pages = storage[: num_rows * row].view(num_rows, row)
    plan = canonical_ops.make_plan([mapping] * 2, kv, pages, specs=[spec] * 2)
    accepted = 0
    for index in range(len(plan)):
        for value in EXTREME_WORDS:
            bad = plan.clone()
            bad[index] = value
            for op in (canonical_ops.store, canonical_ops.load):
                try:
                    op(kv, pages, bad, [1, 3], [0, 3])
                    accepted += 1
                except (ValueError, IndexError):
                    pass
    clean = not storage[pages.numel() :].any() and not any(t[-guard:].any() for t in kv_storage)
    queue.put(f"{len(plan)} words x {len(EXTREME_WORDS)} values: {accepted} calls accepted")
    queue.put("guards: " + ("clean" if clean else "WRITTEN"))
    queue.put(None)


def test_every_plan_word_at_every_extreme_is_refused_or_harmless(forkserver):
    """A sweep, not a list of known cases: no plan word, whatever its value, makes a call
    crash or write past its tensors."""
    lines = _run_child(forkserver, _every_word_child, timeout=300)
    assert lines[-1] == "guards: clean", lines


# --------------------------------------------------------------------------- racing threads


def _race_child(queue, target: str, seconds: float) -> None:
    """In a child process: another thread flips one id (or a plan fragment's size) between
    a valid and an absurd value while stores and loads run."""
    torch.set_num_threads(2)
    _, kv, storage, pages, plan = guarded_setup(num_rows=64, num_blocks=64)
    blocks = torch.arange(64, dtype=torch.int64)
    page_ids = torch.arange(64, dtype=torch.int64)
    flip = {"block_ids": blocks, "page_ids": page_ids, "plan": plan}[target].numpy()
    # The last id: the copy reads it last, so the window between check and use is widest.
    index = _word(plan, fragment=0) + 2 if target == "plan" else len(flip) - 1
    good, bad = int(flip[index]), 2**40
    stop = threading.Event()

    def flipper() -> None:
        while not stop.is_set():
            flip[index] = bad
            flip[index] = good

    thread = threading.Thread(target=flipper)
    thread.start()
    calls = refused = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for op in (canonical_ops.store, canonical_ops.load):
            try:
                op([kv], pages, plan, blocks, page_ids)
                calls += 1
            except (ValueError, IndexError):
                refused += 1
    stop.set()
    thread.join()
    queue.put(f"{target}: {calls} calls, {refused} refused")
    queue.put("past cpu_pages: " + ("WRITTEN" if storage[pages.numel() :].any() else "clean"))
    queue.put(None)


@pytest.mark.parametrize("target", ["block_ids", "page_ids", "plan"])
def test_ids_and_plan_changed_by_another_thread_during_calls(forkserver, target):
    """Each call uses one consistent, checked copy of the ids and plan words (refused or
    copied); nothing is written outside the tensors. Before: a segfault within ~0.2 s."""
    lines = _run_child(forkserver, _race_child, target, 0.6)
    assert lines[-1] == "past cpu_pages: clean", lines


# --------------------------------------------------------------------------- the tensors


def readme_cache(num_blocks: int = 6) -> tuple[LayerSpec, torch.Tensor]:
    """The README's NHD cache: a permuted view (heads, tokens) over (tokens, heads) storage."""
    spec = LayerSpec("full", 4, 2, 8, "bfloat16", "packed", "NHD")
    return spec, torch.randn(num_blocks, 4, 2, 16).to(torch.bfloat16).permute(0, 2, 1, 3)


def _one_layer_pages(mapping, rows: int = 4) -> torch.Tensor:
    return torch.zeros(rows, mapping.canonical_page_size_bytes, dtype=torch.uint8)


def test_make_plan_refuses_contiguous_copy_of_permuted_nhd_cache():
    """``.contiguous()`` of the README's permuted NHD cache is physically HND."""
    spec, kv = readme_cache()
    mapping = derive_group_mappings(spec, 2, 4)[1]
    pages = _one_layer_pages(mapping)
    canonical_ops.make_plan([mapping], [kv], pages, specs=[spec])  # the right tensor
    with pytest.raises(ValueError, match=r"kv_caches\[0\].*HND"):
        canonical_ops.make_plan([mapping], [kv.contiguous()], pages, specs=[spec])


def test_make_plan_refuses_tensor_of_other_dtype():
    spec, kv = readme_cache()
    mapping = derive_group_mappings(spec, 2, 4)[1]
    as_float = torch.randn(6, 4, 2, 8).permute(0, 2, 1, 3)  # float32, same block bytes
    assert as_float.stride(0) * 4 == kv.stride(0) * 2
    with pytest.raises(ValueError, match=r"kv_caches\[0\].*float32"):
        canonical_ops.make_plan([mapping], [as_float], _one_layer_pages(mapping), specs=[spec])


def test_make_plan_refuses_tp8_mapping_on_two_head_tensor():
    """A 1-head (TP=8 of 8 heads) spec and mapping for a 2-head tensor."""
    spec_tp8 = LayerSpec("full", 4, 1, 8, "bfloat16", "packed", "NHD")
    mapping = derive_group_mappings(spec_tp8, 8, 8)[3]
    _, kv = readme_cache()
    with pytest.raises(ValueError, match=r"kv_caches\[0\]"):
        canonical_ops.make_plan([mapping], [kv], _one_layer_pages(mapping), specs=[spec_tp8])


def test_make_plan_refuses_mapping_page_other_than_spec_page():
    spec, kv = readme_cache()
    other = derive_group_mappings(LayerSpec("full", 4, 1, 8, "bfloat16", "packed", "NHD"), 8, 8)
    # A derived mapping knows its page: a spec naming another one is refused as such.
    with pytest.raises(ValueError, match=r"specs\[0\]: expected the page mappings\[0\] was"):
        canonical_ops.make_plan([other[0]], [kv], _one_layer_pages(other[0]), specs=[spec])
    # A hand-built mapping (no page of its own) whose page is not the spec's.
    bare = dataclasses.replace(other[0], derived_for=None)
    with pytest.raises(ValueError, match=r"mappings\[0\].*specs\[0\]"):
        canonical_ops.make_plan([bare], [kv], _one_layer_pages(bare), specs=[spec])


def test_make_plan_specs_argument_checked():
    spec, kv = readme_cache()
    mapping = derive_group_mappings(spec, 2, 4)[1]
    pages = _one_layer_pages(mapping)
    with pytest.raises(ValueError, match="specs"):
        canonical_ops.make_plan([mapping], [kv], pages, specs=[spec, spec])
    with pytest.raises(TypeError, match=r"specs\[0\]"):
        canonical_ops.make_plan([mapping], [kv], pages, specs=["NHD"])
    plan = canonical_ops.make_plan([mapping], [kv], pages, specs=[None])  # the mapping's own
    assert plan.dtype == torch.int64
    with pytest.raises(ValueError, match=r"kv_caches\[0\].*derived for it"):  # still checked
        canonical_ops.make_plan([mapping], [kv.contiguous()], pages, specs=[None])


@pytest.mark.parametrize("change", ["contiguous", "dtype", "shape"])
@pytest.mark.parametrize("op", ["store", "load"])
def test_calls_refuse_tensors_other_than_the_plans(op, change):
    """Same block stride and count, but not the tensor the plan was built for: the calls
    name kv_caches[l] and what changed, and write nothing."""
    spec, kv = readme_cache()
    mapping = derive_group_mappings(spec, 2, 4)[1]
    pages = _one_layer_pages(mapping)
    plan = canonical_ops.make_plan([mapping], [kv], pages)
    if change == "contiguous":
        other, what = kv.contiguous(), "strides"
    elif change == "dtype":
        other, what = kv.view(torch.int16), "Short"
    else:
        other, what = kv[:, :, :, :8], "shape"
    assert other.stride(0) * other.element_size() == kv.stride(0) * kv.element_size()
    before_kv, before_pages = other.clone(), pages.clone()
    fn = canonical_ops.store if op == "store" else canonical_ops.load
    with pytest.raises(ValueError, match=r"kv_caches\[0\]: plan built for.*") as info:
        fn([other], pages, plan, [1], [2])
    assert what in str(info.value)
    assert torch.equal(other, before_kv) and torch.equal(pages, before_pages)


# --------------------------------------------------------------------------- destinations


@pytest.mark.parametrize("wrapper", [True, False], ids=["wrapper", "raw-op"])
def test_store_refuses_repeated_page_ids(wrapper):
    """64 stores into page 0 would leave it a torn mix of two blocks."""
    _, kv, _, pages, plan = guarded_setup(num_rows=2, num_blocks=64)
    blocks, page_ids = list(range(64)), [0] * 64
    before = pages.clone()
    with pytest.raises(ValueError, match=r"page_ids\[0\] and page_ids\[1\] are both 0"):
        if wrapper:
            canonical_ops.store([kv], pages, plan, blocks, page_ids)
        else:
            torch.ops.canonical.canonical_store(
                [kv], pages, plan, ids_tensor(blocks), ids_tensor(page_ids)
            )
    assert torch.equal(pages, before)


@pytest.mark.parametrize("wrapper", [True, False], ids=["wrapper", "raw-op"])
def test_load_refuses_repeated_block_ids(wrapper):
    _, kv, _, pages, plan = guarded_setup(num_rows=3)
    before = kv.clone()
    with pytest.raises(ValueError, match=r"block_ids\[0\] and block_ids\[2\] are both 1"):
        if wrapper:
            canonical_ops.load([kv], pages, plan, [1, 0, 1], [0, 1, 2])
        else:
            torch.ops.canonical.canonical_load(
                [kv], pages, plan, ids_tensor([1, 0, 1]), ids_tensor([0, 1, 2])
            )
    assert torch.equal(kv, before)


def test_repeated_sources_are_fine():
    """One block stored into two pages; one page loaded into two blocks."""
    rng = np.random.default_rng(5)
    spec = LayerSpec("full", 4, 2, 8, "float16", "split", "HND")
    mapping = derive_group_mappings(spec, 2, 4)[0]
    cache = make_kv_cache(spec, 4, rng, pad_bytes=4)
    layout = PageLayout.default([mapping], 2)
    pages = make_pages(2, layout.row_bytes, rng, row_pad=3)
    plan = canonical_ops.make_plan([mapping], [cache.tensor], pages.tensor, pages_per_row=2)
    blocks, page_ids = np.array([2, 2]), np.array([3, 0])
    expected = pages.host_bytes()
    ref_store(layout, [cache.host_bytes()], expected, pages, blocks, page_ids)
    canonical_ops.store([cache.tensor], pages.tensor, plan, blocks, page_ids)
    assert np.array_equal(pages.host_bytes(), expected)
    blocks, page_ids = np.array([0, 3]), np.array([1, 1])
    expected_kv = [cache.host_bytes()]
    ref_load(layout, expected_kv, pages.host_bytes(), pages, blocks, page_ids)
    canonical_ops.load([cache.tensor], pages.tensor, plan, blocks, page_ids)
    assert np.array_equal(cache.host_bytes(), expected_kv[0])


# --------------------------------------------------------------------------- id types

NOT_INT_IDS = [[1.9], ["3"], [True], np.array([1.0]), torch.tensor([1.0]), torch.tensor([True])]


@pytest.mark.parametrize("bad", NOT_INT_IDS, ids=lambda v: type(v).__name__ + repr(v)[:12])
@pytest.mark.parametrize("name", ["block_ids", "page_ids"])
def test_every_path_refuses_ids_that_are_not_integers(name, bad):
    """Wrappers, the raw ops and the private reporting ops: never rounded, nothing written."""
    _, kv, _, pages, plan = guarded_setup()
    good = {"block_ids": [1], "page_ids": [0]}
    before_kv, before_pages = kv.clone(), pages.clone()
    for fn in (canonical_ops.store, canonical_ops.load):
        args = {**good, name: bad}
        with pytest.raises(TypeError, match=name):
            fn([kv], pages, plan, args["block_ids"], args["page_ids"])
    record = torch.zeros(4, dtype=torch.int64)
    raw_ops = (
        lambda b, p: torch.ops.canonical.canonical_store([kv], pages, plan, b, p),
        lambda b, p: torch.ops.canonical.canonical_load([kv], pages, plan, b, p),
        lambda b, p: torch.ops.canonical._canonical_store_reporting(
            [kv], pages, plan, b, p, record
        ),
        lambda b, p: torch.ops.canonical._canonical_load_reporting([kv], pages, plan, b, p, record),
    )
    for fn in raw_ops:
        args = {"block_ids": ids_tensor([1]), "page_ids": ids_tensor([0]), name: bad}
        # Non-tensors: the dispatcher's schema check (RuntimeError naming the argument);
        # tensors of another dtype: the op's TypeError.
        with pytest.raises((TypeError, RuntimeError), match=name):
            fn(args["block_ids"], args["page_ids"])
    assert torch.equal(kv, before_kv) and torch.equal(pages, before_pages)
    assert not record.any()


# --------------------------------------------------------------------------- legal corners


@pytest.mark.parametrize("op", ["store", "load"])
def test_zero_byte_opaque_layer_is_planned_and_moves_nothing(op):
    """A 0-byte page is legal (a block shorter than one compressed state); its plan layer
    has no fragment and the other layers move as usual."""
    rng = np.random.default_rng(12)
    spec = LayerSpec("mla", 4, 1, 16, "float16", "packed", "NHD")
    mappings = [opaque_fallback_mapping(0, 2, 1), derive_group_mappings(spec, 2, 1)[1]]
    assert mappings[0].fragments()[:, 2].tolist() == [0]
    empty = torch.zeros(5, 8, dtype=torch.uint8)  # blocks of 8 bytes, none of them moved
    cache = make_kv_cache(spec, 5, rng)
    layout = PageLayout.default(mappings, 2)
    pages = make_pages(2, layout.row_bytes, rng)
    plan = canonical_ops.make_plan(mappings, [empty, cache.tensor], pages.tensor, pages_per_row=2)
    assert int(plan[3]) == 1  # one fragment in all: the MLA row block
    blocks, page_ids = np.array([4, 0]), np.array([1, 3])
    if op == "store":
        expected = pages.host_bytes()
        ref_store(
            layout, [empty.numpy().copy(), cache.host_bytes()], expected, pages, blocks, page_ids
        )
        canonical_ops.store([empty, cache.tensor], pages.tensor, plan, blocks, page_ids)
        assert np.array_equal(pages.host_bytes(), expected)
    else:
        expected_kv = [empty.numpy().copy(), cache.host_bytes()]
        ref_load(layout, expected_kv, pages.host_bytes(), pages, blocks, page_ids)
        canonical_ops.load([empty, cache.tensor], pages.tensor, plan, blocks, page_ids)
        assert np.array_equal(cache.host_bytes(), expected_kv[1])
        assert not empty.any()


def test_min_num_blocks_is_in_the_plan_header():
    rng = np.random.default_rng(3)
    spec = LayerSpec("mla", 4, 1, 16, "float16", "packed", "NHD")
    mapping = derive_group_mappings(spec, 1, 1)[0]
    kv = [make_kv_cache(spec, 6, rng).tensor, make_kv_cache(spec, 4, rng).tensor]
    pages = make_pages(4, PageLayout.default([mapping] * 2, 1).row_bytes, rng)
    plan = canonical_ops.make_plan([mapping, mapping], kv, pages.tensor)
    assert int(plan[10]) == 4
