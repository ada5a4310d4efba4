"""Quantised KV (fp8): data and scales across TP, through the ops, units, worker and tiers.

The truth is one unsharded model: every (layer, block, token, head) has fp8 K
and V bytes and, with per-token-head scales, a float32 K and V scale. Writers
at one TP store their shards, units go through a FileStore, readers at
another TP load their own heads; every byte of data and scales is compared
with the truth. A reader that quantises differently (KV dtype, granularity,
scale dtype, per-tensor values, scale page packing) lands in another
namespace: a miss, its destination untouched.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import canonical_ops
from canonical_ops.engine import OffloadWorker, PageManager
from canonical_ops.engine.cache import StageCache
from canonical_ops.units import (
    FileStore,
    LayerGeometry,
    ModelIdentity,
    StoreNamespace,
)
from layouts import (
    KVScales,
    LayerSpec,
    RankContext,
    derive_group_mappings,
    derive_scaled_group_mappings,
)

MODEL = ModelIdentity("test/fp8-model", "r1")
HEADS, BLOCK, HEAD_SIZE, LAYERS, BLOCKS = 8, 16, 32, 2, 6
LAYOUTS = [(p, o) for p in ("packed", "split") for o in ("NHD", "HND")]
TOPOLOGIES = [(4, 2), (1, 8)]
PER_TENSOR = KVScales("per-tensor", k_scale=0.0125, v_scale=0.375)
PER_TOKEN_HEAD = KVScales("per-token-head")
FP8 = "float8_e4m3fn"


# ---------------------------------------------------------------------- truth and caches


def truth_data(layer: int) -> torch.Tensor:
    """fp8 bits of every block, token, head, (K, V), element: uint8 (B, T, H, 2, hs)."""
    gen = torch.Generator().manual_seed(1000 + layer)
    return torch.randint(0, 256, (BLOCKS, BLOCK, HEADS, 2, HEAD_SIZE), generator=gen).to(
        torch.uint8
    )


def truth_scales(layer: int) -> torch.Tensor:
    """float32 K and V scale of every block, token, head: (B, T, H, 2, 1), all distinct."""
    gen = torch.Generator().manual_seed(2000 + layer)
    return torch.rand((BLOCKS, BLOCK, HEADS, 2, 1), generator=gen) + 0.5


def to_cache(logical: torch.Tensor, packing: str, order: str) -> torch.Tensor:
    """(n, tokens, heads, 2, hs) -> a cache tensor of that packing and stride order."""
    n, tokens, heads, _, hs = logical.shape
    if packing == "packed":
        content = logical.reshape(n, tokens, heads, 2 * hs)  # K then V per (token, head)
        if order == "NHD":
            return content.contiguous().permute(0, 2, 1, 3)
        return content.permute(0, 2, 1, 3).contiguous()
    if order == "NHD":
        return logical.permute(0, 3, 1, 2, 4).contiguous()
    return logical.permute(0, 3, 2, 1, 4).contiguous().permute(0, 1, 3, 2, 4)


def from_cache(cache: torch.Tensor, packing: str) -> torch.Tensor:
    """Inverse of :func:`to_cache`: (n, tokens, heads, 2, hs)."""
    if packing == "packed":
        n, heads, tokens, width = cache.shape
        return cache.permute(0, 2, 1, 3).reshape(n, tokens, heads, 2, width // 2)
    return cache.permute(0, 2, 3, 1, 4)


def heads_of(tp: int, rank: int) -> slice:
    per = HEADS // tp
    return slice(rank * per, (rank + 1) * per)


def spec_of(tp: int, packing: str, order: str, dtype: str = FP8) -> LayerSpec:
    return LayerSpec("full", BLOCK, HEADS // tp, HEAD_SIZE, dtype, packing, order)


def rank_caches(tp, rank, packing, order, scales, *, blocks=None, empty=False):
    """One rank's data (and per-token-head scale) caches, the prompt at ``blocks``."""
    n = BLOCKS + 3
    blocks = torch.arange(BLOCKS) if blocks is None else blocks
    data, scale = [], []
    for layer in range(LAYERS):
        logical = torch.zeros((n, BLOCK, HEADS // tp, 2, HEAD_SIZE), dtype=torch.uint8)
        if not empty:
            logical[blocks] = truth_data(layer)[:, :, heads_of(tp, rank)]
        data.append(to_cache(logical, packing, order).view(getattr(torch, FP8)))
        if scales is not None and scales.has_page:
            logical = torch.zeros((n, BLOCK, HEADS // tp, 2, 1), dtype=torch.float32)
            if not empty:
                logical[blocks] = truth_scales(layer)[:, :, heads_of(tp, rank)]
            scale.append(to_cache(logical, scales.packing, order))
    return data, (scale or None)


def wrong_bytes(tp, rank, data, scale, packing, scales, blocks) -> int:
    """Bytes of the rank's loaded blocks (data and scales) that differ from the truth."""
    wrong = 0
    for layer in range(LAYERS):
        got = from_cache(data[layer].view(torch.uint8)[blocks], packing)
        want = truth_data(layer)[:, :, heads_of(tp, rank)]
        wrong += int((got != want).sum())
        if scale is not None:
            got = from_cache(scale[layer][blocks], scales.packing).contiguous()
            want = truth_scales(layer)[:, :, heads_of(tp, rank)].contiguous()
            wrong += int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
    return wrong


def namespace_of(tp, packing, order, scales, dtype=FP8) -> StoreNamespace:
    spec = spec_of(tp, packing, order, dtype)
    return StoreNamespace.from_specs(
        MODEL,
        [spec] * LAYERS,
        RankContext(tp, HEADS, 0),
        kv_quant="fp8",
        scales=None if scales is None else [scales] * LAYERS,
    )


def layer_plan(tp, rank, packing, order, scales):
    """This rank's mappings, layer by layer: data, then scales (the unit's order)."""
    out = []
    for _ in range(LAYERS):
        data, scale = derive_scaled_group_mappings(spec_of(tp, packing, order), scales, tp, HEADS)
        out.append(data[rank])
        if scale is not None:
            out.append(scale[rank])
    return out


def interleave(data, scale):
    if scale is None:
        return list(data)
    return [t for pair in zip(data, scale) for t in pair]


# ---------------------------------------------------------------------- ops + file units


@pytest.mark.parametrize("scales", [PER_TENSOR, PER_TOKEN_HEAD], ids=lambda s: s.granularity)
@pytest.mark.parametrize(("writer_tp", "reader_tp"), TOPOLOGIES, ids=lambda t: f"tp{t}")
@pytest.mark.parametrize(("packing", "order"), LAYOUTS, ids=lambda x: x)
def test_ops_and_file_units_bit_exact_across_tp(
    tmp_path, packing, order, writer_tp, reader_tp, scales
):
    ns_w = namespace_of(writer_tp, packing, order, scales)
    ns_r = namespace_of(reader_tp, packing, order, scales)
    assert ns_w.digest == ns_r.digest  # certified: the namespace is parallelism free
    assert not ns_w.topology_bound
    rows = torch.zeros((BLOCKS, ns_w.total_bytes), dtype=torch.uint8)
    page_ids = torch.arange(BLOCKS)
    for rank in range(writer_tp):
        data, scale = rank_caches(writer_tp, rank, packing, order, scales)
        tensors = interleave(data, scale)
        plan = canonical_ops.make_plan(
            layer_plan(writer_tp, rank, packing, order, scales), tensors, rows
        )
        canonical_ops.store(tensors, rows, plan, torch.arange(BLOCKS), page_ids)
    keys = [f"block-{b}".encode() for b in range(BLOCKS)]
    with FileStore(tmp_path, ns_w, fsync=False) as files:
        for b, key in enumerate(keys):
            assert files.store(key, 0, rows[b].numpy(), b).status == "ok"
    # A reader process of its own: another store object, rows filled from the units only.
    loaded = torch.full_like(rows, 0xAB)
    with FileStore(tmp_path, ns_r, fsync=False) as files:
        assert files.lookup(keys, 0, LAYERS) == BLOCKS
        for b, key in enumerate(keys):
            assert files.load(key, 0, LAYERS, loaded[b].numpy()).status == "ok"
    assert torch.equal(loaded, rows)
    blocks = torch.tensor([7, 2, 5, 0, 8, 3])  # scattered cache blocks of the reader
    for rank in range(reader_tp):
        data, scale = rank_caches(reader_tp, rank, packing, order, scales, empty=True)
        tensors = interleave(data, scale)
        plan = canonical_ops.make_plan(
            layer_plan(reader_tp, rank, packing, order, scales), tensors, loaded
        )
        canonical_ops.load(tensors, loaded, plan, blocks, page_ids)
        assert wrong_bytes(reader_tp, rank, data, scale, packing, scales, blocks) == 0


@pytest.mark.parametrize(("packing", "order"), LAYOUTS, ids=lambda x: x)
def test_fp8_data_bytes_are_the_bf16_derivation_with_one_byte_elements(packing, order):
    """The data page of an fp8 layer is placed exactly as any dtype's (vLLM's format v1)."""
    for tp in (1, 2, 4, 8):
        fp8 = derive_group_mappings(spec_of(tp, packing, order), tp, HEADS)
        # A uint8 layer of the same geometry is the same bytes (element size 1).
        u8 = derive_group_mappings(spec_of(tp, packing, order, "uint8"), tp, HEADS)
        assert fp8 == u8 and all(m.fallback_reason is None for m in fp8)
        data, scale = derive_scaled_group_mappings(
            spec_of(tp, packing, order), PER_TOKEN_HEAD, tp, HEADS
        )
        assert data == fp8
        assert scale[0].canonical_page_size_bytes == HEADS * BLOCK * 2 * 4
        assert all(m.parallelism_agnostic and m.fallback_reason is None for m in scale)


def test_canonical_rows_do_not_depend_on_the_writer_tp():
    """TP=1, 2, 4 and 8 writers produce the very same canonical rows, scales included."""
    rows_by_tp = []
    for tp in (1, 2, 4, 8):
        rows = torch.zeros(
            (BLOCKS, namespace_of(tp, "split", "HND", PER_TOKEN_HEAD).total_bytes),
            dtype=torch.uint8,
        )
        for rank in range(tp):
            data, scale = rank_caches(tp, rank, "split", "HND", PER_TOKEN_HEAD)
            tensors = interleave(data, scale)
            plan = canonical_ops.make_plan(
                layer_plan(tp, rank, "split", "HND", PER_TOKEN_HEAD), tensors, rows
            )
            canonical_ops.store(tensors, rows, plan, torch.arange(BLOCKS), torch.arange(BLOCKS))
        rows_by_tp.append(rows)
    assert all(torch.equal(rows_by_tp[0], r) for r in rows_by_tp[1:])
    # The unit of a layer is its data page, then its scales (K scales of every token, then V).
    data_bytes = HEADS * BLOCK * 2 * HEAD_SIZE
    scales_page = rows_by_tp[0][0, data_bytes : data_bytes + HEADS * BLOCK * 2 * 4]
    # split HND scale page: (2, heads, tokens, 1) float32
    want = truth_scales(0)[0].permute(2, 1, 0, 3).contiguous()
    assert torch.equal(scales_page.view(torch.float32).view(2, HEADS, BLOCK, 1), want)


# ---------------------------------------------------------------------- misses, never misreads


def _store_units(root, ns, rows, keys):
    with FileStore(root, ns, fsync=False) as files:
        for b, key in enumerate(keys):
            assert files.store(key, 0, rows[b], b).status == "ok"


READERS_THAT_DIFFER = {
    "kv dtype e5m2": dict(dtype="float8_e5m2"),
    "no scales": dict(scales=None),
    "per-tensor": dict(scales=PER_TENSOR),
    "scale dtype float16": dict(scales=KVScales("per-token-head", dtype="float16")),
    "scale page packed": dict(scales=KVScales("per-token-head", packing="packed")),
}


@pytest.mark.parametrize("reader", list(READERS_THAT_DIFFER), ids=lambda r: r)
def test_a_reader_that_quantises_differently_misses(tmp_path, reader):
    writer = namespace_of(4, "split", "NHD", PER_TOKEN_HEAD)
    kwargs = dict(dtype=FP8, scales=PER_TOKEN_HEAD) | READERS_THAT_DIFFER[reader]
    other = namespace_of(2, "split", "NHD", kwargs["scales"], kwargs["dtype"])
    assert other.digest != writer.digest
    keys = [b"k0", b"k1"]
    rows = np.random.default_rng(3).integers(0, 256, (2, writer.total_bytes), dtype=np.uint8)
    _store_units(tmp_path, writer, rows, keys)
    with FileStore(tmp_path, other, fsync=False) as files:
        assert files.lookup(keys, 0, LAYERS) == 0
        for key in keys:
            destination = np.full(other.total_bytes, 0xAB, np.uint8)
            assert files.load(key, 0, LAYERS, destination).status == "miss"
            assert (destination == 0xAB).all()  # zero bytes written, none wrong
    # The control: the writer's own quantisation at another TP reads the units.
    same = namespace_of(2, "split", "NHD", PER_TOKEN_HEAD)
    with FileStore(tmp_path, same, fsync=False) as files:
        assert files.lookup(keys, 0, LAYERS) == 2


@pytest.mark.parametrize(
    "values", [(0.0125, 0.5), (0.25, 0.375), (0.0125 * (1 + 2**-20), 0.375)], ids=str
)
def test_per_tensor_scales_of_other_values_miss(tmp_path, values):
    writer = namespace_of(4, "packed", "NHD", PER_TENSOR)
    other = namespace_of(
        8, "packed", "NHD", KVScales("per-tensor", k_scale=values[0], v_scale=values[1])
    )
    assert other.digest != writer.digest
    rows = np.zeros((1, writer.total_bytes), np.uint8)
    _store_units(tmp_path, writer, rows, [b"k"])
    with FileStore(tmp_path, other, fsync=False) as files:
        assert files.lookup([b"k"], 0, LAYERS) == 0


def test_per_tensor_scales_travel_exactly_in_the_namespace(tmp_path):
    """A reader gets exactly the writer's float32 values from the store's namespace.json."""
    k = float(np.float32(0.1))  # not a short decimal: the text must still be exact
    scales = KVScales("per-tensor", k_scale=0.1, v_scale=np.float32(3.3e-3))
    assert scales.k_scale == k  # taken at float32 precision, as the engine holds it
    ns = namespace_of(4, "packed", "HND", scales)
    with FileStore(tmp_path, ns, fsync=False) as store:  # namespace.json comes with a first unit
        assert store.store(b"k", 0, np.zeros(ns.layer_bytes(0, ns.num_layers), np.uint8), 0).ok
    with open(os.path.join(tmp_path, ns.hex, "namespace.json")) as f:
        again = StoreNamespace.from_description(json.load(f))
    assert again.digest == ns.digest
    for layer in again.layers:
        got = np.array([layer.scales.k_scale, layer.scales.v_scale], np.float32)
        want = np.array([0.1, 3.3e-3], np.float32)
        assert got.tobytes() == want.tobytes()
    # A forged description: a value float32 cannot hold, or an unknown field, is refused.
    desc = ns.describe()
    desc["layers"][0]["scales"]["k_scale"] = 0.1
    with pytest.raises(ValueError, match="exact in float32"):
        StoreNamespace.from_description(desc)
    desc = ns.describe()
    desc["layers"][0]["scales"]["packing"] = "split"
    with pytest.raises(ValueError, match="scales: expected fields"):
        StoreNamespace.from_description(desc)


def test_namespaces_without_scales_keep_their_digests():
    """Digests computed before scales existed (pinned): old units stay readable."""
    old_bf16 = StoreNamespace.from_specs(
        ModelIdentity("test/model", "r1"),
        [LayerSpec("full", 16, 2, 128, "bfloat16", "packed", "NHD")] * 4,
        RankContext(4, 8, 0),
    )
    assert old_bf16.hex == "6e11ba9945c554951cdb85c73dd81c4b7956176c8bb2d4e2a4a43e2c841303e1"
    old_fp8 = StoreNamespace.from_specs(
        ModelIdentity("test/model", "r1"),
        [LayerSpec("full", 16, 2, 128, FP8, "split", "HND")] * 4,
        RankContext(4, 8, 0),
        kv_quant="fp8",
    )
    assert old_fp8.hex == "05fd563c2bad117de0b52c7570a5a49264287c35fa916f463d3641eb070f55bb"
    inline = LayerSpec("full", 16, 2, 128, FP8, "packed", "NHD", per_token_head_scales=True)
    old_inline = StoreNamespace.from_specs(
        ModelIdentity("test/model", "r1"),
        [inline] * 2,
        RankContext(4, 8, 0),
        kv_quant="fp8_per_token_head",
    )
    assert old_inline.hex == "e73b2f375102a0795a26cef1f60445e5de002bff308190060f530fd401147304"
    assert old_inline.layers[0].opaque  # scales inside the page: still never certified
    # Declaring the scales of that fp8 model is another namespace (never the old units).
    scaled = StoreNamespace.from_specs(
        ModelIdentity("test/model", "r1"),
        [LayerSpec("full", 16, 2, 128, FP8, "split", "HND")] * 4,
        RankContext(4, 8, 0),
        kv_quant="fp8",
        scales=[PER_TENSOR] * 4,
    )
    assert scaled.digest != old_fp8.digest
    assert "scales" not in old_fp8.describe()["layers"][0]


def test_geometry_counts_the_scale_page_and_checks_claims():
    ns = namespace_of(2, "split", "NHD", PER_TOKEN_HEAD)
    data = HEADS * BLOCK * 2 * HEAD_SIZE
    assert ns.layers[0].canonical_page_size_bytes == data + HEADS * BLOCK * 2 * 4
    desc = ns.layers[0].describe()
    desc["canonical_page_size_bytes"] = data  # a unit without its scales
    with pytest.raises(ValueError, match="canonical_page_size_bytes"):
        LayerGeometry.from_description(desc)
    bf16 = namespace_of(2, "split", "NHD", None, "bfloat16").layers[0].describe()
    with pytest.raises(ValueError, match="quantised dtype"):
        LayerGeometry.from_description(bf16 | {"scales": PER_TOKEN_HEAD.describe()})


# ---------------------------------------------------------------------- layouts


def test_kv_scales_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError, match="granularity"):
        KVScales("per-block")
    with pytest.raises(ValueError, match="k_scale, v_scale: expected both"):
        KVScales("per-tensor", k_scale=1.0)
    with pytest.raises(ValueError, match="k_scale"):
        KVScales("per-tensor", k_scale=-1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="v_scale"):
        KVScales("per-tensor", k_scale=1.0, v_scale=float("nan"))
    with pytest.raises(ValueError, match="v_scale"):
        KVScales("per-tensor", k_scale=1.0, v_scale=1e300)  # overflows float32
    with pytest.raises(TypeError, match="k_scale"):
        KVScales("per-tensor", k_scale=True, v_scale=1.0)
    with pytest.raises(ValueError, match="expected None"):
        KVScales("per-token-head", k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="dtype"):
        KVScales("per-token-head", dtype="bfloat16")
    with pytest.raises(ValueError, match="packing"):
        KVScales("per-token-head", packing="interleaved")
    bf16 = spec_of(2, "split", "NHD", "bfloat16")
    with pytest.raises(ValueError, match="quantised dtype"):
        derive_scaled_group_mappings(bf16, PER_TOKEN_HEAD, 2, HEADS)
    inline = LayerSpec("full", BLOCK, 4, HEAD_SIZE, FP8, "split", "NHD", per_token_head_scales=True)
    with pytest.raises(ValueError, match="per_token_head_scales=True"):
        derive_scaled_group_mappings(inline, PER_TOKEN_HEAD, 2, HEADS)
    mla = LayerSpec("mla", 64, 1, 576, FP8, "packed", "NHD")
    with pytest.raises(ValueError, match="full attention"):
        derive_scaled_group_mappings(mla, PER_TOKEN_HEAD, 2, 1)
    data, none = derive_scaled_group_mappings(mla, PER_TENSOR, 2, 1)  # per-tensor MLA: fine
    assert none is None and data[0].fallback_reason is None


def test_scales_of_an_uncertifiable_topology_are_opaque_with_the_data():
    spec = LayerSpec("full", BLOCK, 1, HEAD_SIZE, FP8, "packed", "NHD")
    data, scale = derive_scaled_group_mappings(spec, PER_TOKEN_HEAD, 4, 6)  # 4 does not divide 6
    assert all(m.fallback_reason and "tp_size=4" in m.fallback_reason for m in data + scale)
    assert scale[3].runs[0].canonical_offset == 3 * BLOCK * 2 * 4
    geometry = LayerGeometry.from_spec(spec, RankContext(4, 6, 0), PER_TOKEN_HEAD)
    assert geometry.opaque and geometry.canonical_page_size_bytes == 4 * (
        spec.page_size_bytes + BLOCK * 2 * 4
    )


# ---------------------------------------------------------------------- worker + StageCache


class Engine:
    """One TP group's workers over one stage's rows, and its StageCache over a FileStore."""

    def __init__(self, root, tp, packing, order, scales, *, empty):
        self.tp, self.packing, self.scales = tp, packing, scales
        self.ns = namespace_of(tp, packing, order, scales)
        self.files = FileStore(root, self.ns, fsync=False)
        self.manager = PageManager(BLOCKS + 2)
        self.rows = torch.zeros((BLOCKS + 2, self.ns.total_bytes), dtype=torch.uint8)
        self.cache = StageCache(self.manager, self.rows, (0, LAYERS), self.ns, [self.files])
        self.blocks = torch.randperm(BLOCKS + 3, generator=torch.Generator().manual_seed(tp))[
            :BLOCKS
        ]
        self.ranks = []
        for rank in range(tp):
            data, scale = rank_caches(
                tp, rank, packing, order, scales, blocks=self.blocks, empty=empty
            )
            worker = OffloadWorker(
                data,
                [spec_of(tp, packing, order)] * LAYERS,
                RankContext(tp, HEADS, rank),
                self.rows,
                scales=[scales] * LAYERS,
                scale_caches=scale,
            )
            self.ranks.append((worker, data, scale))

    def close(self):
        self.cache.close()
        self.files.close()


@pytest.mark.parametrize(
    ("packing", "order", "writer_tp", "reader_tp", "scales"),
    [
        ("split", "HND", 4, 2, PER_TOKEN_HEAD),
        ("packed", "NHD", 1, 8, PER_TOKEN_HEAD),
        ("split", "NHD", 4, 2, KVScales("per-token-head", packing="packed")),
        ("packed", "HND", 1, 8, PER_TENSOR),
    ],
    ids=lambda x: getattr(x, "granularity", x),
)
def test_worker_and_stage_cache_through_files(
    tmp_path, packing, order, writer_tp, reader_tp, scales
):
    keys = [f"h{b}".encode() for b in range(BLOCKS)]
    writer = Engine(tmp_path, writer_tp, packing, order, scales, empty=False)
    try:
        assert writer.ranks[0][0].is_topology_independent
        kinds = [kind for _, kind in writer.ranks[0][0].plan_entries]
        assert kinds == (["kv", "scales"] if scales.has_page else ["kv"]) * LAYERS
        pages = writer.manager.allocate(keys)
        for worker, _, _ in writer.ranks:
            worker.wait(worker.store(block_ids=writer.blocks, page_ids=pages))
        for page in pages:
            writer.manager.complete_store(page, 0, generation=writer.manager.generation(page))
        writer.cache.persist(keys, positions=list(range(BLOCKS)))
        assert [e.status for e in writer.cache.drain(30)] == ["ok"] * BLOCKS
    finally:
        writer.close()
    reader = Engine(tmp_path, reader_tp, packing, order, scales, empty=True)
    try:
        found = reader.cache.lookup(keys, timeout=30)
        assert found.from_tiers == BLOCKS
        reader.cache.fetch(keys, found)
        assert [e.status for e in reader.cache.drain(30)] == ["ok"] * BLOCKS
        pages = [reader.manager.page_of(k) for k in keys]
        for rank, (worker, data, scale) in enumerate(reader.ranks):
            worker.wait(worker.load(block_ids=reader.blocks, page_ids=pages))
            assert wrong_bytes(reader_tp, rank, data, scale, packing, scales, reader.blocks) == 0
    finally:
        reader.close()


def test_worker_refuses_missing_or_wrong_scale_tensors():
    data, scale = rank_caches(2, 0, "split", "NHD", PER_TOKEN_HEAD)
    specs = [spec_of(2, "split", "NHD")] * LAYERS
    ctx = RankContext(2, HEADS, 0)
    ns = namespace_of(2, "split", "NHD", PER_TOKEN_HEAD)
    rows = torch.zeros((4, ns.total_bytes), dtype=torch.uint8)
    scales = [PER_TOKEN_HEAD] * LAYERS
    with pytest.raises(ValueError, match=r"scale_caches\[0\]: expected the layer's per-token-head"):
        OffloadWorker(data, specs, ctx, rows, scales=scales)
    with pytest.raises(ValueError, match=r"scale_caches\[1\]: does not match.*dtype float32"):
        OffloadWorker(
            data, specs, ctx, rows, scales=scales, scale_caches=[scale[0], scale[1].half()]
        )
    packed = KVScales("per-token-head", packing="packed")
    with pytest.raises(ValueError, match=r"scale_caches\[0\]: does not match"):
        OffloadWorker(data, specs, ctx, rows, scales=[packed] * LAYERS, scale_caches=scale)
    with pytest.raises(ValueError, match=r"scale_caches\[0\]: expected None"):
        OffloadWorker(data, specs, ctx, rows, scales=[PER_TENSOR] * LAYERS, scale_caches=scale)
    with pytest.raises(ValueError, match=r"scales\[0\]: cannot scale"):
        as_uint8 = [t.view(torch.uint8) for t in data]
        OffloadWorker(
            as_uint8,
            [spec_of(2, "split", "NHD", "uint8")] * LAYERS,
            ctx,
            rows,
            scales=scales,
            scale_caches=scale,
        )
    with pytest.raises(ValueError, match="scales: expected one entry"):
        OffloadWorker(data, specs, ctx, rows, scales=[PER_TOKEN_HEAD])
    worker = OffloadWorker(data, specs, ctx, rows, scales=scales, scale_caches=scale)
    assert worker.row_bytes == ns.total_bytes
    worker.scale_caches[1] = scale[1].clone()
    with pytest.raises(ValueError, match=r"scale_caches\[1\]: expected the tensor"):
        worker.store(block_ids=[0], page_ids=[0])


def test_opaque_scaled_layer_round_trips_at_its_own_topology():
    """TP=4 over 6 heads cannot be certified: data and scales opaque, same-topology reads."""
    spec = LayerSpec("full", BLOCK, 1, HEAD_SIZE, FP8, "split", "NHD")
    ctx_of = lambda r: RankContext(4, 6, r)  # noqa: E731
    geometry = LayerGeometry.from_spec(spec, ctx_of(0), PER_TOKEN_HEAD)
    rows = torch.zeros((2, geometry.canonical_page_size_bytes), dtype=torch.uint8)
    before = []
    for rank in range(4):
        gen = torch.Generator().manual_seed(rank)
        data = torch.randint(0, 256, (3, 2, BLOCK, 1, HEAD_SIZE), generator=gen).to(torch.uint8)
        scale = torch.rand((3, 2, BLOCK, 1, 1), generator=gen)
        worker = OffloadWorker(
            [data.view(torch.float8_e4m3fn)],
            [spec],
            ctx_of(rank),
            rows,
            scales=[PER_TOKEN_HEAD],
            scale_caches=[scale],
        )
        assert worker.opaque_layers == [0] and "topo-tp4" in worker.storage_namespace
        worker.store(block_ids=[1], page_ids=[0])
        before.append((data[1].clone(), scale[1].clone()))
        data.zero_()
        scale.zero_()
        worker.load(block_ids=[2], page_ids=[0])
        assert torch.equal(data[2], before[rank][0]) and torch.equal(scale[2], before[rank][1])
