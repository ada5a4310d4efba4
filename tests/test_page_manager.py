"""PageManager: readiness after every elected writer, prefix lookup, LRU, pins, failures."""

from __future__ import annotations

import math
import random
import threading
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from canonical_ops.engine.pages import PageCapacityError, PageManager, PageStateError
from layouts import LayerSpec, derive_group_mappings, opaque_fallback_mapping

# --------------------------------------------------------------------------- helpers


def gqa(heads_per_rank: int = 1) -> LayerSpec:
    return LayerSpec("full", 16, heads_per_rank, 128, "bfloat16", "packed", "NHD")


def mla() -> LayerSpec:
    return LayerSpec("mla", 16, 1, 576, "bfloat16", "packed", "NHD")


def gqa2_tp4():
    """2 KV heads at TP 4: each head replicated on 2 ranks, writers rotate by page."""
    return derive_group_mappings(gqa(1), tp_size=4, total_kv_heads=2)


def mla_tp4(dcp: int = 1):
    return derive_group_mappings(mla(), tp_size=4, total_kv_heads=1, dcp_size=dcp)


def sharded_tp4():
    """8 KV heads at TP 4: every rank owns distinct heads, so every rank writes every page."""
    return derive_group_mappings(gqa(2), tp_size=4, total_kv_heads=8)


def report(pm: PageManager, page: int, rank: int) -> bool:
    """``rank``'s report of the current store of ``page`` (its current generation)."""
    return pm.complete_store(page, rank, generation=pm.generation(page))


def store_all(pm: PageManager, block_hashes) -> list[int]:
    """Allocate and fully complete a store of ``block_hashes``; return their pages."""
    pages = pm.allocate(block_hashes)
    for page in pages:
        assert page is not None
        for rank in sorted(pm.writer_ranks(page)):
            report(pm, page, rank)
    return pages


def check_invariants(pm: PageManager) -> None:
    """The manager's bookkeeping agrees with itself (its private state, under its lock)."""
    with pm._lock:
        states = pm._state
        assert states.count("free") == len(pm._free) == len(set(pm._free))
        assert states.count("pending") == len(pm._pending)
        assert states.count("ready") == pm._num_ready
        assert len(pm._page_of) == len(pm._pending) + pm._num_ready
        for block_hash, page in pm._page_of.items():
            assert pm._hash_of[page] == block_hash and states[page] != "free"
        for page, state in enumerate(states):
            assert (pm._hash_of[page] is None) == (state == "free")
            assert (page in pm._evictable) == (state == "ready" and not pm._refcount[page])
            assert pm._refcount[page] >= 0 and (state == "ready" or not pm._refcount[page])
            assert state == "free" or pm._generation[page] >= 1
        for page, store in pm._pending.items():
            assert store.filler is None or not store.writers
            assert pm._writers[page] == store.writers
        live = {page for *key, page in pm._heap if pm._evictable.get(page) == tuple(key)}
        assert live == set(pm._evictable), "an evictable page has no live heap entry"
        for page, key in pm._evictable.items():
            assert key == pm._last_use[page]


def page_view(pm: PageManager, page: int) -> tuple:
    """Everything observable about one page."""
    state = pm.state(page)
    waiting = pm.pending_writers(page) if state == "pending" else None
    return state, pm.hash_of(page), pm.refcount(page), pm.generation(page), waiting


def snapshot(pm: PageManager):
    return [page_view(pm, p) for p in range(pm.num_pages)], pm.num_free, pm.num_evictable


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_pages": 0}, ValueError, "num_pages"),
        ({"num_pages": -3}, ValueError, "num_pages"),
        ({"num_pages": 2.0}, TypeError, "num_pages"),
        ({"num_pages": True}, TypeError, "num_pages"),
        ({"num_pages": 4, "num_ranks": 0}, ValueError, "num_ranks"),
        ({"num_pages": 4, "writer_ranks": {0, 1}}, TypeError, "writer_ranks"),
    ],
)
def test_constructor_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        PageManager(**kwargs)


def test_default_writers_are_all_ranks():
    pm = PageManager(3, num_ranks=3)
    (page,) = pm.allocate([b"a"])
    assert pm.writer_ranks(page) == frozenset({0, 1, 2})
    assert report(pm, page, 2) is False
    assert report(pm, page, 0) is False
    assert pm.state(page) == "pending" and pm.lookup([b"a"]) == 0
    assert report(pm, page, 1) is True
    assert pm.state(page) == "ready" and pm.lookup([b"a"]) == 1
    single = PageManager(1)
    (page,) = single.allocate([7])
    assert report(single, page, 0) is True


