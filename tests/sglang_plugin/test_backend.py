"""canonical_ops.sglang against real SGLang: its factory, host pools, page hashing, interface.

Every backend is made as SGLang's HiCacheController makes it (``dynamic`` backend from the
factory, then ``register_mem_pool_host``), pages are keyed by SGLang's own page hashes
(``get_storage_hash_str``), and every byte read back is compared with an independent truth.
"""

from __future__ import annotations

import os

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang_harness import (
    MODEL,
    TOKENS,
    Model,
    check_mla,
    check_pages,
    fill_mla,
    fill_pages,
    fragments,
    group,
    make_backend,
    make_mla_pool,
    make_pool,
    pool_rows,
    sglang_keys,
    unit_files,
    write,
)

from canonical_ops.sglang import BackendSetupError
from canonical_ops.units.token_keys import TokenKeyScheme

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


# ------------------------------------------------------------------ SGLang's interface


def test_factory_makes_a_hicache_storage(extra):
    pool = make_pool(MODEL, 1, 0, "page_first")
    backend = make_backend(pool, 1, 0, extra, model_name=MODEL.name)
    assert isinstance(backend, HiCacheStorage)
    assert type(backend).__name__ == "CanonicalHiCacheStorage"
    assert backend.mem_pool_host is pool


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_every_layout(extra, store_dir, layout):
    ((pool, backend),) = group(MODEL, 1, layout, extra)
    keys = sglang_keys()
    assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
    slots = pool.alloc(len(TOKENS))
    fill_pages(MODEL, pool, 1, 0, slots)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert backend.batch_set_v1(keys, slots, info) == [True] * 3
    assert backend.batch_exists(keys) == 3 and backend.exists(keys[2])
    assert len(unit_files(store_dir)) == 3
    other = pool.alloc(len(TOKENS))
    assert backend.batch_get_v1(keys, other) == [True] * 3
    check_pages(MODEL, pool, 1, 0, other)


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_generic_flat_page_path(extra, layout):
    """The controller's non-v1 path: get_data_page(flat) -> set; get into a dummy page."""
    ((pool, backend),) = group(MODEL, 1, layout, extra)
    keys = sglang_keys()
    slots = pool.alloc(len(TOKENS))
    fill_pages(MODEL, pool, 1, 0, slots)
    pages = [pool.get_data_page(int(slots[i * MODEL.page_size])) for i in range(3)]
    assert backend.batch_set(keys, pages)
    dummies = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, dummies)
    other = pool.alloc(len(TOKENS))
    for i, page in enumerate(got):
        assert page is not None
        pool.set_from_flat_data_page(int(other[i * MODEL.page_size]), page)
    check_pages(MODEL, pool, 1, 0, other)


# ------------------------------------------------------------------ TP interop


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(4, 2), (2, 4), (4, 1)])
def test_tp_interop_bit_exact(extra, writer_tp, reader_tp):
    writers = group(MODEL, writer_tp, "page_first", extra)
    keys = sglang_keys()
    assert write(MODEL, writers, writer_tp, keys) == [[True] * 3] * writer_tp
    readers = group(MODEL, reader_tp, "layer_first", extra)
    assert sglang_keys() == keys
    for rank, (pool, backend) in enumerate(readers):
        assert backend.batch_exists(keys) == 3
        slots = pool.alloc(len(TOKENS))
        assert backend.batch_get_v1(keys, slots) == [True] * 3
        check_pages(MODEL, pool, reader_tp, rank, slots)


def test_replicated_heads_tp4_to_tp1(extra):
    """2 KV heads at TP=4: each head on two ranks, one of them elected to write it."""
    model = Model(name="test/tiny-2heads", total_heads=2)
    more = {**extra, "total_kv_heads": 2}
    writers = group(model, 4, "page_first_direct", more)
    keys = sglang_keys(model)
    assert [b.core.writers for _, b in writers] == [[0, 2]] * 4
    write(model, writers, 4, keys)
    ((pool, backend),) = group(model, 1, "page_first", more)
    sglang_keys(model)
    slots = pool.alloc(len(TOKENS))
    assert backend.batch_get_v1(keys, slots) == [True] * 3
    check_pages(model, pool, 1, 0, slots)


def test_unit_is_published_only_when_every_writer_stored(extra, store_dir):
    writers = group(MODEL, 4, "page_first", extra)
    keys = sglang_keys()
    write(MODEL, writers[:3], 4, keys)
    assert unit_files(store_dir) == []
    assert all(b.batch_exists(keys) == 0 for _, b in writers)
    pool, backend = writers[3]
    slots = pool.alloc(len(TOKENS))
    fill_pages(MODEL, pool, 4, 3, slots)
    assert backend.batch_set_v1(keys, slots) == [True] * 3
    assert len(unit_files(store_dir)) == 3
    assert fragments(extra) == []  # the publishing rank removed the shares


