"""The standalone engine reads units of other token counts (issue 31 item 2).

Another engine (vLLM with offloaded blocks of 2 GPU blocks, SGLang with pages of half the
size...) stored a prompt in units of ``S`` tokens in the namespace every engine shares; a
StageCache of 16-token units configured to read ``S`` across (``across={S: stores}``) and
given the prompt's keys in those units (``across_keys``) fills its region bit-exact: a unit
of 32 tokens is split, two of 8 are joined. The truth is each layer's KV per token, laid out
here from first principles for each canonical layout (not by ``layouts.tokens``); the other
engine's namespace is built the way that engine builds it (``from_specs`` at its size, then
``shared_prefix``). Real FileStores and a real redis-server.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest
from helpers.redis_server import RedisBinaryMissing, RedisServer, redis_binaries
from helpers.store import unit_files

from canonical_ops.engine import PageManager
from canonical_ops.engine.cache import StageCache, TierLookup
from canonical_ops.units import FileStore, ModelIdentity, StoreNamespace
from canonical_ops.units.across import UnitsAcross, keys_by_size
from canonical_ops.units.files import key_digest
from canonical_ops.units.token_keys import TokenKeyScheme
from layouts import LayerSpec, RankContext

LAYERS, HEADS, HEAD_SIZE, ELEMENT = 3, 4, 8, 2  # bfloat16
UNIT, BLOCKS = 16, 8  # the engine's unit: 16 tokens; the prompt: 8 of them
SCHEME = TokenKeyScheme("sha256", 8, "0")  # vLLM's block size 8
PROMPT = np.random.default_rng([31, 2]).integers(0, 128256, UNIT * BLOCKS).tolist()
MODEL = "test/across-llama"
LAYOUTS = {"split-NHD": ("split", "NHD"), "packed-HND": ("packed", "HND")}


def namespace(tokens: int, layout=("split", "NHD"), model: str = MODEL, dtype="bfloat16"):
    """The shared namespace an engine of ``tokens`` tokens per unit builds (at TP=2)."""
    spec = LayerSpec("full", tokens, HEADS // 2, HEAD_SIZE, dtype, *layout)
    own = StoreNamespace.from_specs(ModelIdentity(model), [spec] * LAYERS, RankContext(2, HEADS, 0))
    return own.shared_prefix(SCHEME)


# Each layer's K and V per token: (layers, 2, tokens, heads, head bytes).
KV = np.random.default_rng([31, 3]).integers(
    0, 256, (LAYERS, 2, len(PROMPT), HEADS, HEAD_SIZE * ELEMENT), dtype=np.uint8
)


def unit_bytes(start: int, tokens: int, layout=("split", "NHD")) -> np.ndarray:
    """The canonical unit of tokens ``[start, start + tokens)``: each layer's page in order."""
    packing, order = layout
    pages = []
    for layer in range(LAYERS):
        kv = KV[layer, :, start : start + tokens]  # (2, tokens, heads, bytes)
        if (packing, order) == ("split", "NHD"):
            page = kv  # K page then V page, each (tokens, heads, bytes)
        elif (packing, order) == ("packed", "HND"):
            page = kv.transpose(2, 1, 0, 3)  # (heads, tokens, K|V, bytes)
        else:
            raise AssertionError(layout)
        pages.append(np.ascontiguousarray(page).reshape(-1))
    return np.concatenate(pages)


def store_units(store, tokens: int, count: int, layout=("split", "NHD")) -> list[bytes]:
    """The other engine stores the prompt's first ``count`` units of ``tokens``; their keys."""
    keys = SCHEME.unit_keys(PROMPT, tokens)
    for i in range(count):
        payload = unit_bytes(i * tokens, tokens, layout)
        assert store.store(keys[i], 0, payload, i).status == "ok"
    return keys


def across_keys(*sizes: int) -> dict[int, list[bytes]]:
    return keys_by_size(SCHEME, PROMPT, sizes)


KEYS = SCHEME.unit_keys(PROMPT, UNIT)


