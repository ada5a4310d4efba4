"""Real processes, real shared memory: KV stored by one topology, read bit-exact by another.

Writers and readers are separate processes (forkserver, torch preloaded) that
attach one SharedOffloadRegion in /dev/shm. The scheduler-side PageManager in
this process marks a page ready only once every elected writer of every layer
reported it.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import uuid

import pytest
import torch
from helpers.frontend_rank import Model, Topo, kill, rank_entry

from canonical_ops.engine import (
    OffloadWorker,
    PageManager,
    SharedOffloadRegion,
    canonical_row_bytes,
)
from canonical_ops.engine.worker import group_layer_mappings
from layouts import RankContext

pytestmark = pytest.mark.slow


@pytest.fixture
def ctx_mp(forkserver):
    return forkserver


def group_mappings(model: Model, topo: Topo):
    return group_layer_mappings(
        model.specs(topo),
        RankContext(topo.tp, model.total_heads, 0, topo.dcp, topo.pcp, topo.interleave),
    )


def task(role, model, topo, rank, page_ids, salt, region_args, region_rank, **extra) -> dict:
    """One rank process's work (helpers/frontend_rank.py), attaching as ``region_rank``."""
    region = dict(region_args, rank=region_rank)
    return dict(role=role, model=model, topo=topo, rank=rank, page_ids=page_ids, salt=salt,
                region=region, **extra)  # fmt: skip


def run_ranks(ctx_mp, tasks: list[dict], timeout: float = 120.0) -> list[dict]:
    results = ctx_mp.Queue()
    procs = [ctx_mp.Process(target=rank_entry, args=(t, results)) for t in tasks]
    for p in procs:
        p.start()
    out = []
    for _ in tasks:
        try:
            out.append(results.get(timeout=timeout))
        except queue.Empty:
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = [r["error"] for r in out if "error" in r]
    assert not errors, "\n".join(errors)
    assert len(out) == len(tasks), f"{len(tasks) - len(out)} rank process(es) died"
    return out


def cross_topology(ctx_mp, model: Model, writer: Topo, reader: Topo) -> None:
    w_groups, r_groups = group_mappings(model, writer), group_mappings(model, reader)
    row_bytes = canonical_row_bytes([g[0] for g in w_groups], model.pages_per_row)
    assert row_bytes == canonical_row_bytes([g[0] for g in r_groups], model.pages_per_row)
    num_pages = model.num_rows * model.pages_per_row
    manager = PageManager.from_mappings(num_pages, w_groups)
    hashes = [f"h{i}".encode() for i in range(5)]
    page_ids = manager.allocate(hashes)
    generations = [manager.generation(page) for page in page_ids]  # the writers' tokens
    world = 1 + writer.ranks + reader.ranks
    region_args = dict(
        engine_id=f"test-{uuid.uuid4().hex}",
        num_rows=model.num_rows,
        row_bytes=row_bytes,
        world_size=world,
    )
    with SharedOffloadRegion(**region_args, rank=0) as region:
        assert oct(os.stat(region.path).st_mode & 0o777) == "0o600"
        writers = run_ranks(
            ctx_mp,
            [
                task("writer", model, writer, r, page_ids, 1, region_args, 1 + r)
                for r in range(writer.ranks)
            ],
        )
        for result in writers:
            for page, generation in zip(page_ids, generations):
                if result["rank"] in manager.writer_ranks(page):
                    manager.complete_store(page, result["rank"], generation=generation)
        assert manager.lookup(hashes) == len(hashes)
        loaded = manager.acquire(hashes)
        readers = run_ranks(
            ctx_mp,
            [
                task("reader", model, reader, r, loaded, 2, region_args, 1 + writer.ranks + r)
                for r in range(reader.ranks)
            ],
        )
        manager.release(loaded)
        for result in readers:
            assert result["mismatches"] == [], result
        assert not os.path.exists(region.path)  # every rank attached: unlinked


@pytest.mark.parametrize(("w", "r"), [(1, 2), (2, 1), (2, 4), (4, 2), (4, 8), (8, 1)])
def test_tp_pairs_packed_nhd(ctx_mp, w: int, r: int) -> None:
    cross_topology(ctx_mp, Model("full", 8, "packed", "NHD"), Topo(w), Topo(r))


@pytest.mark.parametrize(
    ("packing", "order"), [("split", "NHD"), ("packed", "HND"), ("split", "HND")]
)
@pytest.mark.parametrize(("w", "r"), [(2, 4), (8, 1)])
def test_tp_pairs_other_layouts(ctx_mp, packing: str, order: str, w: int, r: int) -> None:
    cross_topology(ctx_mp, Model("full", 8, packing, order), Topo(w), Topo(r))


@pytest.mark.parametrize(("w", "r"), [(4, 8), (8, 4)])
def test_replicated_gqa(ctx_mp, w: int, r: int) -> None:
    cross_topology(ctx_mp, Model("full", 2, "packed", "NHD"), Topo(w), Topo(r))


