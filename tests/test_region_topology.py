"""Issue 32 item 1: a shared region never hands a reader opaque pages of another topology.

Writers at TP=4 store a model whose layer 1 carries per-token-head scales inside the page
(never certified: each rank's page is stored whole, the opaque fallback); readers at TP=2
attached to the same region used to load every page, layer 1 laid out for TP=4. Every
worker built on a region now claims its areas of the rows in the region's header
(``SharedOffloadRegion.claim_rows``): a worker whose areas meet opaque pages of another
topology is refused when it is built (RegionTopologyError naming the layer, its fallback
reason and both topologies), before any byte moves. Certified layers keep crossing
topologies; the same topology keeps reading its opaque pages.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from canonical_ops.engine import (
    OffloadWorker,
    PageManager,
    RegionTopologyError,
    RowArea,
    SharedOffloadRegion,
    StageCache,
    canonical_row_bytes,
    region_path,
)
from canonical_ops.engine import claims as claims_module
from canonical_ops.engine import region as region_module
from canonical_ops.engine.worker import group_layer_mappings
from canonical_ops.units import FileStore, ModelIdentity, StoreNamespace
from layouts import LayerSpec, RankContext

HEADS, TOKENS, HEAD_SIZE, BLOCKS, ROWS = 8, 16, 32, 4, 4
SHM = "/dev/shm"
REASON = "per-token-head quantisation scales inside the page"
MODEL = ModelIdentity("test/region-topology", "r1")

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="needs /dev/shm")


def spec(tp: int, scaled: bool = False) -> LayerSpec:
    """A rank's page at TP=``tp``: packed NHD (so TP=4's pages side by side are not TP=2's)."""
    return LayerSpec(
        "full", TOKENS, HEADS // tp, HEAD_SIZE, "bfloat16", "packed", "NHD",
        per_token_head_scales=scaled,
    )  # fmt: skip


def model(tp: int, opaque_layer_1: bool = True) -> list[LayerSpec]:
    """Layer 0 certified; layer 1 with per-token-head scales in the page (opaque) or not."""
    return [spec(tp), spec(tp, scaled=opaque_layer_1)]


def truth(layers: int = 2) -> list[torch.Tensor]:
    """The unsharded KV of every layer: (blocks, tokens, heads, K|V)."""
    gen = torch.Generator().manual_seed(32)
    return [
        torch.randn(BLOCKS, TOKENS, HEADS, 2 * HEAD_SIZE, generator=gen).to(torch.bfloat16)
        for _ in range(layers)
    ]