class Reader:
    """A StageCache of 16-token units with an empty region over ``tiers``, reading ``across``."""

    def __init__(self, tiers, across, pages: int = BLOCKS, layout=("split", "NHD"), **kw):
        self.ns = namespace(UNIT, layout)
        self.manager = PageManager(pages)
        self.rows = np.zeros((pages, self.ns.total_bytes), np.uint8)
        self.cache = StageCache(
            self.manager, self.rows, (0, LAYERS), self.ns, tiers, across=across, **kw
        )

    def fill(self, across=None, hashes=KEYS):
        """Look up, fetch and drain; the lookup and the events."""
        found = self.cache.lookup(hashes, timeout=30, across_keys=across)
        self.cache.fetch(hashes, found, across_keys=across)
        return found, self.cache.drain(30)

    def row(self, block: int) -> np.ndarray:
        return self.rows[self.manager.page_of(KEYS[block])]


def new_server(directory) -> RedisServer:
    try:
        redis_binaries()
    except RedisBinaryMissing as error:  # never a skip: `make test` installs it
        pytest.fail(str(error))
    return RedisServer(str(directory)).start()


@pytest.fixture(params=["files", "redis"])
def open_store(request, tmp_path):
    """``open_store(namespace)``: a store of the kind the test is parametrised with."""
    opened, server = [], None
    if request.param == "redis":
        server = new_server(tmp_path / "redis")
        from canonical_ops.units import RedisStore

    def make(ns: StoreNamespace):
        if server is None:
            store = FileStore(tmp_path / "store", ns, fsync=False)
        else:
            store = RedisStore(server.url, ns)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
    if server is not None:
        server.stop()


# --------------------------------------------------------------------------- bit-exact