def test_mla_tp4_to_tp2(ctx_mp) -> None:
    cross_topology(
        ctx_mp, Model("mla", 1, "packed", "NHD", layers=((24, "bfloat16"),)), Topo(4), Topo(2)
    )


@pytest.mark.parametrize("attention", ["full", "mla"])
def test_dcp2_to_dcp1(ctx_mp, attention: str) -> None:
    # 2 KV heads at TP 4 replicate each head twice: DCP 2 splits tokens inside the replicas.
    heads = 1 if attention == "mla" else 2
    cross_topology(ctx_mp, Model(attention, heads, "split", "NHD"), Topo(4, dcp=2), Topo(2))


def through_files(ctx_mp, root, model: Model, writer: Topo, reader: Topo) -> None:
    """A writer engine persists its region rows to a FileStore and closes; a reader engine of
    another topology (own region, own manager, own store object) fills its region from the
    files and its ranks check every byte against the first-principles truth."""
    from canonical_ops.engine import FileStore, ModelIdentity, StageCache, StoreNamespace

    model = dataclasses.replace(model, pages_per_row=1)  # a region row is one unit
    hashes = [f"h{i}".encode() for i in range(model.num_rows)]
    layers = (0, len(model.layers))
    page_ids = None
    for role, topo, salt in (("writer", writer, 1), ("reader", reader, 2)):
        groups = group_mappings(model, topo)
        ctx = RankContext(topo.tp, model.total_heads, 0, topo.dcp, topo.pcp, topo.interleave)
        namespace = StoreNamespace.from_specs(ModelIdentity("test/model"), model.specs(topo), ctx)
        manager = PageManager.from_mappings(model.num_rows, groups)
        region_args = dict(
            engine_id=f"test-{uuid.uuid4().hex}",
            num_rows=model.num_rows,
            row_bytes=canonical_row_bytes([g[0] for g in groups]),
            world_size=1 + topo.ranks,
        )
        assert region_args["row_bytes"] == namespace.layer_bytes(*layers)
        with (
            FileStore(root, namespace, fsync=False) as files,
            SharedOffloadRegion(**region_args, rank=0) as region,
        ):
            cache = StageCache(manager, region, layers, namespace, [files])
            if role == "writer":
                page_ids = manager.allocate(hashes)
                generations = [manager.generation(page) for page in page_ids]
            else:
                found = cache.lookup(hashes, timeout=60)
                assert (found.in_region, found.from_tiers) == (0, len(hashes))
                assert cache.fetch(hashes, found).submitted == len(hashes)
                cache.drain(60)
                assert manager.lookup(hashes) == len(hashes)  # every unit verified
                # the same pages as the writer's: the truth is keyed by page
                assert [manager.page_of(h) for h in hashes] == page_ids
            results = run_ranks(
                ctx_mp,
                [
                    task(role, model, topo, r, page_ids, salt, region_args, 1 + r)
                    for r in range(topo.ranks)
                ],
            )
            if role == "writer":
                for result in results:
                    for page, generation in zip(page_ids, generations):
                        if result["rank"] in manager.writer_ranks(page):
                            manager.complete_store(page, result["rank"], generation=generation)
                assert manager.lookup(hashes) == len(hashes)
                assert cache.persist(hashes).submitted == len(hashes)
                cache.drain(60)
                assert files.lookup(hashes, *layers) == len(hashes)
            else:
                for result in results:
                    assert result["mismatches"] == [], result
            cache.close(60)


@pytest.mark.parametrize(
    ("attention", "writer", "reader"),
    [
        ("full", Topo(4, dcp=2), Topo(2)),
        ("mla", Topo(4, dcp=2), Topo(1)),
        ("full", Topo(2), Topo(2, pcp=2)),
        ("mla", Topo(2, pcp=2), Topo(4, dcp=4)),
    ],
    ids=["gqa-tp4dcp2-to-tp2", "mla-tp4dcp2-to-tp1", "gqa-tp2-to-tp2pcp2", "mla-pcp2-to-dcp4"],
)
def test_dcp_and_pcp_restart_through_files(ctx_mp, tmp_path, attention, writer, reader) -> None:
    heads = 1 if attention == "mla" else 2
    through_files(ctx_mp, tmp_path, Model(attention, heads, "split", "NHD"), writer, reader)