def test_from_mappings_validation():
    with pytest.raises(ValueError, match="at least one layer"):
        PageManager.from_mappings(4, [])
    with pytest.raises(ValueError, match=r"layer_group_mappings\[0\]"):
        PageManager.from_mappings(4, [()])
    with pytest.raises(ValueError, match=r"layer_group_mappings\[1\]: expected 4 ranks"):
        PageManager.from_mappings(4, [gqa2_tp4(), mla_tp4()[:2]])
    with pytest.raises(TypeError, match=r"layer_group_mappings\[0\]\[1\]"):
        PageManager.from_mappings(4, [(gqa2_tp4()[0], object())])
    # A layer where pages 1 mod 2 have no elected writer could never be complete.
    lonely = (mla_tp4(dcp=2)[0],) * 2  # both ranks are writer 0 of 2
    with pytest.raises(ValueError, match="no rank is the elected writer"):
        PageManager.from_mappings(4, [lonely])
    with pytest.raises(ValueError, match="num_pages"):
        PageManager.from_mappings(0, [gqa2_tp4()])


# --------------------------------------------------------------------------- real mappings


def test_replicated_gqa_writers_rotate_per_page():
    mappings = gqa2_tp4()
    assert [m.num_writers for m in mappings] == [2, 2, 2, 2]
    pm = PageManager.from_mappings(8, [mappings])
    assert pm.num_ranks == 4
    for page in range(8):
        expected = frozenset({0, 2}) if page % 2 == 0 else frozenset({1, 3})
        assert pm.writer_ranks(page) == expected
        assert expected == {r for r, m in enumerate(mappings) if m.is_writer(page)}

    even, odd = pm.allocate([b"h0", b"h1"])
    assert (even, odd) == (0, 1)
    with pytest.raises(PageStateError, match="not an elected writer"):
        report(pm, even, 1)
    assert report(pm, even, 0) is False
    assert pm.pending_writers(even) == frozenset({2})
    assert pm.state(even) == "pending"
    assert pm.lookup([b"h0", b"h1"]) == 0
    assert report(pm, even, 2) is True
    assert pm.lookup([b"h0", b"h1"]) == 1
    assert report(pm, odd, 3) is False
    assert report(pm, odd, 1) is True
    assert pm.lookup([b"h0", b"h1"]) == 2


def test_mla_single_writer_per_page():
    mappings = mla_tp4()
    pm = PageManager.from_mappings(8, [mappings])
    pages = pm.allocate([f"b{i}" for i in range(8)])
    for page in pages:
        assert pm.writer_ranks(page) == frozenset({page % 4})
        for other in set(range(4)) - {page % 4}:
            with pytest.raises(PageStateError, match="not an elected writer"):
                report(pm, page, other)
        assert report(pm, page, page % 4) is True
    assert pm.num_ready == 8


def test_mixed_layers_take_the_union_of_writers():
    layers = [gqa2_tp4(), mla_tp4(dcp=2), gqa2_tp4()]
    pm = PageManager.from_mappings(12, layers)
    period = math.lcm(*(m.num_writers for layer in layers for m in layer))
    for page in range(12):
        expected = {r for layer in layers for r, m in enumerate(layer) if m.is_writer(page)}
        assert pm.writer_ranks(page) == frozenset(expected)
        assert pm.writer_ranks(page) == pm.writer_ranks(page % period)
    # GQA: {0,2} / {1,3}; MLA with DCP 2: {0,1} / {2,3}.
    assert pm.writer_ranks(0) == frozenset({0, 1, 2})
    assert pm.writer_ranks(1) == frozenset({1, 2, 3})

    (page,) = pm.allocate(["x"])
    assert page == 0
    assert not report(pm, page, 0)
    assert not report(pm, page, 2)  # all GQA bytes are in; the MLA half of rank 1 is not
    assert pm.lookup(["x"]) == 0
    assert report(pm, page, 1)
    assert pm.lookup(["x"]) == 1

    with_sharded = PageManager.from_mappings(4, [mla_tp4(), sharded_tp4()])
    assert all(with_sharded.writer_ranks(p) == frozenset(range(4)) for p in range(4))


def test_opaque_fallback_needs_every_rank():
    group = tuple(opaque_fallback_mapping(4096, 4, r) for r in range(4))
    pm = PageManager.from_mappings(2, [group, mla_tp4()])
    assert pm.writer_ranks(0) == pm.writer_ranks(1) == frozenset(range(4))


# --------------------------------------------------------------------------- lookup and allocate


def test_lookup_longest_ready_prefix():
    pm = PageManager(8, num_ranks=2)
    store_all(pm, ["a", "b"])
    (pending,) = pm.allocate(["c"])
    store_all(pm, ["d"])
    assert pm.lookup([]) == 0
    assert pm.lookup(["a", "b", "c", "d"]) == 2  # pending "c" ends the prefix
    assert pm.lookup(["a", "zz", "b"]) == 1  # unknown hash ends it
    assert pm.lookup(["zz", "a"]) == 0
    assert pm.lookup(["d"]) == 1
    report(pm, pending, 0)
    report(pm, pending, 1)
    assert pm.lookup(iter(["a", "b", "c", "d"])) == 4


def test_allocate_aligns_none_for_present_and_repeated_hashes():
    pm = PageManager(8, num_ranks=2)
    (ready,) = store_all(pm, ["r"])
    (pending,) = pm.allocate(["p"])
    out = pm.allocate(["n1", "r", "p", "n1", "n2"])
    assert out[1:4] == [None, None, None]
    assert None not in (out[0], out[4]) and out[0] != out[4]
    assert {ready, pending}.isdisjoint({out[0], out[4]})
    assert pm.state(out[0]) == pm.state(out[4]) == "pending"
    assert pm.page_of("n1") == out[0] and pm.hash_of(out[4]) == "n2"
    assert pm.allocate(["r", "p"]) == [None, None]
    assert pm.allocate([]) == []
    assert pm.num_pending == 3 and pm.num_ready == 1 and pm.num_free == 4