@pytest.mark.parametrize("tokens", [32, 8], ids=["split-2x", "joined-half"])
def test_a_prefix_stored_in_units_of_twice_and_half_the_size_loads_bit_exact(open_store, tokens):
    store_units(open_store(namespace(tokens)), tokens, UNIT * BLOCKS // tokens)
    own = open_store(namespace(UNIT))
    alone = Reader([own], None)
    assert alone.cache.lookup(KEYS, timeout=30) == TierLookup(0, 0, ())  # a miss without it
    reader = Reader([own], {tokens: [open_store(namespace(tokens))]})
    keys = across_keys(tokens)
    found, events = reader.fill(keys)
    assert found == TierLookup(0, BLOCKS, (1,) * BLOCKS)  # the store read across
    assert [(e.block_hash, e.status, e.tier) for e in events] == [
        (k, "ok", f"across{tokens}:0:{type(own).__name__}") for k in KEYS
    ]
    for block in range(BLOCKS):
        assert np.array_equal(reader.row(block), unit_bytes(block * UNIT, UNIT)), block
    counters = reader.cache.metrics().tiers[1]
    assert (counters.fills_ok, counters.bytes_filled) == (BLOCKS, BLOCKS * reader.ns.total_bytes)
    # Write-through stores them at the engine's own size: a cache without across reads them.
    assert reader.cache.persist(KEYS).submitted == BLOCKS
    assert {e.status for e in reader.cache.drain(30)} == {"ok"}
    fresh = Reader([own], None)
    fresh.fill()
    assert all(np.array_equal(fresh.row(b), reader.row(b)) for b in range(BLOCKS))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("tokens", [32, 8], ids=["split-2x", "joined-half"])
def test_every_layout_is_regrouped_token_by_token(tmp_path, layout, tokens):
    with FileStore(tmp_path, namespace(tokens, layout), fsync=False) as theirs:
        store_units(theirs, tokens, UNIT * BLOCKS // tokens, layout)
        reader = Reader([], {tokens: [theirs]}, layout=layout)
        found, events = reader.fill(across_keys(tokens))
    assert found.from_tiers == BLOCKS and {e.status for e in events} == {"ok"}
    for block in range(BLOCKS):
        assert np.array_equal(reader.row(block), unit_bytes(block * UNIT, UNIT, layout)), block


def test_nearest_first_own_units_then_across_then_own_again(tmp_path):
    """Blocks 0-1 in the engine's own files, 2-5 only in another engine's 32-token units,
    6-7 own again: one lookup finds all 8, each from where it is."""
    with (
        FileStore(tmp_path, namespace(UNIT), fsync=False) as own,
        FileStore(tmp_path, namespace(32), fsync=False) as theirs,
    ):
        store_units(theirs, 32, 3)  # tokens [0, 96): blocks 0-5
        for block in (0, 1, 6, 7):
            own.store(KEYS[block], 0, unit_bytes(block * UNIT, UNIT), block)
        reader = Reader([own], {32: [theirs]})
        found, events = reader.fill(across_keys(32))
        assert found.sources == (0, 0, 1, 1, 1, 1, 0, 0)
        assert [e.status for e in events] == ["ok"] * BLOCKS
        for block in range(BLOCKS):
            assert np.array_equal(reader.row(block), unit_bytes(block * UNIT, UNIT)), block
        # Promoting: the blocks read across go to the engine's own files, the others not.
        promoted = reader.cache.promote(KEYS)
        assert (promoted.submitted, promoted.skipped) == (4, 4)
        assert {e.block_hash for e in reader.cache.drain(30)} == set(KEYS[2:6])
        assert own.lookup(KEYS, 0, LAYERS) == BLOCKS


# --------------------------------------------------------------------------- partial


def test_partial_prefixes(tmp_path):
    with (
        FileStore(tmp_path, namespace(32), fsync=False) as big,
        FileStore(tmp_path, namespace(8), fsync=False) as small,
    ):
        store_units(big, 32, 3)  # blocks 0-5
        reader = Reader([], {32: [big]})
        found, _ = reader.fill(across_keys(32))
        assert found.total == 6 and reader.manager.lookup(KEYS) == 6
        store_units(small, 8, 5)  # blocks 0-1 whole, block 2 half: not a unit
        reader = Reader([], {8: [small]})
        found, _ = reader.fill(across_keys(8))
        assert found.total == 2 and reader.manager.lookup(KEYS) == 2
        # A block in the middle of a source unit: block 0 in the region, 1.. read across.
        reader = Reader([], {32: [big]})
        reader.fill(across_keys(32), hashes=KEYS[:1])
        found, events = reader.fill(across_keys(32))
        assert (found.in_region, found.from_tiers) == (1, 5)
        assert [e.block_hash for e in events] == KEYS[1:6]
        for block in range(6):
            assert np.array_equal(reader.row(block), unit_bytes(block * UNIT, UNIT)), block
        # Keys given for fewer tokens than the hashes: only the blocks they name.
        reader = Reader([], {32: [big]})
        found, _ = reader.fill({32: across_keys(32)[32][:1]})
        assert found.total == 2


# --------------------------------------------------------------------------- misses


@pytest.mark.parametrize(("tokens", "bad", "missed"), [(32, 1, [2, 3]), (8, 3, [1])])
def test_a_corrupt_source_unit_is_a_miss_for_exactly_its_blocks(tmp_path, tokens, bad, missed):
    with FileStore(tmp_path, namespace(tokens), fsync=False) as theirs:
        keys = store_units(theirs, tokens, UNIT * BLOCKS // tokens)
        (path,) = [p for p in unit_files(theirs) if key_digest(keys[bad]) in p]
        with open(path, "r+b") as f:  # one payload bit flipped: same size, bad checksum
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        reader = Reader([], {tokens: [theirs]})
        found, events = reader.fill(across_keys(tokens))
        assert theirs.metrics().corrupt_detected == 1
    assert found.total == BLOCKS  # a lookup does not read the bytes
    status = {KEYS.index(e.block_hash): e.status for e in events}
    assert [b for b, s in status.items() if s != "ok"] == missed
    assert {status[b] for b in missed} == {"miss"}  # a corrupt unit is a miss
    for block in range(BLOCKS):
        if block in missed:
            assert reader.manager.page_of(KEYS[block]) is None
        else:
            assert np.array_equal(reader.row(block), unit_bytes(block * UNIT, UNIT)), block
    # No partial bytes: the rows of the missed blocks' pages were never written.
    written = {reader.manager.page_of(KEYS[b]) for b in range(BLOCKS) if b not in missed}
    assert all(not reader.rows[p].any() for p in range(BLOCKS) if p not in written)
    assert reader.cache.metrics().tiers[0].fills_missed == len(missed)


def test_a_source_unit_gone_after_the_lookup_is_a_miss_for_its_blocks_only(tmp_path):
    with FileStore(tmp_path, namespace(8), fsync=False) as theirs:
        keys = store_units(theirs, 8, 16)
        reader = Reader([], {8: [theirs]})
        found = reader.cache.lookup(KEYS, timeout=30, across_keys=across_keys(8))
        assert found.total == BLOCKS
        (path,) = [p for p in unit_files(theirs) if key_digest(keys[5]) in p]
        os.unlink(path)  # another process evicted it
        reader.cache.fetch(KEYS, found, across_keys=across_keys(8))
        events = reader.cache.drain(30)
    status = [e.status for e in sorted(events, key=lambda e: KEYS.index(e.block_hash))]
    assert status == ["ok", "ok", "miss", "ok", "ok", "ok", "ok", "ok"]  # block 2: units 4, 5


def test_another_model_or_dtype_is_a_miss(tmp_path):
    with (
        FileStore(tmp_path, namespace(32, model="test/other"), fsync=False) as other,
        FileStore(tmp_path, namespace(32, dtype="float16"), fsync=False) as half,
        FileStore(tmp_path, namespace(32), fsync=False) as theirs,
    ):
        store_units(other, 32, 4)
        store_units(half, 32, 4)
        reader = Reader([], {32: [theirs]})
        found, events = reader.fill(across_keys(32))
        assert found == TierLookup(0, 0, ()) and events == []
        with pytest.raises(ValueError, match=r"across\[32\]\[0\]: expected a store of namespace"):
            Reader([], {32: [other]})


# --------------------------------------------------------------------------- refused


def test_sizes_it_cannot_read_are_one_line_each_and_never_read(tmp_path, caplog):
    with (
        FileStore(tmp_path, namespace(32), fsync=False) as big,
        caplog.at_level(logging.WARNING),
    ):
        store_units(big, 32, 4)
        ns24 = namespace(24)
        with FileStore(tmp_path, ns24, fsync=False) as odd:
            reader = Reader([], {24: [odd], 32: [big], 4: []})
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [
            "canonical-kv: not reading units of 24 tokens: neither a multiple nor a divisor "
            "of the unit size 16",
            "canonical-kv: not reading units of 4 tokens: unit_tokens: expected a multiple of "
            "the key scheme's hash_block_tokens 8, got 4",
        ]
        assert reader.cache.names == ["across32:0:FileStore"]
        # Keys of a refused size are accepted and never read; an unknown size is an error.
        found, _ = reader.fill({**across_keys(32, 24), 4: []})
        assert found.total == BLOCKS
        with pytest.raises(ValueError, match=r"across_keys: expected keys of the sizes"):
            reader.cache.lookup(KEYS, across_keys=across_keys(64))
    with pytest.raises(ValueError, match="own unit size; pass its stores as tiers"):
        Reader([], {16: []})
    # A namespace every engine does not share (no key scheme): every size is refused.
    caplog.clear()
    manager, own = PageManager(2), namespace(UNIT)
    alone = StoreNamespace(own.format_id, own.model, own.kv_quant, own.layers)
    with caplog.at_level(logging.WARNING):
        StageCache(manager, np.zeros((2, alone.total_bytes), np.uint8), (0, LAYERS), alone,
                   across={32: []})  # fmt: skip
    assert [r.getMessage() for r in caplog.records] == [
        "canonical-kv: not reading units of 32 tokens: this engine's own units are not shared"
    ]


def test_a_namespace_only_described_with_the_scheme_is_never_read_across(tmp_path, caplog):
    """SGLang's own namespace where sharing fails (``replace(own, key_scheme=...)``): layers of
    different tokens per page, or a page not whole hash blocks. Its units are not another
    engine's: reading a 32-token engine's units into rows of 16-, 32- and 8-token layers
    (same row size here) would load bytes of other tokens and layers. Refused, never read."""
    ctx, sizes = RankContext(2, HEADS, 0), ((16, 8), (32, 8), (8, 16))  # (tokens, head size)
    specs = [LayerSpec("full", t, HEADS // 2, hs, "bfloat16", "split", "NHD") for t, hs in sizes]
    mixed = StoreNamespace.from_specs(ModelIdentity(MODEL), specs, ctx)
    with pytest.raises(ValueError, match="different tokens per page"):
        mixed.shared_prefix(SCHEME)
    mixed = dataclasses.replace(mixed, key_scheme=SCHEME.describe())
    specs32 = [dataclasses.replace(s, block_size=32) for s in specs]
    ns32 = StoreNamespace.from_specs(ModelIdentity(MODEL), specs32, ctx).shared_prefix(SCHEME)
    with FileStore(tmp_path, ns32, fsync=False) as theirs, caplog.at_level(logging.WARNING):
        keys = SCHEME.unit_keys(PROMPT, 32)
        for i in range(2):
            theirs.store(keys[i], 0, np.full(ns32.total_bytes, i + 1, np.uint8), i)
        manager, rows = PageManager(4), np.zeros((4, mixed.total_bytes), np.uint8)
        assert mixed.total_bytes == ns32.total_bytes // 2  # a split would fit the rows
        cache = StageCache(manager, rows, (0, LAYERS), mixed, [], across={32: [theirs]})
        found = cache.lookup(KEYS[:4], timeout=30, across_keys=across_keys(32))
        cache.fetch(KEYS[:4], found, across_keys=across_keys(32))
        assert found == TierLookup(0, 0, ()) and cache.drain(30) == []
    assert manager.lookup(KEYS[:4]) == 0 and not rows.any()
    assert [r.getMessage() for r in caplog.records] == [
        "canonical-kv: not reading units of 32 tokens: this engine's own units are not shared"
    ]
    # Pages of 4 tokens with hash blocks of 8: not shared either, whatever it could split.
    spec4 = LayerSpec("full", 4, HEADS // 2, HEAD_SIZE, "bfloat16", "split", "NHD")
    own4 = StoreNamespace.from_specs(ModelIdentity(MODEL), [spec4] * LAYERS, ctx)
    with pytest.raises(ValueError, match="not shared"):
        UnitsAcross.of(dataclasses.replace(own4, key_scheme=SCHEME.describe()), 16)


def test_units_across_arithmetic_and_namespace():
    big, small = UnitsAcross.of(namespace(UNIT), 32), UnitsAcross.of(namespace(UNIT), 8)
    assert big.namespace == namespace(32) and small.namespace == namespace(8)  # as built there
    assert (big.splits, big.ratio, small.splits, small.ratio) == (True, 2, False, 2)
    assert [big.sources(u) for u in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [small.sources(u) for u in range(2)] == [range(0, 2), range(2, 4)]
    assert big.covered(1, 2, 10) == 3 and big.covered(0, 0, 10) == 0 and big.covered(1, 3, 2) == 2
    assert small.covered(0, 5, 10) == 2 and small.covered(3, 1, 10) == 0
    with pytest.raises(ValueError, match="neither a multiple nor a divisor"):
        UnitsAcross.of(namespace(UNIT), 24)


def test_a_fetch_needs_the_keys_its_lookup_was_given(tmp_path):
    with FileStore(tmp_path, namespace(32), fsync=False) as theirs:
        store_units(theirs, 32, 4)
        reader = Reader([], {32: [theirs]})
        found = reader.cache.lookup(KEYS, timeout=30, across_keys=across_keys(32))
        assert found.total == BLOCKS
        for keys in (None, {32: across_keys(32)[32][:3]}):
            with pytest.raises(ValueError, match="across_keys: expected the keys of the 32-token"):
                reader.cache.fetch(KEYS, found, across_keys=keys)
        with pytest.raises(ValueError, match=r"found: sources\[0\] is 5, not a store"):
            reader.cache.fetch(KEYS, TierLookup(0, 1, (5,)))
        # A source for every block found, or the pages past the sources would stay pending.
        with pytest.raises(ValueError, match="found: expected a source for each of its 4"):
            reader.cache.fetch(KEYS, TierLookup(0, 4, (0, 0)), across_keys=across_keys(32))
        assert reader.manager.num_filling == 0  # nothing allocated by a refused fetch
        with pytest.raises(TypeError, match=r"across_keys\[32\]: expected a sequence"):
            reader.cache.lookup(KEYS, across_keys={32: KEYS[0]})


def test_keys_by_size_are_each_sizes_unit_keys():
    got = keys_by_size(SCHEME, PROMPT, [16, 32, 8, 16])
    assert got == {t: SCHEME.unit_keys(PROMPT, t) for t in (16, 32, 8)}
    with pytest.raises(ValueError, match="hash_block_tokens 8, got 12"):
        keys_by_size(SCHEME, PROMPT, [12])