def test_non_writer_store_changes_nothing() -> None:
    """MLA at TP 4: page 1's only writer is rank 1; rank 0's store of page 1 writes no byte."""
    model = Model("mla", 1, "packed", "NHD", layers=((24, "bfloat16"),))
    topo = Topo(4)
    specs = model.specs(topo)
    row_bytes = canonical_row_bytes(
        [g[0] for g in group_mappings(model, topo)], model.pages_per_row
    )
    with SharedOffloadRegion(
        f"test-{uuid.uuid4().hex}", model.num_rows, row_bytes, world_size=1, rank=0
    ) as region:
        region.tensor.copy_(torch.randint(0, 256, region.tensor.shape, dtype=torch.uint8))
        before = region.tensor.clone()
        kv = [torch.randn(model.num_blocks, 8, 24).to(torch.bfloat16)]
        for rank in (0, 2, 3):
            worker = OffloadWorker(
                kv, specs, RankContext(4, 1, rank), region, pages_per_row=model.pages_per_row
            )
            job = worker.wait(worker.store(block_ids=[3], page_ids=[1]))
            assert job.num_bytes == 0
        assert torch.equal(region.tensor, before)
        writer = OffloadWorker(
            kv, specs, RankContext(4, 1, 1), region, pages_per_row=model.pages_per_row
        )
        writer.wait(writer.store(block_ids=[3], page_ids=[1]))
        assert not torch.equal(region.tensor, before)


def test_writer_killed_mid_store(ctx_mp) -> None:
    """A writer SIGKILLed before finishing: its page never becomes ready, and once the engine
    fails that rank's store the page is free again; the other pages read back bit-exact."""
    model = Model("full", 8, "packed", "NHD")
    writer, reader = Topo(2), Topo(1)
    w_groups = group_mappings(model, writer)
    row_bytes = canonical_row_bytes([g[0] for g in w_groups], model.pages_per_row)
    manager = PageManager.from_mappings(model.num_rows * model.pages_per_row, w_groups)
    good_hashes = [b"a", b"b", b"c"]
    good = manager.allocate(good_hashes)
    good_generations = [manager.generation(page) for page in good]
    doomed = manager.allocate([b"doomed"])
    doomed_generation = manager.generation(doomed[0])
    region_args = dict(
        engine_id=f"test-{uuid.uuid4().hex}",
        num_rows=model.num_rows,
        row_bytes=row_bytes,
        world_size=1 + 2 + 2 + 1,
    )
    with SharedOffloadRegion(**region_args, rank=0) as region:
        for result in run_ranks(
            ctx_mp,
            [task("writer", model, writer, r, good, 1, region_args, 1 + r) for r in range(2)],
        ):
            for page, generation in zip(good, good_generations):
                manager.complete_store(page, result["rank"], generation=generation)
        good_bytes = region.tensor.clone()
        # Rank 1 of a second store job dies before its store completes; rank 0 finishes.
        announce = ctx_mp.Queue()
        results = ctx_mp.Queue()
        victim = ctx_mp.Process(
            target=rank_entry,
            args=(
                task(
                    "writer",
                    model,
                    writer,
                    1,
                    doomed,
                    3,
                    region_args,
                    3,
                    kill_before_store=True,
                    announce=announce,
                ),
                results,
            ),
        )
        victim.start()
        kill(announce.get(timeout=120))
        victim.join(timeout=10)
        assert victim.exitcode == -9
        survivor = run_ranks(
            ctx_mp,
            [task("writer", model, writer, 0, doomed, 3, region_args, 4)],
        )
        manager.complete_store(doomed[0], survivor[0]["rank"], generation=doomed_generation)
        assert manager.state(doomed[0]) == "pending"
        assert manager.lookup([b"doomed"]) == 0
        # The engine saw the rank die: it fails the rank's in-flight pages (ready ones stay).
        in_flight = [*good, *doomed]
        generations = [*good_generations, doomed_generation]
        assert manager.fail_store(in_flight, generations=generations) == doomed
        assert manager.state(doomed[0]) == "free"
        assert manager.lookup(good_hashes) == 3
        # Other pages' bytes untouched by the dead job.
        rows = {p // model.pages_per_row for p in good}
        untouched = [r for r in rows if r != doomed[0] // model.pages_per_row]
        for row in untouched:
            assert torch.equal(region.tensor[row], good_bytes[row])
        loaded = manager.acquire(good_hashes)
        readers = run_ranks(
            ctx_mp,
            [task("reader", model, reader, 0, loaded, 2, region_args, 5)],
        )
        assert readers[0]["mismatches"] == []
        manager.release(loaded)
    assert not os.path.exists(region.path)


def test_region_unlinked_once_all_ranks_attached() -> None:
    """Once every rank attached, the file is gone: a crash of all ranks then leaks nothing."""
    args = dict(engine_id=f"test-{uuid.uuid4().hex}", num_rows=2, row_bytes=4096, world_size=2)
    first = SharedOffloadRegion(**args, rank=0)
    path = first.path
    assert os.path.exists(path) and oct(os.stat(path).st_mode & 0o777) == "0o600"
    second = SharedOffloadRegion(**args, rank=1)
    assert not os.path.exists(path)  # unlinked once both attached: a crash leaks nothing
    second.close()
    first.close()