def test_allocate_rejects_bad_hashes():
    pm = PageManager(4)
    with pytest.raises(TypeError, match="single bytes"):
        pm.allocate(b"abc")
    with pytest.raises(ValueError, match=r"block_hashes\[1\]: None"):
        pm.allocate(["a", None])
    with pytest.raises(TypeError, match=r"block_hashes\[0\]: expected a hashable"):
        pm.allocate([["unhashable"]])
    assert pm.num_free == 4


def test_lru_evicts_least_recently_used_ready_pages():
    pm = PageManager(4)
    pages = {h: store_all(pm, [h])[0] for h in "abcd"}  # used in order a, b, c, d
    assert pm.num_free == 0
    assert pm.lookup(["a"]) == 1  # a is now the most recent: LRU order b, c, d, a
    (e,) = pm.allocate(["e"])
    assert e == pages["b"] and pm.page_of("b") is None and pm.hash_of(e) == "e"
    assert pm.lookup(["b"]) == 0
    # Two more evict c then d, never the touched a nor the pending e.
    f, g = pm.allocate(["f", "g"])
    assert {f, g} == {pages["c"], pages["d"]}
    assert pm.page_of("a") == pages["a"] and pm.state(e) == "pending"
    with pytest.raises(PageCapacityError):
        pm.allocate(["h", "i"])  # only a is evictable; e, f, g are pending


def test_fresh_prefix_loses_its_tail_first():
    """A stored 4-block prefix used to lose its head first (pages turned evictable in
    completion order), leaving 3 cached tail blocks that no lookup can ever reach."""
    pm = PageManager(5)
    prefix = ["h0", "h1", "h2", "h3"]
    pages = pm.allocate(prefix)
    for page in pages:  # completed head first, as stores usually finish
        report(pm, page, 0)
    store_all(pm, ["other"])  # allocated later: more recent than the whole prefix
    pm.allocate(["n1"])
    assert pm.page_of("h3") is None  # the tail went
    assert pm.lookup(prefix) == 3
    pm.allocate(["n2"])  # the lookup used h0..h2 again, so "other" is the oldest now
    assert pm.page_of("other") is None and pm.lookup(prefix) == 3
    pm.allocate(["n3", "n4"])
    assert [pm.page_of(h) is not None for h in prefix] == [True, False, False, False]
    assert pm.lookup(prefix) == 1


def test_completion_order_does_not_change_eviction_order():
    pm = PageManager(3)
    a, b, c = pm.allocate(["a", "b", "c"])
    for page in (b, a, c):  # completion order used to be the eviction order
        report(pm, page, 0)
    pm.allocate(["x"])
    assert pm.page_of("c") is None
    pm.allocate(["y"])
    assert pm.page_of("b") is None and pm.page_of("a") == a


def test_release_uses_pages_head_most_recent():
    pm = PageManager(3)
    pages = store_all(pm, ["a", "b", "c"])
    pm.acquire(["a", "b", "c"])
    pm.release(pages)
    pm.allocate(["x"])
    assert pm.page_of("c") is None
    pm.allocate(["y"])
    assert pm.page_of("b") is None and pm.page_of("a") is not None


def test_lookup_touches_prefix_tail_first():
    pm = PageManager(3)
    store_all(pm, ["x", "y", "z"])
    pm.lookup(["z", "y", "x"])  # head z most recent; order x, y, z (tail x oldest)
    (page,) = pm.allocate(["n"])
    assert pm.page_of("x") is None and pm.hash_of(page) == "n"
    (page,) = pm.allocate(["m"])
    assert pm.page_of("y") is None and pm.page_of("z") is not None


def test_allocate_never_evicts_hashes_of_its_own_request():
    pm = PageManager(2)
    store_all(pm, ["old", "keep"])
    pm.lookup(["old"])  # keep is now the least recently used
    out = pm.allocate(["keep", "new"])
    assert out[0] is None and pm.page_of("keep") is not None and pm.page_of("old") is None
    with pytest.raises(PageCapacityError) as info:
        pm.allocate(["keep", "new", "newer"])
    assert (info.value.needed, info.value.free, info.value.evictable) == (1, 0, 0)


def test_refcount_protects_pages_from_eviction():
    pm = PageManager(3)
    a, b, c = store_all(pm, ["a", "b", "c"])
    assert pm.acquire(["a", "b"]) == [a, b]
    assert pm.refcount(a) == 1 and pm.num_evictable == 1
    (d,) = pm.allocate(["d"])
    assert d == c  # a and b are older but pinned
    before = snapshot(pm)
    with pytest.raises(PageCapacityError, match="0 free and 0 evictable"):
        pm.allocate(["e"])
    assert snapshot(pm) == before
    pm.release([b])  # b evictable again, a still pinned
    (e,) = pm.allocate(["e"])
    assert e == b and pm.page_of("a") == a and pm.state(a) == "ready"
    pm.release([a])
    assert pm.refcount(a) == 0 and pm.num_evictable == 1