def test_corrupt_fragment_is_never_published(extra, store_dir):
    writers = group(MODEL, 2, "page_first", extra)
    keys = sglang_keys()
    write(MODEL, writers[:1], 2, keys)
    frag = fragments(extra)[0]
    data = bytearray(frag.read_bytes())
    data[-1] ^= 0xFF
    frag.write_bytes(bytes(data))
    results = write(MODEL, writers[1:], 2, keys)
    assert results[0].count(False) == 1  # the unit whose fragment is bad
    assert len(unit_files(store_dir)) == 2


# ------------------------------------------------------------------ misses


@pytest.mark.parametrize(
    ("reader", "over"),
    [
        (Model(name="test/other-model"), {}),
        (Model(dtype=torch.float16), {}),
        (Model(total_heads=8), {}),
        (Model(head_dim=16), {}),
        (MODEL, {"model_revision": "v2"}),
        (MODEL, {"kv_quant": "int8-experiment"}),
    ],
    ids=["model", "dtype", "heads", "head_dim", "revision", "kv_quant"],
)
def test_mismatched_identity_or_geometry_is_a_miss(extra, reader, over):
    ((pool, backend),) = group(MODEL, 1, "page_first", extra)
    keys = sglang_keys()
    write(MODEL, [(pool, backend)], 1, keys)
    ((rpool, rbackend),) = group(reader, 1, "page_first", {**extra, **over})
    sglang_keys(reader)  # the reader's engine hashes the same tokens
    assert rbackend.batch_exists(keys) == 0
    slots = rpool.alloc(len(TOKENS))
    before = pool_rows(rpool, slots)
    assert rbackend.batch_get_v1(keys, slots) == [False] * 3
    assert all(torch.equal(a, b) for a, b in zip(before, pool_rows(rpool, slots)))


def test_corrupt_unit_is_a_miss_and_writes_nothing(extra, store_dir):
    ((pool, backend),) = group(MODEL, 1, "page_first", extra)
    keys = sglang_keys()
    write(MODEL, [(pool, backend)], 1, keys)
    canonical = TokenKeyScheme("sha256", MODEL.page_size).unit_keys(TOKENS, MODEL.page_size)
    # Corrupt the second block's unit (its directory is named by sha256 of its key).
    import hashlib

    target = hashlib.sha256(canonical[1]).hexdigest()[:32]
    (path,) = [p for p in unit_files(store_dir) if p.parent.name == target]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    slots = pool.alloc(len(TOKENS))
    pool.kv_buffer.view(torch.int16).fill_(0x5A5A)
    before = pool_rows(pool, slots)
    assert backend.batch_get_v1(keys, slots) == [True, False, False]
    after = pool_rows(pool, slots)
    page = MODEL.page_size
    for layer in range(MODEL.layers):
        assert torch.equal(after[layer][:, page:], before[layer][:, page:])  # untouched
    assert backend.core.tier.metrics().corrupt_detected == 1


def test_unknown_or_salted_sglang_keys_are_misses(extra, store_dir):
    ((pool, backend),) = group(MODEL, 1, "page_first", extra)
    slots = pool.alloc(len(TOKENS))
    fill_pages(MODEL, pool, 1, 0, slots)
    assert backend.batch_set_v1(["f" * 64] * 3, slots) == [False] * 3

    class SaltedKey(list):  # SGLang's RadixKey carries the request's cache salt
        extra_key = None
        cache_salt = "tenant-a"

    salted = get_storage_hash_str(SaltedKey(TOKENS), None, page_size=MODEL.page_size)
    assert backend.batch_set_v1(salted, slots) == [False] * 3
    assert unit_files(store_dir) == []


def test_keys_follow_the_token_chain_across_calls(extra):
    """A chain SGLang hashes in two calls (prior hash) maps to the same canonical keys."""
    ((_, backend),) = group(MODEL, 1, "page_first", extra)
    page = MODEL.page_size
    head = get_storage_hash_str(TOKENS[:page], None, page_size=page)
    tail = get_storage_hash_str(TOKENS[page:], head[-1], page_size=page)
    expected = TokenKeyScheme("sha256", page).unit_keys(TOKENS, page)
    assert [backend.core.index.canonical(k) for k in head + tail] == expected


