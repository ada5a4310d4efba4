"""SGLang and the standalone engine share units: the same keys, namespace and bytes.

The engine side is the ops core as ``canonical_ops.engine`` runs it: each rank's split-NHD
KV cache is stored into region rows with ``canonical_ops.store`` (one plan per rank, as
``OffloadWorker`` builds it), and a row goes to the file store under the block's token
key, as ``StageCache.persist`` hands its rows to ``FileStore``. Reading back is the same
path in reverse (``FileStore.load`` then ``canonical_ops.load``).
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang_harness import Model, check_pages, fill_pages, make_backend, make_pool

import canonical_ops
from canonical_ops.units import FileStore, ModelIdentity, StoreNamespace
from canonical_ops.units.token_keys import TokenKeyScheme
from layouts import LayerSpec, RankContext, derive_group_mappings

MODEL = Model(name="test/frontend-shared", total_heads=4, layers=3)
BLOCKS = 3
TOKENS = list(range(7, 7 + BLOCKS * MODEL.page_size))
SCHEME = TokenKeyScheme("sha256", MODEL.page_size)  # the backend's default: hash blocks = pages


def frontend_spec(model: Model, tp: int) -> LayerSpec:
    heads = len(model.global_heads(tp, 0))
    return LayerSpec("full", model.page_size, heads, model.head_dim, "bfloat16", "split", "NHD")


def frontend_namespace(model: Model, tp: int) -> StoreNamespace:
    ctx = RankContext(tp, model.total_heads, 0)
    own = StoreNamespace.from_specs(
        ModelIdentity(model.name), [frontend_spec(model, tp)] * model.layers, ctx
    )
    return own.shared_prefix(SCHEME)


def frontend_caches(model: Model, tp: int, rank: int, *, truth: bool):
    """One rank's split-NHD caches (blocks, 2, block, heads, dim), per layer."""
    heads = model.global_heads(tp, rank)
    caches = []
    for layer in range(model.layers):
        cache = torch.zeros(
            BLOCKS, 2, model.page_size, len(heads), model.head_dim, dtype=model.dtype
        )
        if truth:
            kv = model.truth(layer, len(TOKENS))[:, :, heads]  # (2, tokens, heads, dim)
            cache.copy_(kv.reshape(2, BLOCKS, model.page_size, len(heads), -1).transpose(0, 1))
        caches.append(cache)
    return caches


def plan_for(model, tp, rank, caches, rows):
    mapping = derive_group_mappings(frontend_spec(model, tp), tp, model.total_heads)[rank]
    return canonical_ops.make_plan([mapping] * model.layers, caches, rows)


def test_frontend_tp4_writes_sglang_tp2_reads(extra):
    namespace = frontend_namespace(MODEL, 4)
    rows = torch.zeros(BLOCKS, namespace.layer_bytes(0, MODEL.layers), dtype=torch.uint8)
    ids = torch.arange(BLOCKS)
    for rank in range(4):
        caches = frontend_caches(MODEL, 4, rank, truth=True)
        canonical_ops.store(caches, rows, plan_for(MODEL, 4, rank, caches, rows), ids, ids)
    keys = SCHEME.unit_keys(TOKENS, MODEL.page_size)
    with FileStore(extra["store"], namespace) as store:
        for i, key in enumerate(keys):
            assert store.store(key, 0, rows[i].numpy(), i).status == "ok"

    readers = []
    for rank in range(2):
        pool = make_pool(MODEL, 2, rank, "page_first")
        readers.append((pool, make_backend(pool, 2, rank, extra, model_name=MODEL.name)))
    assert readers[0][1].core.namespace.digest == namespace.digest
    sglang_keys = get_storage_hash_str(TOKENS, None, page_size=MODEL.page_size)
    for rank, (pool, backend) in enumerate(readers):
        slots = pool.alloc(len(TOKENS))
        assert backend.batch_get_v1(sglang_keys, slots) == [True] * BLOCKS
        check_pages(MODEL, pool, 2, rank, slots)


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_sglang_tp2_writes_frontend_tp4_reads(extra, layout):
    writers = []
    for rank in range(2):
        pool = make_pool(MODEL, 2, rank, layout)
        writers.append((pool, make_backend(pool, 2, rank, extra, model_name=MODEL.name)))
    sglang_keys = get_storage_hash_str(TOKENS, None, page_size=MODEL.page_size)
    for rank, (pool, backend) in enumerate(writers):
        slots = pool.alloc(len(TOKENS))
        fill_pages(MODEL, pool, 2, rank, slots)
        assert backend.batch_set_v1(sglang_keys, slots) == [True] * BLOCKS

    namespace = frontend_namespace(MODEL, 4)
    rows = torch.zeros(BLOCKS, namespace.layer_bytes(0, MODEL.layers), dtype=torch.uint8)
    with FileStore(extra["store"], namespace) as store:
        keys = SCHEME.unit_keys(TOKENS, MODEL.page_size)
        assert store.lookup(keys, 0, MODEL.layers) == BLOCKS
        for i, key in enumerate(keys):
            assert store.load(key, 0, MODEL.layers, rows[i].numpy()).status == "ok"
    ids = torch.arange(BLOCKS)
    for rank in range(4):
        caches = frontend_caches(MODEL, 4, rank, truth=False)
        canonical_ops.load(caches, rows, plan_for(MODEL, 4, rank, caches, rows), ids, ids)
        expected = frontend_caches(MODEL, 4, rank, truth=True)
        for layer, (got, want) in enumerate(zip(caches, expected)):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rank, layer)