def test_acquire_twice_needs_two_releases():
    pm = PageManager(2)
    (a,) = store_all(pm, ["a"])
    assert pm.acquire(["a", "a"]) == [a, a]
    assert pm.acquire(["a"]) == [a]
    assert pm.refcount(a) == 3
    with pytest.raises(PageStateError, match="released 4 time"):
        pm.release([a, a, a, a])
    assert pm.refcount(a) == 3
    pm.release([a, a])
    pm.release([a])
    with pytest.raises(PageStateError, match="held by 0"):
        pm.release([a])


def test_capacity_error_allocates_nothing():
    pm = PageManager(4, num_ranks=2)
    store_all(pm, ["r1", "r2"])
    pm.acquire(["r2"])
    pm.allocate(["p"])  # one free page left; r1 evictable; r2 pinned; p pending
    before = snapshot(pm)
    with pytest.raises(PageCapacityError) as info:
        pm.allocate(["x", "y", "z", "r1"])
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.needed, err.free, err.evictable) == (3, 1, 0)  # r1 is in the request
    assert "3 canonical page(s)" in str(err) and "Nothing was allocated" in str(err)
    with pytest.raises(PageCapacityError) as info:
        pm.allocate(["x", "y", "z"])
    assert (info.value.needed, info.value.free, info.value.evictable) == (3, 1, 1)
    assert snapshot(pm) == before
    assert pm.page_of("x") is None and pm.lookup(["r1"]) == 1
    assert pm.allocate(["x", "y"]) != [None, None]  # exactly fits: free page + r1


# --------------------------------------------------------------------------- completion errors


def test_complete_store_errors():
    pm = PageManager.from_mappings(4, [gqa2_tp4()])
    (page,) = pm.allocate(["a"])
    with pytest.raises(PageStateError, match=r"page_id: expected an int in \[0, 3\], got 4"):
        pm.complete_store(4, 0, generation=1)
    with pytest.raises(PageStateError, match=r"page_id: expected an int in \[0, 3\], got -1"):
        pm.complete_store(-1, 0, generation=1)
    with pytest.raises(TypeError, match="page_id: expected an int"):
        pm.complete_store("0", 0, generation=1)
    with pytest.raises(PageStateError, match=r"rank: expected an int in \[0, 3\], got 4"):
        pm.complete_store(page, 4, generation=1)
    with pytest.raises(TypeError, match="rank: expected an int"):
        pm.complete_store(page, True, generation=1)
    with pytest.raises(TypeError, match="generation"):
        pm.complete_store(page, 0)  # required: a report without it could be a late one
    with pytest.raises(TypeError, match="generation: expected an int"):
        pm.complete_store(page, 0, generation=1.0)
    with pytest.raises(PageStateError, match=r"generation: expected an int >= 1, got 0"):
        pm.complete_store(page, 0, generation=0)
    with pytest.raises(
        PageStateError,
        match=r"generation: expected page 0's current generation 1, got 2: .*never allocated",
    ):
        pm.complete_store(page, 0, generation=2)
    assert pm.pending_writers(page) == frozenset({0, 2})  # nothing counted
    with pytest.raises(PageStateError, match=r"current generation 0, got 1: .*never allocated"):
        pm.complete_store(1, 1, generation=1)  # page 1 is free, never allocated
    with pytest.raises(
        PageStateError, match=r"not an elected writer of page 0 \(writers: \[0, 2\]"
    ):
        report(pm, page, 3)
    assert report(pm, page, 0) is False
    with pytest.raises(PageStateError, match="rank 0 already reported page 0"):
        report(pm, page, 0)
    assert pm.pending_writers(page) == frozenset({2})
    assert report(pm, page, 2) is True
    with pytest.raises(PageStateError, match="page 0 is ready, not pending"):
        report(pm, page, 2)
    with pytest.raises(PageStateError, match="not pending"):
        pm.pending_writers(page)
    assert isinstance(PageStateError("x"), ValueError)


def test_bad_writer_ranks_callable_is_reported_and_allocates_nothing():
    pm = PageManager(4, lambda p: frozenset() if p == 1 else frozenset({0}), num_ranks=2)
    with pytest.raises(
        ValueError,
        match=r"writer_ranks\(1\): expected a non-empty set of ranks in \[0, 2\), got frozenset\(\)",
    ):
        pm.allocate(["a", "b"])
    assert pm.num_free == 4 and pm.page_of("a") is None
    pm = PageManager(4, lambda p: {p}, num_ranks=2)
    assert pm.allocate(["a", "b"]) == [0, 1]  # a plain set is accepted
    with pytest.raises(
        ValueError,
        match=r"writer_ranks\(2\): expected a non-empty set of ranks in \[0, 2\), got \{2\}",
    ):
        pm.allocate(["c"])
    assert pm.num_free == 2