@pytest.mark.parametrize("hashed", ["partial page", "radix key limit"])
def test_a_page_of_fewer_tokens_has_no_canonical_key(extra, store_dir, hashed):
    """SGLang hashes a trailing partial page, and a RadixKey's tokens only up to its limit:
    that page holds fewer tokens than a unit, so it has no canonical key (a miss, never
    stored), never the key of a unit holding other tokens; the whole pages keep theirs."""
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey

    page = MODEL.page_size
    config = {**extra, "hash_block_tokens": page // 2}
    ((pool, backend),) = group(MODEL, 1, "page_first", config)
    n = page + page // 2 + 1  # one whole page, then a partial one of a whole hash block and more
    key = TOKENS[:n] if hashed == "partial page" else RadixKey(array("q", TOKENS), limit=n)
    keys = get_storage_hash_str(key, None, page_size=page)
    assert len(keys) == 2  # SGLang names the partial page too
    index = backend.core.index
    whole = TokenKeyScheme("sha256", page // 2).unit_keys(TOKENS, page)
    assert index.canonical(keys[0]) == whole[0]
    assert index.canonical(keys[1]) is None
    slots = pool.alloc(2 * page)
    fill_pages(MODEL, pool, 1, 0, slots)
    assert backend.batch_set_v1(keys, slots) == [True, False]
    assert len(unit_files(store_dir)) == 1


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("over", "extra_over", "match"),
    [
        ({"attn_cp_size": 2, "attn_cp_rank": 0}, {}, "attn_cp_size"),
        ({"should_split_heads": True}, {}, "should_split_heads"),
        ({}, {"store": ""}, "extra_config.store"),
        ({}, {"typo_key": 1}, "unknown keys"),
        ({"pp_size": 2}, {}, "num_layers"),
        ({}, {"total_kv_heads": 6}, "total_kv_heads"),
        ({}, {"store_options": []}, "store_options"),
        ({}, {"staging_dir": 5}, "extra_config.staging_dir"),
        ({}, {"staging_stale_s": 0}, "extra_config.staging_stale_s"),
    ],
)
def test_refused_configurations(extra, over, extra_over, match):
    pool = make_pool(MODEL, 2, 0, "page_first")
    with pytest.raises((BackendSetupError, ValueError), match=match):
        make_backend(pool, 2, 0, {**extra, **extra_over}, model_name=MODEL.name, **over)


def test_refused_pool_with_kv_scales(extra):
    """MXFP8 host pools keep per-block scales beside the payload: units without them would be
    wrong bytes for every reader, so the pool is refused."""
    pool = make_pool(MODEL, 1, 0, "page_first")
    pool.k_scale_host = torch.zeros(1)  # what SGLang's MHATokenToKVPoolMXFP8Host adds
    with pytest.raises(BackendSetupError, match=r"mem_pool_host: .*KV scales"):
        make_backend(pool, 1, 0, extra, model_name=MODEL.name)


def test_refused_page_unified_layout(extra):
    pool = make_pool(MODEL, 1, 0, "page_first")
    pool.layout = "page_unified"  # SGLang's fused head-group layout: not a split NHD page
    with pytest.raises(ValueError, match="layout: expected one of"):
        make_backend(pool, 1, 0, extra, model_name=MODEL.name)


def test_staging_directory_sweeps_stale_fragments(extra):
    writers = group(MODEL, 2, "page_first", extra)
    keys = sglang_keys()
    write(MODEL, writers[:1], 2, keys)
    staged = fragments(extra)
    assert len(staged) == 3
    old = staged[0].stat().st_mtime - 3600
    os.utime(staged[0], (old, old))
    assert writers[0][1].core.staging.sweep() == 1
    assert fragments(extra) == staged[1:]


# ------------------------------------------------------------------ MLA


@pytest.mark.parametrize(
    ("writer_layout", "reader_layout"),
    [("page_first", "layer_first"), ("page_first_direct", "page_first")],
)
def test_mla_tp4_to_tp2(extra, store_dir, writer_layout, reader_layout):
    """The latent is replicated: rank 0 stores it whole (as SGLang elects it), no staging."""
    model = Model(name="test/tiny-mla", head_dim=24)
    writers = []
    for rank in range(4):
        pool = make_mla_pool(model, writer_layout)
        writers.append(
            (pool, make_backend(pool, 4, rank, extra, model_name=model.name, is_mla_model=True))
        )
    keys = sglang_keys(model)
    assert [b.core.writers for _, b in writers] == [[0]] * 4
    assert all(b.core.staging is None for _, b in writers)
    pool, backend = writers[0]
    slots = pool.alloc(len(TOKENS))
    fill_mla(model, pool, slots)
    assert backend.batch_set_v1(keys, slots) == [True] * 3
    assert len(unit_files(store_dir)) == 3
    for rank in range(2):
        pool = make_mla_pool(model, reader_layout)
        backend = make_backend(pool, 2, rank, extra, model_name=model.name, is_mla_model=True)
        sglang_keys(model)
        slots = pool.alloc(len(TOKENS))
        assert backend.batch_get_v1(keys, slots) == [True] * 3
        check_mla(model, pool, slots)


def test_package_imports_without_sglang_or_the_extension():
    """`import canonical_ops.sglang` needs neither SGLang nor the compiled extension."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import canonical_ops.sglang as s\n"
        "assert not any(m.startswith(('sglang.', 'canonical_ops._C')) for m in sys.modules)\n"
        "try:\n"
        "    s.CanonicalHiCacheStorage\n"
        "except ImportError:\n"
        "    print('lazy')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "lazy"
