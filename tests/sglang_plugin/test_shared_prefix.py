"""One prefix, every engine (issue 31), SGLang 0.5.23's side.

SGLang's backend, hashing ``sp.PROMPT`` with SGLang's own ``get_storage_hash_str``, must name
each page by exactly the store key vLLM 0.33 derives for it and use exactly the namespace
vLLM's tiers share (both pinned in tests/helpers/shared_prefix.py and asserted against vLLM in
tests/vllm_plugin/test_shared_prefix.py: this venv has no vLLM). The bytes: the standalone
engine (tests/helpers/shared_prefix.py, the same ops and stores) writes at TP=1 what SGLang
reads at TP=2 bit-exact, and the reverse.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from helpers import shared_prefix as sp
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang_harness import Model, check_pages, group, pool_rows, unit_files, write

from canonical_ops.sglang import BackendSetupError
from canonical_ops.units.token_keys import TokenKeyScheme, store_key

MODEL = Model(
    name=sp.MODEL_NAME,
    layers=sp.LAYERS,
    total_heads=sp.HEADS,
    head_dim=sp.HEAD_SIZE,
    page_size=sp.BLOCK,
    dtype=sp.DTYPE,
)
VLLM_KEYS = [store_key(bytes.fromhex(h) + bytes(4)) for h in sp.BLOCK_HASHES_HEX]


@pytest.fixture(autouse=True)
def _default_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # vLLM's default: "vllm-none-hash"


def truth() -> list[torch.Tensor]:
    """``sp``'s truth layout, (units, 2, tokens, heads, head_size), of the SGLang model's KV."""
    out = []
    for layer in range(MODEL.layers):
        kv = MODEL.truth(layer, len(sp.PROMPT))  # (2, tokens, heads, dim)
        shape = (2, sp.UNITS, sp.BLOCK, sp.HEADS, sp.HEAD_SIZE)
        out.append(kv.reshape(shape).transpose(0, 1).contiguous())
    return out


def sglang_keys() -> list[str]:
    return get_storage_hash_str(sp.PROMPT, None, page_size=MODEL.page_size)


def test_sglang_names_pages_and_namespace_as_vllm_does(extra):
    ranks = group(MODEL, 2, "page_first", extra)
    keys = sglang_keys()
    for _, backend in ranks:
        assert backend.core.namespace.hex == sp.NAMESPACE_HEX
        assert [backend.core.index.canonical(k) for k in keys] == VLLM_KEYS


def test_the_standalone_engine_stores_sglang_tp2_loads(extra):
    sp.engine_store(extra["store"], truth(), tp=1, units=3)  # a partial prefix
    ranks = group(MODEL, 2, "layer_first", extra)
    keys = sglang_keys()
    for rank, (pool, backend) in enumerate(ranks):
        assert backend.batch_exists(keys) == 3
        slots = pool.alloc(len(sp.PROMPT))
        assert backend.batch_get_v1(keys, slots) == [True, True, True, False]
        heads = MODEL.global_heads(2, rank)
        for layer, rows in enumerate(pool_rows(pool, slots[: 3 * sp.BLOCK])):
            want = MODEL.truth(layer, len(sp.PROMPT))[:, : 3 * sp.BLOCK, heads]
            assert torch.equal(rows.view(torch.int16), want.view(torch.int16)), (rank, layer)


def test_sglang_tp2_stores_the_standalone_engine_loads(extra):
    ranks = group(MODEL, 2, "page_head", extra)
    assert write(MODEL, ranks, 2, sglang_keys(), tokens=sp.PROMPT) == [[True] * sp.UNITS] * 2
    for tp in (1, 2):
        found, caches = sp.engine_load(extra["store"], tp)
        assert found == sp.UNITS
        sp.check_engine_caches(found, caches, truth(), tp)
    # Another model or dtype: another namespace, a miss.
    other = Model(name="test/other", layers=sp.LAYERS, total_heads=sp.HEADS,
                  head_dim=sp.HEAD_SIZE, page_size=sp.BLOCK)  # fmt: skip
    ((_, reader),) = group(other, 1, "page_first", extra)
    assert reader.batch_exists(sglang_keys()) == 0
    half = Model(name=sp.MODEL_NAME, layers=sp.LAYERS, total_heads=sp.HEADS,
                 head_dim=sp.HEAD_SIZE, page_size=sp.BLOCK, dtype=torch.float16)  # fmt: skip
    ((_, reader),) = group(half, 1, "page_first", extra)
    assert reader.batch_exists(sglang_keys()) == 0


def test_a_corrupt_unit_is_a_miss_for_sglang_and_the_engine(extra, store_dir):
    sp.engine_store(extra["store"], truth(), tp=1)
    digest = hashlib.sha256(VLLM_KEYS[1]).hexdigest()[:32]
    (path,) = [p for p in unit_files(store_dir) if p.parent.name == digest]
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))
    ((pool, backend),) = group(MODEL, 1, "page_first", extra)
    slots = pool.alloc(len(sp.PROMPT))
    assert backend.batch_get_v1(sglang_keys(), slots) == [True, False, False, False]
    assert sp.engine_load(extra["store"], 1)[0] == 1


def test_authenticated_sharing_needs_the_same_secret(extra, monkeypatch):
    from canonical_ops.units import StoreSecret

    secret = "fleet-secret-" + "s" * 20
    monkeypatch.setenv("CANONICAL_KV_STORE_SECRET", secret)
    sp.engine_store(extra["store"], truth(), tp=1, secret=StoreSecret(secret))
    ((pool, backend),) = group(MODEL, 1, "page_first", {**extra, "authenticated": True})
    keys = sglang_keys()
    assert backend.batch_exists(keys) == sp.UNITS
    slots = pool.alloc(len(sp.PROMPT))
    assert backend.batch_get_v1(keys, slots) == [True] * sp.UNITS
    check_pages(MODEL, pool, 1, 0, slots)
    ((_, plain),) = group(MODEL, 1, "page_first", extra)
    assert plain.batch_exists(keys) == 0  # without the secret: another namespace
    monkeypatch.delenv("CANONICAL_KV_STORE_SECRET")
    with pytest.raises(BackendSetupError, match="authenticated: expected CANONICAL_KV_STORE"):
        group(MODEL, 1, "page_first", {**extra, "authenticated": True})


def test_pages_that_are_not_whole_hash_blocks_are_refused(extra):
    with pytest.raises(BackendSetupError, match="multiple of the key scheme's hash_block_tokens"):
        group(MODEL, 1, "page_first", {**extra, "hash_block_tokens": 12})
    with pytest.raises(BackendSetupError, match="algorithm"):
        group(MODEL, 1, "page_first", {**extra, "hash_algorithm": "xxhash"})
    # Hash blocks of 8 tokens (vLLM's block size 8) under pages of 16: keys of the page's
    # last hash block, as vLLM keys an offloaded block of 2 GPU blocks.
    ((_, backend),) = group(MODEL, 1, "page_first", {**extra, "hash_block_tokens": 8})
    keys = [backend.core.index.canonical(k) for k in sglang_keys()]
    assert keys == TokenKeyScheme("sha256", 8).unit_keys(sp.PROMPT, sp.BLOCK)


# --------------------------------------------------------------------------- granularity


def test_pages_read_across_bigger_units_split(extra, caplog):
    """Units of 32 tokens (another engine's, e.g. vLLM's 2-block offload chunks) under
    SGLang pages of 16: each page is its half of a verified unit."""
    sp.engine_store(extra["store"], truth(), tp=1, units=2, tokens=32)
    ((pool, alone),) = group(MODEL, 1, "page_first", extra)
    assert alone.batch_exists(sglang_keys()) == 0  # without read_unit_tokens: a miss
    with caplog.at_level("WARNING"):
        ranks = group(MODEL, 2, "page_head", {**extra, "read_unit_tokens": [32, 24]})
    assert len([m for m in caplog.messages if "not reading units of 24 tokens" in m]) == 2
    keys = sglang_keys()
    for rank, (pool, backend) in enumerate(ranks):
        assert backend.batch_exists(keys) == sp.UNITS
        slots = pool.alloc(len(sp.PROMPT))
        assert backend.batch_get_v1(keys, slots) == [True] * sp.UNITS
        check_pages(MODEL, pool, 2, rank, slots)
    # A later page alone: its unit's last page is not in the call, so nothing to name it by.
    ((pool, backend),) = group(MODEL, 1, "page_first", {**extra, "read_unit_tokens": [32]})
    slots = pool.alloc(sp.BLOCK)
    assert backend.batch_get_v1(keys[2:3], slots) == [False]


def test_pages_read_across_smaller_units_joined(extra):
    """Units of 16 tokens (vLLM's offloaded blocks) under SGLang pages of 32, hash blocks of
    16 as vLLM's: a page is two verified units joined."""
    sp.engine_store(extra["store"], truth(), tp=2, units=3)  # the 4th unit missing
    model32 = Model(name=sp.MODEL_NAME, layers=sp.LAYERS, total_heads=sp.HEADS,
                    head_dim=sp.HEAD_SIZE, page_size=32, dtype=sp.DTYPE)  # fmt: skip
    options = {**extra, "hash_block_tokens": sp.BLOCK, "read_unit_tokens": [sp.BLOCK]}
    ranks = group(model32, 2, "layer_first", options)
    keys = get_storage_hash_str(sp.PROMPT, None, page_size=32)
    for rank, (pool, backend) in enumerate(ranks):
        assert backend.batch_exists(keys) == 1  # page 1 lacks its second unit
        slots = pool.alloc(len(sp.PROMPT))
        assert backend.batch_get_v1(keys, slots) == [True, False]
        heads = model32.global_heads(2, rank)
        for layer, rows in enumerate(pool_rows(pool, slots[:32])):
            want = MODEL.truth(layer, len(sp.PROMPT))[:, :32, heads]
            assert torch.equal(rows.view(torch.int16), want.view(torch.int16)), (rank, layer)


def test_a_corrupt_unit_read_across_is_a_miss(extra, store_dir):
    sp.engine_store(extra["store"], truth(), tp=1, units=2, tokens=32)
    key = TokenKeyScheme("sha256", sp.BLOCK).unit_keys(sp.PROMPT, 32)[1]
    (path,) = [
        p for p in unit_files(store_dir) if p.parent.name == hashlib.sha256(key).hexdigest()[:32]
    ]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    ((pool, backend),) = group(MODEL, 1, "page_first", {**extra, "read_unit_tokens": [32]})
    slots = pool.alloc(len(sp.PROMPT))
    before = pool_rows(pool, slots[2 * sp.BLOCK :])
    assert backend.batch_get_v1(sglang_keys(), slots) == [True, True, False, False]
    after = pool_rows(pool, slots[2 * sp.BLOCK :])
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing written