def test_acquire_refuses_pending_and_unknown_hashes():
    pm = PageManager(4, num_ranks=2)
    (a,) = store_all(pm, ["a"])
    pm.allocate(["p"])
    with pytest.raises(PageStateError, match=r"block_hashes\[1\].*pending"):
        pm.acquire(["a", "p"])
    with pytest.raises(PageStateError, match=r"block_hashes\[1\].*unknown"):
        pm.acquire(["a", "zz"])
    assert pm.refcount(a) == 0 and pm.num_evictable == 1
    with pytest.raises(
        PageStateError, match=r"page_ids\[0\]: expected an int in \[0, \d+\], got 9"
    ):
        pm.release([9])


# --------------------------------------------------------------------------- failures


def test_fail_store_frees_pending_pages_only():
    pm = PageManager(4, num_ranks=2)
    (ready,) = store_all(pm, ["r"])
    p1, p2 = pm.allocate(["p1", "p2"])
    report(pm, p1, 0)
    free_page = next(p for p in range(4) if pm.state(p) == "free")
    with pytest.raises(
        PageStateError, match=r"page_ids\[1\]: expected an int in \[0, \d+\], got 7"
    ):
        pm.fail_store([p1, 7])
    assert pm.state(p1) == "pending"  # nothing failed
    assert pm.fail_store([ready, p1, free_page, p1]) == [p1]
    assert pm.state(p1) == "free" and pm.page_of("p1") is None and pm.hash_of(p1) is None
    assert pm.state(ready) == "ready" and pm.state(p2) == "pending"
    with pytest.raises(PageStateError, match="not pending"):
        report(pm, p1, 1)  # the late report of the failed store
    assert pm.lookup(["p1"]) == 0
    # The hash can be stored again from scratch.
    (again,) = pm.allocate(["p1"])
    assert pm.pending_writers(again) == frozenset({0, 1})
    assert pm.num_free + pm.num_pending + pm.num_ready == 4


def test_a_dead_writers_page_is_never_ready_and_fail_store_frees_it():
    pm = PageManager.from_mappings(6, [gqa2_tp4()])
    dead, done = pm.allocate(["dead", "done"])  # pages 0 (ranks 0, 2), 1 (ranks 1, 3)
    dead_generation = pm.generation(dead)
    report(pm, dead, 0)  # rank 2 is SIGKILLed before reporting
    report(pm, done, 1)
    report(pm, done, 3)
    (young,) = pm.allocate(["young"])
    report(pm, young, 0)
    pm.acquire(["done"])
    assert pm.lookup(["dead"]) == 0 and pm.state(dead) == "pending"
    # The engine learns rank 2 died: it fails that rank's in-flight pages.
    assert pm.fail_store([dead, done], generations=[dead_generation, 1]) == [dead]
    assert pm.state(dead) == "free" and pm.page_of("dead") is None
    with pytest.raises(PageStateError):
        pm.acquire(["dead"])
    with pytest.raises(PageStateError, match="not pending"):
        pm.complete_store(dead, 2, generation=dead_generation)  # its report, at last
    # Other pages are untouched: the ready pinned page, the young pending one.
    assert pm.state(done) == "ready" and pm.refcount(done) == 1
    assert pm.state(young) == "pending" and pm.pending_writers(young) == frozenset({2})
    assert report(pm, young, 2) is True
    (reused,) = pm.allocate(["dead"])
    assert pm.state(reused) == "pending" and pm.generation(reused) == 1 + (reused == dead)


def test_late_report_of_a_failed_store_is_refused():
    """A slow writer's report used to count toward the block its page was re-allocated to:
    the page turned ready although that writer never wrote the new block."""
    pm = PageManager(1, num_ranks=2)
    (page,) = pm.allocate(["old"])
    old_generation = pm.generation(page)
    assert pm.complete_store(page, 0, generation=old_generation) is False  # rank 1 is slow
    assert pm.fail_store([page]) == [page]
    (again,) = pm.allocate(["new"])
    assert again == page and pm.generation(page) == old_generation + 1
    with pytest.raises(
        PageStateError,
        match=r"generation: expected page 0's current generation 2, got 1: the store of "
        r"generation 1 was abandoned",
    ):
        pm.complete_store(page, 1, generation=old_generation)  # the slow writer, at last
    assert pm.pending_writers(page) == frozenset({0, 1})
    assert pm.complete_store(page, 0, generation=2) is False
    assert pm.lookup(["new"]) == 0  # rank 1 has not written "new"
    assert pm.complete_store(page, 1, generation=2) is True
    assert pm.generation(page) == 2


def test_fail_store_with_generations_skips_reallocated_pages():
    pm = PageManager(2, num_ranks=2)
    old, other = pm.allocate(["old", "other"])
    assert pm.fail_store([old, other]) == [old, other]
    (new,) = pm.allocate(["new"])
    assert new == old
    with pytest.raises(PageStateError, match="generations: expected one per page id"):
        pm.fail_store([new], generations=[1, 2])
    assert pm.fail_store([new], generations=[1]) == []  # the old store's failure, late
    assert pm.page_of("new") == new
    assert pm.fail_store([new], generations=[2]) == [new]