def shard(layer: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s heads of ``layer`` as its cache holds them: (blocks, heads, tokens, K|V)
    with NHD strides."""
    heads = HEADS // tp
    return layer[:, :, rank * heads : (rank + 1) * heads].clone().permute(0, 2, 1, 3)


def caches(truths: list[torch.Tensor], tp: int, rank: int, *, empty: bool) -> list[torch.Tensor]:
    kv = [shard(layer, tp, rank) for layer in truths]
    for tensor in kv if empty else ():
        tensor.zero_()
    return kv


def row_bytes(specs: list, tp: int) -> int:
    groups = group_layer_mappings(specs, RankContext(tp, HEADS, 0))
    return canonical_row_bytes([group[0] for group in groups])


@pytest.fixture
def regions() -> Iterator[Any]:
    """``regions(world_size, row_bytes)``: rank 0 of a new region (held by the test), then
    ``attach()`` for each further rank; every object is closed afterwards."""
    opened: list[SharedOffloadRegion] = []
    engine_id = f"test-topology-{uuid.uuid4().hex}"

    class Regions:
        def __init__(self, world_size: int, num_bytes: int) -> None:
            self.world_size, self.row_bytes, self.next_rank = world_size, num_bytes, 1
            self.rank0 = self._open(0)

        def _open(self, rank: int) -> SharedOffloadRegion:
            opened.append(
                SharedOffloadRegion(
                    engine_id, ROWS, self.row_bytes, world_size=self.world_size, rank=rank,
                    pin=False, attach_timeout_s=10.0,
                )
            )  # fmt: skip
            return opened[-1]

        def attach(self) -> SharedOffloadRegion:
            self.next_rank += 1
            return self._open(self.next_rank - 1)

    yield Regions
    for region in reversed(opened):
        region.close()
    leaked = os.path.lexists(region_path(engine_id, SHM))
    assert not leaked, "the test left its region behind"


def store_at(regions: Any, truths, specs_of, tp: int, pages: list[int]) -> list[OffloadWorker]:
    """TP=``tp`` writers, each attached as its own rank, store blocks 0.. into ``pages``."""
    writers = []
    for rank in range(tp):
        kv = caches(truths, tp, rank, empty=False)
        writer = OffloadWorker(kv, specs_of(tp), RankContext(tp, HEADS, rank), regions.attach())
        writer.wait(writer.store(block_ids=list(range(len(pages))), page_ids=pages))
        writers.append(writer)
    return writers


def assert_loads_the_truth(worker: OffloadWorker, kv, truths, tp: int, rank: int) -> None:
    worker.wait(worker.load(block_ids=[2, 3], page_ids=[0, 1]))
    for layer, (got, whole) in enumerate(zip(kv, truths)):
        want = shard(whole[:2], tp, rank)
        assert torch.equal(got[2:4], want), f"layer {layer} at TP={tp} rank {rank}"


# --------------------------------------------------------------------------- the issue


def test_tp2_readers_of_tp4_pages_with_an_opaque_layer_are_refused(regions: Any) -> None:
    """The issue, as filed: before, both TP=2 readers were built and loaded every page; their
    layer 1 held TP=4's four rank pages side by side (wrong KV, no error)."""
    truths, specs_of = truth(), model
    assert row_bytes(model(4), 4) == row_bytes(model(2), 2)  # nothing else tells them apart
    region = regions(1 + 4 + 2, row_bytes(model(4), 4))
    writers = store_at(region, truths, specs_of, 4, [0, 1])
    assert writers[0].opaque_layers == [1] and REASON in writers[0].fallback_reasons[1]
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    for rank in range(2):
        kv = caches(truths, 2, rank, empty=True)
        ctx = RankContext(2, HEADS, rank)
        with pytest.raises(RegionTopologyError) as refused:
            OffloadWorker(kv, model(2), ctx, region.attach(), layer_names=names)
        message = str(refused.value)
        assert message.startswith("cpu_pages: shared offload region ")
        assert "layer 1 ('model.layers.1.attn') is stored opaque at tp=2" in message
        assert REASON in message and "claimed by workers at tp=4, dcp=1, pcp=1" in message
        assert all(not tensor.any() for tensor in kv)  # never a byte


def test_same_topology_readers_load_every_layer(regions: Any) -> None:
    truths = truth()
    region = regions(1 + 4 + 4, row_bytes(model(4), 4))
    store_at(region, truths, model, 4, [0, 1])
    for rank in range(4):
        kv = caches(truths, 4, rank, empty=True)
        reader = OffloadWorker(kv, model(4), RankContext(4, HEADS, rank), region.attach())
        assert reader.opaque_layers == [1]
        assert_loads_the_truth(reader, kv, truths, 4, rank)


def test_all_certified_model_loads_at_another_tp(regions: Any) -> None:
    truths = truth()
    certified = lambda tp: model(tp, opaque_layer_1=False)  # noqa: E731
    region = regions(1 + 4 + 2, row_bytes(certified(4), 4))
    store_at(region, truths, certified, 4, [0, 1])
    for rank in range(2):
        kv = caches(truths, 2, rank, empty=True)
        reader = OffloadWorker(kv, certified(2), RankContext(2, HEADS, rank), region.attach())
        assert reader.is_topology_independent
        assert_loads_the_truth(reader, kv, truths, 2, rank)


def _rank_process(conn: Any, region_args: dict, tp: int, tp_rank: int, role: str) -> None:
    """One rank in its own process: a writer stores blocks 0, 1 into pages 0, 1; a reader
    builds its worker and loads them (or reports the refusal)."""
    try:
        truths = truth()
        with SharedOffloadRegion(**region_args) as region:
            kv = caches(truths, tp, tp_rank, empty=role == "reader")
            try:
                worker = OffloadWorker(kv, model(tp), RankContext(tp, HEADS, tp_rank), region)
            except RegionTopologyError as error:
                conn.send(("refused", str(error), [bool(t.any()) for t in kv]))
                return
            if role == "writer":
                worker.wait(worker.store(block_ids=[0, 1], page_ids=[0, 1]))
                conn.send(("stored",))
                return
            worker.wait(worker.load(block_ids=[2, 3], page_ids=[0, 1]))
            exact = [torch.equal(got[2:4], shard(t[:2], tp, tp_rank)) for got, t in zip(kv, truths)]
            conn.send(("loaded", exact))
    except Exception as error:  # the test reports it
        conn.send(("error", repr(error)))


def test_ranks_in_their_own_processes_share_one_record(forkserver: Any, regions: Any) -> None:
    """The claims live in the region file's header: four TP=4 writer processes store, a TP=2
    reader process is refused, a TP=4 reader process loads every layer exactly."""
    region = regions(1 + 4 + 2, row_bytes(model(4), 4))
    engine_id = region.rank0.engine_id

    def run(rank: int, tp: int, tp_rank: int, role: str) -> tuple:
        args = dict(engine_id=engine_id, num_rows=ROWS, row_bytes=region.row_bytes, pin=False)
        args.update(world_size=region.world_size, rank=rank, attach_timeout_s=30.0)
        ours, theirs = forkserver.Pipe()
        process = forkserver.Process(target=_rank_process, args=(theirs, args, tp, tp_rank, role))
        process.start()
        theirs.close()
        try:
            assert ours.poll(60), f"rank {rank} did not answer"
            return ours.recv()
        finally:
            process.join(30)

    assert [run(1 + r, 4, r, "writer") for r in range(4)] == [("stored",)] * 4
    refused = run(5, 2, 0, "reader")
    assert refused[0] == "refused", refused
    assert "layer 1 is stored opaque at tp=2" in refused[1] and "workers at tp=4" in refused[1]
    assert refused[2] == [False, False]  # its caches untouched
    assert run(6, 4, 1, "reader") == ("loaded", [True, True])


# --------------------------------------------------------------------------- every order, every kind


def test_a_certified_reader_is_refused_pages_its_writers_stored_opaque(regions: Any) -> None:
    """Opaque at the writers only (their layer 1 layout is not recognised: spec None): a TP=2
    reader that certifies layer 1 would read TP=4's rank pages as one canonical page."""
    truths = truth()
    unknown_at_writers = lambda tp: [spec(tp), spec(tp) if tp == 2 else None]  # noqa: E731
    region = regions(1 + 4 + 1, row_bytes(model(4), 4))
    store_at(region, truths, unknown_at_writers, 4, [0, 1])
    kv = caches(truths, 2, 0, empty=True)
    with pytest.raises(RegionTopologyError) as refused:
        OffloadWorker(kv, unknown_at_writers(2), RankContext(2, HEADS, 0), region.attach())
    message = str(refused.value)
    assert "layer 1 (bytes [" in message and "stored opaque by workers at tp=4" in message
    assert "this worker at tp=2, dcp=1, pcp=1, interleave=1 would read them" in message


def test_opaque_writers_are_refused_rows_a_reader_of_another_tp_claimed_first(
    regions: Any,
) -> None:
    """Whoever comes first: TP=2 readers attached before the TP=4 writers keep their rows."""
    truths = truth()
    region = regions(1 + 1 + 1, row_bytes(model(4), 4))
    certified_reader = [spec(2), spec(2)]
    OffloadWorker(caches(truths, 2, 0, empty=True), certified_reader, RankContext(2, HEADS, 0),
                  region.attach())  # fmt: skip
    with pytest.raises(RegionTopologyError, match=r"layer 1 is stored opaque at tp=4.*tp=2"):
        OffloadWorker(caches(truths, 4, 0, empty=False), model(4), RankContext(4, HEADS, 0),
                      region.attach())  # fmt: skip


def test_rows_of_a_pipeline_split_other_topologies_share_only_certified_areas(
    regions: Any,
) -> None:
    """A worker moves some layers' areas (``area_offsets``, another pipeline split): a TP=2
    reader of layer 0 only is admitted next to TP=4's opaque layer 1 and reads it exactly;
    once it reads layer 1's area as canonical, a TP=4 worker may no longer store it opaque."""
    truths = truth()
    full_row = row_bytes(model(4), 4)
    layer_1_at = full_row // 2
    region = regions(1 + 3, full_row)
    # TP=4 rank 0 of the stage holding layer 0 only claims first (nothing opaque in it).
    first = OffloadWorker([caches(truths, 4, 0, empty=False)[0]], [spec(4)],
                          RankContext(4, HEADS, 0), region.attach(), area_offsets=[0])  # fmt: skip
    first.wait(first.store(block_ids=[0, 1], page_ids=[0, 1]))
    # A TP=2 reader of layer 1's area (certified at TP=2): admitted, nothing opaque is there.
    OffloadWorker([caches(truths, 2, 0, empty=True)[1]], [spec(2)], RankContext(2, HEADS, 0),
                  region.attach(), area_offsets=[layer_1_at])  # fmt: skip
    # Now TP=4 cannot store layer 1 opaque there: the TP=2 reader takes those bytes as canonical.
    kv = caches(truths, 4, 1, empty=False)
    with pytest.raises(RegionTopologyError) as refused:
        OffloadWorker(kv, model(4), RankContext(4, HEADS, 1), region.attach())
    message = str(refused.value)
    assert "layer 1 is stored opaque at tp=4" in message and REASON in message
    assert f"workers at tp=2, dcp=1, pcp=1, interleave=1 already use bytes [{layer_1_at}, " in (
        message
    )


@pytest.mark.parametrize(
    "other",
    [(2, 1, 1, 1), (4, 2, 1, 1), (4, 1, 2, 1), (4, 1, 1, 16)],
    ids=["tp", "dcp", "pcp", "interleave"],
)
def test_claims_compare_the_whole_topology(regions: Any, other: tuple) -> None:
    region = regions(2, 1000).rank0
    opaque = [RowArea("layer 1", 500, 1000, "not parallelism agnostic")]
    region.claim_rows((4, 1, 1, 1), [RowArea("layer 0", 0, 500), *opaque])
    region.claim_rows((4, 1, 1, 1), opaque)  # the same topology: its own opaque pages
    with pytest.raises(RegionTopologyError, match=r"layer 1 is stored opaque"):
        region.claim_rows(other, opaque)
    with pytest.raises(RegionTopologyError, match=r"layer 1 \(bytes \[500, 1000\].*opaque"):
        region.claim_rows(other, [RowArea("layer 1", 500, 1000)])
    region.claim_rows(other, [RowArea("layer 0", 0, 500)])  # certified, elsewhere: fine


def test_dcp_readers_of_opaque_pages_are_refused(regions: Any) -> None:
    """The topology is not only TP: DCP=2 writers' opaque pages are refused to DCP=1."""
    scaled = LayerSpec("full", TOKENS, HEADS // 2, HEAD_SIZE, "bfloat16", "packed", "NHD",
                       per_token_head_scales=True)  # fmt: skip
    kv = lambda: [shard(truth(1)[0], 2, 0)]  # noqa: E731
    dcp2 = RankContext(2, HEADS, 0, dcp_size=2)
    page = group_layer_mappings([scaled], dcp2)[0][0].canonical_page_size_bytes
    region = regions(1 + 2, page)
    OffloadWorker(kv(), [scaled], dcp2, region.attach())
    with pytest.raises(RegionTopologyError, match=r"opaque at tp=2, dcp=1.*tp=2, dcp=2"):
        OffloadWorker(kv(), [scaled], RankContext(2, HEADS, 0), region.attach())


def test_a_refused_claim_records_nothing_and_ranks_see_one_record(regions: Any) -> None:
    region = regions(3, 1000)
    first, second = region.attach(), region.attach()
    first.claim_rows((4, 1, 1, 1), [RowArea("layer 1", 0, 1000, "opaque")])
    with pytest.raises(RegionTopologyError):
        second.claim_rows((2, 1, 1, 1), [RowArea("layer 1", 0, 1000, "opaque")])
    # Nothing of the refused TP=2 claim: TP=4 still stores its opaque pages there.
    region.rank0.claim_rows((4, 1, 1, 1), [RowArea("layer 1", 0, 1000, "opaque")])
    with pytest.raises(RegionTopologyError):  # and every rank reads the one record
        region.rank0.claim_rows((2, 1, 1, 1), [RowArea("layer 1", 0, 10)])


def test_bad_claims_are_refused_and_record_nothing(regions: Any) -> None:
    region = regions(1, 1000).rank0
    with pytest.raises(ValueError, match=r"topology: expected \(tp, dcp, pcp, interleave\)"):
        region.claim_rows((4, 1, 1), [])
    with pytest.raises(ValueError, match=r"topology\[1\]"):
        region.claim_rows((4, 0, 1, 1), [])
    with pytest.raises(TypeError, match=r"areas\[0\]: expected a RowArea, got tuple"):
        region.claim_rows((4, 1, 1, 1), [("layer 0", 0, 10, None)])
    with pytest.raises(ValueError, match=r"areas\[1\].end"):
        region.claim_rows((4, 1, 1, 1), [RowArea("a", 0, 10, "x"), RowArea("b", 10, 1001)])
    region.claim_rows((2, 1, 1, 1), [RowArea("layer 0", 0, 1000, "opaque")])  # nothing recorded
    region.close()
    with pytest.raises(ValueError, match="is closed"):
        region.claim_rows((2, 1, 1, 1), [])


@pytest.mark.parametrize("damage", ["flags", "topology", "range", "count"])
def test_a_damaged_claims_record_refuses_every_claim(regions: Any, damage: str) -> None:
    region = regions(2, 1000).rank0  # rank 1 never attaches: the file stays until the close
    if damage == "range":  # one opaque range claimed, then its end overwritten: [0, 0)
        region.claim_rows((4, 1, 1, 1), [RowArea("layer 0", 0, 1000, "opaque")])
        offset, raw = region_module._OPAQUE_OFFSET + 8, struct.pack("<Q", 0)
    elif damage == "count":  # more foreign ranges than their table (the header's end) holds
        region.claim_rows((4, 1, 1, 1), [RowArea("layer 0", 0, 1000, "opaque")])
        count_at = region_module._HEADER.size + claims_module.RECORD_BYTES - 2
        offset, raw = count_at, struct.pack("<H", claims_module.MAX_RANGES + 1)
    else:  # unknown flag bits, or "claimed" at topology (0, 0, 0, 0)
        offset, raw = (
            region_module._HEADER.size,
            struct.pack("<I", 0xFF if damage == "flags" else 1),
        )
    fd = os.open(region.path, os.O_WRONLY)
    try:
        os.pwrite(fd, raw, offset)
    finally:
        os.close(fd)
    with pytest.raises(RegionTopologyError, match="record of the workers' claims is damaged"):
        region.claim_rows((4, 1, 1, 1), [RowArea("layer 0", 0, 1000)])


def test_more_ranges_than_the_header_holds_join_and_refuse_more(regions: Any) -> None:
    region = regions(1, 10_000).rank0
    areas = [RowArea(f"layer {i}", 100 * i, 100 * i + 50, "opaque") for i in range(100)]
    region.claim_rows((4, 1, 1, 1), areas)
    for i in range(100):  # every opaque range is still covered
        with pytest.raises(RegionTopologyError):
            region.claim_rows((2, 1, 1, 1), [RowArea("reader", 100 * i + 10, 100 * i + 20)])
    region.claim_rows((2, 1, 1, 1), [RowArea("reader", 9_960, 10_000)])  # past the last one
    joined = claims_module._joined([(100 * i, 100 * i + 50) for i in range(100)])
    assert len(joined) == claims_module.MAX_RANGES
    assert joined[0][0] == 0 and joined[-1][1] == 9_950


# --------------------------------------------------------------------------- the tiers' path


def test_stage_cache_fills_opaque_units_only_at_their_topology(tmp_path: Any) -> None:
    """Filling a region from a tier: the namespace of a model with an opaque layer names the
    topology, so a TP=2 engine misses TP=4's units (its rows untouched), TP=4 reads them."""
    truths, keys = truth(), [f"block-{b}".encode() for b in range(2)]

    def engine(tp: int):
        ns = StoreNamespace.from_specs(MODEL, model(tp), RankContext(tp, HEADS, 0))
        files = FileStore(tmp_path, ns, fsync=False)
        manager = PageManager(ROWS)
        rows = torch.zeros((ROWS, ns.total_bytes), dtype=torch.uint8)
        return ns, files, manager, rows, StageCache(manager, rows, (0, 2), ns, [files])

    ns4, files, manager, rows, cache = engine(4)
    assert ns4.topology_bound
    pages = manager.allocate(keys)
    for rank in range(4):
        kv = caches(truths, 4, rank, empty=False)
        writer = OffloadWorker(kv, model(4), RankContext(4, HEADS, rank), rows)
        writer.wait(writer.store(block_ids=[0, 1], page_ids=pages))
        for page in pages:
            if rank in manager.writer_ranks(page):
                manager.complete_store(page, rank, generation=manager.generation(page))
    cache.persist(keys)
    assert [event.status for event in cache.drain(30)] == ["ok", "ok"]
    cache.close()
    files.close()

    ns2, files, manager, rows, cache = engine(2)
    assert ns2.digest != ns4.digest
    found = cache.lookup(keys, timeout=30)
    assert found.total == 0
    cache.fetch(keys, found)
    assert cache.drain(30) == [] and not rows.any() and manager.num_free == ROWS
    cache.close()
    files.close()

    _, files, manager, rows, cache = engine(4)
    found = cache.lookup(keys, timeout=30)
    assert found.from_tiers == 2
    cache.fetch(keys, found)
    assert [event.status for event in cache.drain(30)] == ["ok", "ok"]
    pages = [manager.page_of(key) for key in keys]
    for rank in range(4):
        kv = caches(truths, 4, rank, empty=True)
        reader = OffloadWorker(kv, model(4), RankContext(4, HEADS, rank), rows)
        reader.wait(reader.load(block_ids=[2, 3], page_ids=pages))
        for got, whole in zip(kv, truths):
            assert torch.equal(got[2:4], shard(whole[:2], 4, rank))
    cache.close()
    files.close()


# --------------------------------------------------------------------------- review of issue 32


def test_a_certified_reader_of_the_same_tp_is_refused_pages_stored_opaque(regions: Any) -> None:
    """The same TP=4 on both sides, but the writers do not recognise layer 1's layout (spec
    None: opaque, their four rank pages side by side) and the reader certifies it: before, the
    reader was admitted (same topology) and read TP=4's rank pages as one canonical page."""
    truths = truth()
    unknown = lambda tp: [spec(tp), None]  # noqa: E731
    certified = lambda tp: [spec(tp), spec(tp)]  # noqa: E731
    region = regions(1 + 4 + 1, row_bytes(certified(4), 4))
    store_at(region, truths, unknown, 4, [0, 1])
    kv = caches(truths, 4, 0, empty=True)
    with pytest.raises(RegionTopologyError) as refused:
        OffloadWorker(kv, certified(4), RankContext(4, HEADS, 0), region.attach())
    message = str(refused.value)
    assert "layer 1 (bytes [" in message and "stored opaque by workers at tp=4" in message
    assert "this worker of the same topology takes them as canonical pages" in message
    assert all(not tensor.any() for tensor in kv)


def test_opaque_writers_of_the_same_tp_are_refused_rows_read_as_canonical(regions: Any) -> None:
    """The other order: a TP=4 worker that certifies layer 1 claimed first; a TP=4 worker
    storing layer 1 opaque there would hand it rank pages as a canonical page."""
    truths = truth()
    region = regions(1 + 2, row_bytes(model(4, False), 4))
    OffloadWorker(caches(truths, 4, 0, empty=True), [spec(4), spec(4)], RankContext(4, HEADS, 0),
                  region.attach())  # fmt: skip
    with pytest.raises(RegionTopologyError, match=r"layer 1 is stored opaque at tp=4.*workers at "
                       r"tp=4, dcp=1, pcp=1, interleave=1 already use bytes"):  # fmt: skip
        OffloadWorker(caches(truths, 4, 1, empty=False), [spec(4), None], RankContext(4, HEADS, 1),
                      region.attach())  # fmt: skip


def _stage_cache(region: Any, tp: int, specs_of=model) -> StageCache:
    ns = StoreNamespace.from_specs(MODEL, specs_of(tp), RankContext(tp, HEADS, 0))
    return StageCache(PageManager(ROWS), region, (0, 2), ns)


def test_a_stage_cache_of_another_topology_cannot_fill_a_region_with_opaque_units(
    regions: Any,
) -> None:
    """A StageCache fills the region from tiers with units of its namespace: one built at
    TP=2 would put TP=2's opaque layer 1 under TP=4 workers (same row size). Refused either
    order; the workers' own topology is admitted."""
    truths = truth()
    region = regions(1 + 4, row_bytes(model(4), 4))
    assert _stage_cache(region.rank0, 4).rows is not None  # TP=4 units: TP=4 workers' own
    store_at(region, truths, model, 4, [0, 1])
    with pytest.raises(RegionTopologyError) as refused:
        _stage_cache(region.rank0, 2)
    message = str(refused.value)
    assert message.startswith("region: shared offload region ")
    assert "layer 1 is stored opaque at tp=2" in message and "claimed by workers at tp=4" in message

    other = regions(1 + 1, row_bytes(model(4), 4))
    _stage_cache(other.rank0, 2)  # the TP=2 units first: TP=4 workers are refused
    with pytest.raises(RegionTopologyError, match=r"layer 1 is stored opaque at tp=4.*tp=2"):
        OffloadWorker(caches(truths, 4, 0, empty=False), model(4), RankContext(4, HEADS, 0),
                      other.attach())  # fmt: skip


def test_a_stage_cache_of_certified_units_keeps_opaque_writers_out_of_its_layers(
    regions: Any,
) -> None:
    """A namespace without opaque layers has no topology: its StageCache claims its layers as
    canonical pages, so a worker storing layer 1 opaque in those bytes is refused."""
    truths = truth()
    certified = lambda tp: [spec(tp), spec(tp)]  # noqa: E731
    region = regions(1 + 3, row_bytes(certified(4), 4))
    _stage_cache(region.rank0, 4, certified)
    with pytest.raises(RegionTopologyError, match=r"layer 1 is stored opaque at tp=4.*workers "
                       r"at no topology already use bytes"):  # fmt: skip
        OffloadWorker(caches(truths, 4, 0, empty=False), [spec(4), None], RankContext(4, HEADS, 0),
                      region.attach())  # fmt: skip
    OffloadWorker(
        caches(truths, 2, 0, empty=True), certified(2), RankContext(2, HEADS, 0), region.attach()
    )  # certified pages cross topologies
    with pytest.raises(ValueError, match=r"areas\[0\]: expected a canonical area"):
        region.rank0.claim_rows(None, [RowArea("layer 1", 0, 10, "opaque")])


def _state_worker(region: Any, tp: int, rank: int) -> Any:
    """A state layer of unrecognised layout (spec None: each rank's slot stored whole); TP=4's
    four slots and TP=2's two take the same bytes."""
    from canonical_ops.engine.hybrid import StateWorker

    slots = (torch.zeros(3, 4, 16 * 4 // tp, dtype=torch.bfloat16),
             torch.zeros(3, 2, 4 * 4 // tp, dtype=torch.float32))  # fmt: skip
    return StateWorker([slots], [None], RankContext(tp, HEADS, rank), region)


def test_state_workers_claim_their_region_rows(regions: Any) -> None:
    """A StateWorker took only a tensor: the demo handed it ``region.tensor``, so readers of
    another TP were never checked against the writers' opaque state slots."""
    region = regions(1 + 3, 640)
    writer = _state_worker(region.attach(), 4, 0)
    assert writer.fallback_reasons and writer.row_bytes == 640
    _state_worker(region.attach(), 4, 1)  # the same topology
    with pytest.raises(RegionTopologyError) as refused:
        _state_worker(region.attach(), 2, 0)
    message = str(refused.value)
    assert message.startswith("rows: shared offload region ")
    assert "state layer 0 is stored opaque at tp=2, dcp=1, pcp=1, interleave=1" in message
    assert "claimed by workers at tp=4" in message


def _damage(region: SharedOffloadRegion, offset: int, raw: bytes) -> None:
    fd = os.open(region.path, os.O_WRONLY)
    try:
        os.pwrite(fd, raw, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("damage", ["flags", "unflagged topology"])
def test_a_damaged_record_stays_damaged_when_a_rank_attaches(regions: Any, damage: str) -> None:
    """Attaching rewrites the header: it used to re-pack the claims it parsed, so a record
    damaged by an unknown flag (or a topology without its flag) came back as "nothing
    claimed" and the next worker of any topology was admitted."""
    region = regions(3, 1000)
    at = region_module._HEADER.size
    _damage(region.rank0, at, struct.pack("<I", 4) if damage == "flags" else b"")
    if damage != "flags":
        _damage(region.rank0, at + 8, struct.pack("<4I", 4, 1, 1, 1))
    attached = region.attach()
    for claimant in (attached, region.rank0):
        with pytest.raises(RegionTopologyError, match="record of the workers' claims is damaged"):
            claimant.claim_rows((2, 1, 1, 1), [RowArea("layer 0", 0, 1000, "opaque")])


def test_two_threads_claiming_at_once_see_each_other(regions: Any, monkeypatch: Any) -> None:
    """flock excludes other open files, not two threads on one region object: both read the
    empty record, both were admitted, and the last write dropped the other's claim."""
    import threading

    region = regions(1, 1000).rank0
    both_read = threading.Barrier(2)
    read = region_module._Header.read

    def slow_read(fd: int) -> Any:
        header = read(fd)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_read.wait(timeout=0.5)  # both inside together, unless one waits for the other
        return header

    monkeypatch.setattr(region_module._Header, "read", staticmethod(slow_read))
    outcomes: dict[int, BaseException | None] = {}

    def claim(tp: int) -> None:
        try:
            region.claim_rows((tp, 1, 1, 1), [RowArea("layer 0", 0, 1000, "opaque")])
            outcomes[tp] = None
        except RegionTopologyError as error:
            outcomes[tp] = error

    threads = [threading.Thread(target=claim, args=(tp,)) for tp in (2, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(error is None for error in outcomes.values()) == [False, True], outcomes


def test_every_rank_of_a_model_alternating_opaque_and_certified_layers_is_admitted(
    regions: Any,
) -> None:
    """Same-topology canonical areas are checked against the opaque ranges now: joined
    ranges (past MAX_RANGES) would swallow the certified layers between them and refuse the
    writers' own ranks. 100 layers alternating fit the tables; ranks 1..3 claim as rank 0."""
    region = regions(1, 10_000).rank0
    areas = [RowArea(f"layer {i}", 100 * i, 100 * (i + 1), "opaque" if i % 2 else None)
             for i in range(100)]  # fmt: skip
    for _ in range(4):
        region.claim_rows((4, 1, 1, 1), areas)
    region.claim_rows((2, 1, 1, 1), [RowArea("layer 98", 9_800, 9_900)])  # certified: crosses
    with pytest.raises(RegionTopologyError, match=r"layer 99 \(bytes \[9900, 10000\]"):
        region.claim_rows((2, 1, 1, 1), [RowArea("layer 99", 9_900, 10_000)])