def test_a_fill_turns_ready_only_when_its_tier_reports_it():
    pm = PageManager(4, num_ranks=2)
    [page] = pm.allocate([b"h"], filler="files")
    generation = pm.generation(page)
    assert pm.state(page) == "pending" and pm.num_filling == 1
    assert pm.pending_writers(page) == frozenset() and pm.writer_ranks(page) == frozenset()
    assert pm.lookup([b"h"]) == 0  # never served while its unit is being read
    with pytest.raises(PageStateError, match="being filled by tier 'files'"):
        pm.complete_store(page, 0, generation=generation)
    assert pm.allocate([b"h"]) == [None]  # the block is on its way: no second fill or store
    pm.complete_fill(page, generation=generation)
    assert pm.lookup([b"h"]) == 1 and pm.num_filling == 0
    with pytest.raises(PageStateError, match="not being filled"):
        pm.complete_fill(page, generation=generation)
    check_invariants(pm)


def test_a_failed_fill_is_a_miss_and_the_page_free_again():
    pm = PageManager(2)
    pages = pm.allocate([b"a", b"b"], filler="redis")
    generations = [pm.generation(p) for p in pages]
    with pytest.raises(PageStateError, match="generation"):
        pm.fail_fill(pages[0], generation=generations[0] + 1)
    pm.fail_fill(pages[0], generation=generations[0])  # corrupt unit: nothing is served
    assert pm.state(pages[0]) == "free" and pm.page_of(b"a") is None
    assert pm.lookup([b"a"]) == 0
    # the block may be fetched (or stored by ranks) again, under a new generation
    [again] = pm.allocate([b"a"])
    assert again == pages[0] and pm.generation(again) == generations[0] + 1
    with pytest.raises(PageStateError, match="not being filled"):
        pm.fail_fill(again, generation=pm.generation(again))  # a rank store, not a fill
    check_invariants(pm)


def test_fills_are_never_ended_by_fail_store():
    """The fill's I/O may still write into the row: only its own report ends it."""
    pm = PageManager(2)
    [fill] = pm.allocate([b"f"], filler="files")
    [store] = pm.allocate([b"s"])
    assert pm.fail_store([fill, store]) == [store]
    assert pm.state(fill) == "pending"
    with pytest.raises(PageCapacityError):  # the fill's page is never taken
        pm.allocate([b"x", b"y"])
    assert pm.allocate([b"x"]) == [store] and pm.state(fill) == "pending"
    assert pm.allocate([b"f"]) == [None]  # on its way: no second fill or store
    pm.complete_fill(fill, generation=pm.generation(fill))
    assert pm.lookup([b"f"]) == 1
    with pytest.raises(TypeError, match="filler"):
        pm.allocate([b"z"], filler="")
    check_invariants(pm)


def test_introspection():
    pm = PageManager.from_mappings(3, [mla_tp4()])
    assert pm.num_pages == 3 and pm.num_ranks == 4
    (page,) = pm.allocate([42])
    assert page_view(pm, page) == ("pending", 42, 0, 1, frozenset({0}))
    assert page_view(pm, 2) == ("free", None, 0, 0, None)
    assert pm.writer_ranks(page) == frozenset({0})
    assert pm.writer_ranks(2) == frozenset({2})  # a free page reports its future writers
    report(pm, page, 0)
    pm.acquire([42])
    assert page_view(pm, page) == ("ready", 42, 1, 1, None)
    assert pm.page_of(42) == page and pm.page_of(43) is None
    with pytest.raises(PageStateError, match=r"page_id: expected an int in \[0, 2\], got 3"):
        pm.state(3)
    with pytest.raises(PageStateError, match="page_id"):
        pm.generation(3)
    with pytest.raises(PageStateError, match="page_id"):
        pm.hash_of(-1)
    check_invariants(pm)


# --------------------------------------------------------------------------- random operations


def _writers(page: int) -> frozenset[int]:
    # Ranks 0..2; odd pages need two writers, even pages one.
    return frozenset({page % 3, (page + 1) % 3}) if page % 2 else frozenset({page % 3})


class PageManagerMachine(RuleBasedStateMachine):
    """Random operations against a reference model of states, generations, pins and recency.

    The model keeps no heap: it sorts every candidate by its last use, (call number,
    -position in the call), to predict exactly which pages an allocation evicts.
    """

    NUM_PAGES = 6
    HASHES = st.integers(0, 11)

    @initialize()
    def setup(self):
        self.pm = PageManager(self.NUM_PAGES, _writers, num_ranks=3)
        self.pending: dict[int, tuple[int, set[int]]] = {}  # page -> (hash, ranks reported)
        self.fills: set[int] = set()  # pending pages filled by a tier (no writer ranks)
        self.ready: dict[int, int] = {}  # page -> hash
        self.generation: Counter[int] = Counter()
        self.pins: Counter[int] = Counter()
        self.calls = 0  # calls that used pages so far
        self.last_use: dict[int, tuple[int, int]] = {}
        self.evictable: set[int] = set()  # ready, unpinned

    def _hash_page(self) -> dict[int, int]:
        out = {h: p for p, h in self.ready.items()}
        out.update({h: p for p, (h, _) in self.pending.items()})
        return out

    def _drop_pending(self, page: int) -> None:
        del self.pending[page]
        self.fills.discard(page)

    @rule(hashes=st.lists(HASHES, max_size=5), fill=st.booleans(), data=st.data())
    def allocate(self, hashes, fill, data):
        present = self._hash_page()
        new, seen = [], set()
        for i, h in enumerate(hashes):
            if h not in seen and h not in present:
                new.append(i)
            seen.add(h)
        free = [p for p in range(self.NUM_PAGES) if p not in self.pending and p not in self.ready]
        protected = {present[h] for h in hashes if h in present}
        candidates = sorted(self.evictable - protected, key=lambda p: (*self.last_use[p], p))
        wanted = len(new) - len(free)
        before = snapshot(self.pm)
        if wanted > len(candidates):
            with pytest.raises(PageCapacityError) as info:
                self.pm.allocate(hashes, filler="files" if fill else None)
            err = info.value
            assert (err.needed, err.free, err.evictable) == (len(new), len(free), len(candidates))
            assert snapshot(self.pm) == before
            return
        out = self.pm.allocate(hashes, filler="files" if fill else None)
        assert len(out) == len(hashes)
        assert [i for i, p in enumerate(out) if p is not None] == new
        got = [out[i] for i in new]
        victims = candidates[: max(0, wanted)]
        if len(new) <= len(free):
            assert set(got) <= set(free)
        else:  # every free page, then the LRU victims
            assert set(got) == set(free) | set(victims)
        for page in victims:
            assert self.pins[page] == 0
            del self.ready[page]
            self.evictable.discard(page)
        if new:
            self.calls += 1
        for i, page in zip(new, got):
            self.pending[page] = (hashes[i], set())
            if fill:
                self.fills.add(page)
            self.generation[page] += 1
            self.last_use[page] = (self.calls, -i)
        if fill:
            return
        if data.draw(st.booleans(), label="store at once"):  # in any completion order
            for page in data.draw(st.permutations(got), label="completion order"):
                self._complete_every_writer(page, data)

    @rule(data=st.data())
    def complete(self, data):
        page = data.draw(st.integers(0, self.NUM_PAGES - 1))
        rank = data.draw(st.integers(0, 2))
        current = self.generation[page]
        generation = data.draw(st.sampled_from([current, current - 1, current + 1]))
        entry = self.pending.get(page)
        bad_rank = page in self.fills or rank not in _writers(page)
        if generation != current or entry is None or bad_rank or rank in entry[1]:
            before = snapshot(self.pm)
            with pytest.raises(PageStateError):
                self.pm.complete_store(page, rank, generation=generation)
            assert snapshot(self.pm) == before
            return
        h, done = entry
        done.add(rank)
        became_ready = self.pm.complete_store(page, rank, generation=generation)
        assert became_ready == (done == _writers(page))
        if became_ready:
            del self.pending[page]
            self.ready[page] = h
            self.evictable.add(page)  # as recent as its allocation

    def _complete_every_writer(self, page, data):
        h, done = self.pending[page]
        ranks = data.draw(st.permutations(sorted(_writers(page) - done)), label="ranks")
        for count, rank in enumerate(ranks, 1):
            became_ready = self.pm.complete_store(page, rank, generation=self.generation[page])
            assert became_ready == (count == len(ranks))
        del self.pending[page]
        self.ready[page] = h
        self.evictable.add(page)  # as recent as its allocation

    @rule(data=st.data())
    def complete_every_writer(self, data):
        """Every remaining writer of one pending page reports, in a random order."""
        stores = sorted(set(self.pending) - self.fills)
        if stores:
            self._complete_every_writer(data.draw(st.sampled_from(stores)), data)

    @rule(data=st.data(), ok=st.booleans())
    def finish_fill(self, data, ok):
        """A tier's job reports a fill (verified: ready; missing or corrupt: free again)."""
        page = data.draw(st.integers(0, self.NUM_PAGES - 1))
        current = self.generation[page]
        generation = data.draw(st.sampled_from([current, current - 1, current + 1]))
        report = self.pm.complete_fill if ok else self.pm.fail_fill
        if generation != current or page not in self.fills:
            before = snapshot(self.pm)
            with pytest.raises(PageStateError):
                report(page, generation=generation)
            assert snapshot(self.pm) == before
            return
        h, _ = self.pending[page]
        report(page, generation=generation)
        self._drop_pending(page)
        if ok:
            self.ready[page] = h
            self.evictable.add(page)  # as recent as its allocation

    @rule(pages=st.lists(st.integers(0, NUM_PAGES - 1), max_size=3), stale=st.booleans())
    def fail(self, pages, stale):
        if stale:  # the failure report of each page's previous store, if it had one
            generations = [max(1, self.generation[p] - 1) for p in pages]
        else:
            generations = [max(1, self.generation[p]) for p in pages]
        matching = [p for p, g in zip(pages, generations) if self.generation[p] == g]
        expected = [p for p in dict.fromkeys(matching) if p in self.pending and p not in self.fills]
        assert self.pm.fail_store(pages, generations=generations) == expected
        for page in expected:
            self._drop_pending(page)

    @rule(hashes=st.lists(HASHES, max_size=4))
    def lookup(self, hashes):
        by_hash = {h: p for p, h in self.ready.items()}
        prefix = []
        for h in hashes:
            if h not in by_hash:
                break
            prefix.append(by_hash[h])
        assert self.pm.lookup(hashes) == len(prefix)
        if prefix:
            self.calls += 1
        for position, page in enumerate(prefix):
            self.last_use[page] = (self.calls, -position)

    @rule(data=st.data())
    def acquire(self, data):
        if not self.ready:
            return
        pages = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        assert self.pm.acquire([self.ready[p] for p in pages]) == pages
        for page in pages:
            self.pins[page] += 1
            self.evictable.discard(page)

    @rule(data=st.data())
    def release(self, data):
        pinned = sorted(p for p, n in self.pins.items() if n)
        if not pinned:
            page = data.draw(st.integers(0, self.NUM_PAGES - 1))
            with pytest.raises(PageStateError):
                self.pm.release([page])
            return
        pages = data.draw(
            st.lists(st.sampled_from(pinned), min_size=1, max_size=3).filter(
                lambda ps: all(ps.count(p) <= self.pins[p] for p in ps)
            )
        )
        self.pm.release(pages)
        self.calls += 1
        for page in pages:
            self.pins[page] -= 1
        for position, page in enumerate(pages):
            if not self.pins[page] and page not in self.evictable:
                self.evictable.add(page)
                self.last_use[page] = (self.calls, -position)

    @rule(h=HASHES)
    def acquire_not_ready(self, h):
        if h in self.ready.values():
            return
        with pytest.raises(PageStateError):
            self.pm.acquire([h])

    @invariant()
    def consistent(self):
        pm = self.pm
        check_invariants(pm)
        assert pm.num_free + pm.num_pending + pm.num_ready == self.NUM_PAGES
        assert pm.num_pending == len(self.pending) and pm.num_ready == len(self.ready)
        assert pm.num_filling == len(self.fills)
        for page, h in self.ready.items():  # pinned pages included: never evicted
            assert pm.state(page) == "ready" and pm.hash_of(page) == h and pm.page_of(h) == page
            assert pm.refcount(page) == self.pins[page]
        for page, (h, done) in self.pending.items():
            assert pm.state(page) == "pending" and pm.page_of(h) == page
            if page in self.fills:
                assert pm.pending_writers(page) == pm.writer_ranks(page) == frozenset()
            else:
                assert pm.pending_writers(page) == _writers(page) - done
        for page in range(self.NUM_PAGES):
            assert pm.generation(page) == self.generation[page]
            if page not in self.ready and page not in self.pending:
                assert pm.state(page) == "free" and pm.hash_of(page) is None
        assert pm.num_evictable == len(self.evictable)


TestPageManagerMachine = PageManagerMachine.TestCase
TestPageManagerMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- threads


def test_concurrent_completions_from_worker_threads():
    num_pages, num_ranks = 512, 4
    pm = PageManager.from_mappings(num_pages, [gqa2_tp4(), mla_tp4(dcp=2)])
    hashes = [f"blk{i}".encode() for i in range(num_pages)]
    pages = pm.allocate(hashes)
    start = threading.Barrier(num_ranks + 1)
    made_ready: list[list[int]] = [[] for _ in range(num_ranks)]
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        mine = [p for p in pages if rank in pm.writer_ranks(p)]
        random.Random(rank).shuffle(mine)
        start.wait()
        try:
            for page in mine:
                if report(pm, page, rank):
                    made_ready[rank].append(page)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    def reader() -> None:
        start.wait()
        try:
            for _ in range(300):
                n = pm.lookup(hashes)
                held = pm.acquire(hashes[:n])
                assert all(pm.state(p) == "ready" for p in held)
                pm.release(held)
                check_invariants(pm)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(num_ranks)]
    threads.append(threading.Thread(target=reader))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    all_ready = sorted(p for per_rank in made_ready for p in per_rank)
    assert all_ready == sorted(pages)  # each page turned ready exactly once
    assert pm.num_ready == num_pages and pm.lookup(hashes) == num_pages
    check_invariants(pm)


def test_racing_duplicate_reports_succeed_exactly_once():
    pm = PageManager(64, num_ranks=2)
    pages = pm.allocate(range(64))
    start = threading.Barrier(8)
    results: list[tuple[int, int, bool | None]] = []
    lock = threading.Lock()

    def racer(seed: int) -> None:
        order = [(p, r) for p in pages for r in (0, 1)]
        random.Random(seed).shuffle(order)
        start.wait()
        for page, rank in order:
            try:
                became = report(pm, page, rank)
            except PageStateError:
                became = None
            with lock:
                results.append((page, rank, became))

    threads = [threading.Thread(target=racer, args=(s,)) for s in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    accepted = Counter((p, r) for p, r, became in results if became is not None)
    assert accepted == Counter({(p, r): 1 for p in pages for r in (0, 1)})
    assert sum(1 for _, _, became in results if became) == 64
    assert pm.num_ready == 64
    check_invariants(pm)
