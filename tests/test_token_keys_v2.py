"""Key scheme v2 (vLLM's block hash from token ids) and the shared "prefix" namespace, without
vLLM: the test vectors re-derived from the documented definition (hashlib, pickle, hand-written
CBOR bytes); tests/vllm_plugin/test_shared_prefix.py checks the same vectors against vLLM."""

from __future__ import annotations

import hashlib
import json
import pickle

import numpy as np
import pytest

from canonical_ops.units import ModelIdentity, StoreNamespace
from canonical_ops.units.token_keys import (
    DEFAULT_SEED,
    TEST_VECTORS_V2,
    TokenKeyScheme,
    cbor_encode,
    offload_key_of,
    store_key,
)
from layouts import LayerSpec, RankContext


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_sha256_vector_is_the_documented_definition(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    none = _sha(pickle.dumps(DEFAULT_SEED, protocol=5))
    h0 = _sha(pickle.dumps((none, (1, 2), None), protocol=5))
    h1 = _sha(pickle.dumps((h0, (3, 4), None), protocol=5))
    scheme = TokenKeyScheme("sha256", 2)
    assert scheme.seed == DEFAULT_SEED and scheme.none_hash == none
    assert scheme.block_hashes([1, 2, 3, 4, 5]) == [h0, h1]  # a partial block has no hash
    assert h1.hex() == TEST_VECTORS_V2[0][4]
    # A unit of 4 tokens is named by its last hash block's offload key, group 0, padded.
    assert scheme.unit_keys([1, 2, 3, 4], 4) == [store_key(h1 + b"\0\0\0\0")]
    assert scheme.unit_keys(np.array([1, 2, 3, 4], dtype=np.int32), 2) == [
        store_key(h + bytes(4)) for h in (h0, h1)
    ]


def test_sha256_cbor_vector_is_the_documented_definition():
    seed = b"\x6e" + DEFAULT_SEED.encode()  # text string of 14 bytes
    none = _sha(seed)
    # [bytes(32), [1, 2], null]: array(3), bytes head 0x58 0x20, array(2), 1, 2, null
    h0 = _sha(b"\x83\x58\x20" + none + b"\x82\x01\x02\xf6")
    h1 = _sha(b"\x83\x58\x20" + h0 + b"\x82\x03\x04\xf6")
    scheme = TokenKeyScheme("sha256_cbor", 2, DEFAULT_SEED)
    assert scheme.none_hash == none and scheme.block_hashes([1, 2, 3, 4]) == [h0, h1]
    assert h1.hex() == TEST_VECTORS_V2[1][4]


def test_cbor_heads_are_minimal():
    cases = {
        0: b"\x00", 23: b"\x17", 24: b"\x18\x18", 255: b"\x18\xff", 256: b"\x19\x01\x00",
        65536: b"\x1a\x00\x01\x00\x00", 2**32: b"\x1b\x00\x00\x00\x01\x00\x00\x00\x00",
        -1: b"\x20", -25: b"\x38\x18", None: b"\xf6", "": b"\x60", b"": b"\x40", (): b"\x80",
    }  # fmt: skip
    for value, expected in cases.items():
        assert cbor_encode(value) == expected, value
    with pytest.raises(ValueError, match="2\\*\\*64"):
        cbor_encode(2**64)
    with pytest.raises(TypeError, match="bool"):
        cbor_encode(True)


def test_cbor_hashes_of_many_tokens_are_the_one_by_one_encoding():
    # block_hashes encodes every token at once for sha256_cbor: the bytes must be cbor_encode's.
    rng = np.random.default_rng(3)
    edges = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]
    tokens = edges + rng.integers(0, 2**63 - 1, 54, dtype=np.int64).tolist()
    scheme = TokenKeyScheme("sha256_cbor", 8, DEFAULT_SEED)
    parent, expected = scheme.none_hash, []
    for at in range(0, 64, 8):
        parent = _sha(cbor_encode((parent, tuple(tokens[at : at + 8]), None)))
        expected.append(parent)
    assert scheme.block_hashes(tokens) == expected
    negative = (-5, *tokens[1:8])  # not a token id vLLM makes: the one-by-one path
    assert scheme.block_hashes(negative) == [_sha(cbor_encode((scheme.none_hash, negative, None)))]
    assert scheme.block_hashes(tokens[8:], parent=expected[0]) == expected[1:]


@pytest.mark.parametrize("vector", TEST_VECTORS_V2, ids=lambda v: f"{v[0]}-{v[1]}")
def test_every_pinned_vector(vector):
    algorithm, block, seed, tokens, expected = vector
    assert TokenKeyScheme(algorithm, block, seed).block_hashes(tokens)[-1].hex() == expected


def test_seed_follows_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    seeded = TokenKeyScheme()
    assert seeded.seed == "1234"
    monkeypatch.delenv("PYTHONHASHSEED")
    assert TokenKeyScheme().seed == DEFAULT_SEED
    assert seeded.block_hashes(range(16)) != TokenKeyScheme().block_hashes(list(range(16)))


def test_chain_continues_from_a_parent_and_keys_name_prefixes():
    scheme = TokenKeyScheme("sha256", 4)
    tokens = list(range(100, 124))
    hashes = scheme.block_hashes(tokens)
    assert scheme.block_hashes(tokens[8:], parent=hashes[1]) == hashes[2:]
    keys = scheme.unit_keys(tokens, 8)
    assert keys == [scheme.unit_key(hashes[i]) for i in (1, 3, 5)]
    assert (
        scheme.unit_keys(tokens[:16] + [0] * 8, 8)[:2]
        == keys[:2]
        != scheme.unit_keys([0, *tokens[1:]], 8)[:2]
    )
    assert offload_key_of(keys[0]) == hashes[1] + bytes(4) and len(keys[0]) == 96
    long = bytes(range(100))
    assert offload_key_of(store_key(long)) == long


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="algorithm: expected one of"):
        TokenKeyScheme("xxhash", 16)  # random per-process seed: never shared
    with pytest.raises(ValueError, match="hash_block_tokens"):
        TokenKeyScheme("sha256", 0)
    with pytest.raises(TypeError, match="seed"):
        TokenKeyScheme("sha256", 16, 5)
    with pytest.raises(ValueError, match="unit_tokens: expected a multiple"):
        TokenKeyScheme("sha256", 16).unit_keys(range(64), 24)
    with pytest.raises(TypeError, match="token_ids"):
        TokenKeyScheme().block_hashes("abc")
    with pytest.raises(TypeError, match="token_ids\\[1\\]"):
        TokenKeyScheme().block_hashes([1, 2.0])


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        ([True, 2], TypeError, r"token_ids\[0\]"),
        ([1, 2**63], ValueError, r"token_ids\[1\]: expected an int64"),
        (np.zeros(4, dtype=np.float32), TypeError, "integer array"),
        (np.array([1, 2**63], dtype=np.uint64), ValueError, "below 2\\*\\*63"),
    ],
)
def test_bad_token_ids_are_refused(tokens, error, match):
    with pytest.raises(error, match=match):
        TokenKeyScheme("sha256", 2).block_hashes(tokens)


def _namespace(tokens: int, heads: int = 8, model: str = "m", dtype: str = "bfloat16"):
    spec = LayerSpec("full", tokens, heads, 64, dtype, "split", "NHD")
    return StoreNamespace.from_specs(ModelIdentity(model), [spec] * 3, RankContext(1, heads, 0))


def test_shared_prefix_namespace_is_one_for_every_topology():
    scheme = TokenKeyScheme("sha256", 16)
    shared = _namespace(32).shared_prefix(scheme)
    assert shared.key_scheme == "vllm-block-hash.v1/sha256/16" == scheme.describe()
    assert shared.describe()["key_scheme"] == scheme.describe()
    assert "key_scheme" not in _namespace(32).describe()  # others keep their digests
    assert shared.hex != _namespace(32).hex and shared.unit_tokens == 32
    # The same model at TP=2 (4 heads a rank) names the same namespace.
    spec = LayerSpec("full", 32, 4, 64, "bfloat16", "split", "NHD")
    at_tp2 = StoreNamespace.from_specs(ModelIdentity("m"), [spec] * 3, RankContext(2, 8, 1))
    assert at_tp2.shared_prefix(scheme).hex == shared.hex
    restored = StoreNamespace.from_description(json.loads(json.dumps(shared.describe())))
    assert restored == shared and restored.hex == shared.hex
    # Another model, dtype, unit size or algorithm: another namespace.
    others = {
        _namespace(32, model="other").shared_prefix(scheme).hex,
        _namespace(32, dtype="float16").shared_prefix(scheme).hex,
        _namespace(16).shared_prefix(scheme).hex,
        _namespace(32).shared_prefix(TokenKeyScheme("sha256_cbor", 16)).hex,
        _namespace(32).shared_prefix(TokenKeyScheme("sha256", 32)).hex,
    }
    assert shared.hex not in others and len(others) == 5


def test_shared_prefix_refuses_what_cannot_be_shared():
    scheme = TokenKeyScheme("sha256", 16)
    with pytest.raises(ValueError, match="multiple of the key scheme's hash_block_tokens 16"):
        _namespace(24).shared_prefix(scheme)
    opaque = StoreNamespace.from_specs(
        ModelIdentity("m"),
        [None],
        RankContext(1, 1, 0),
        fallback_page_sizes=[64],
        fallback_layouts=["uint8 block [64] strides [64, 1]"],
        block_size=16,
    )
    with pytest.raises(ValueError, match="opaque"):
        opaque.shared_prefix(scheme)
    with pytest.raises(TypeError, match="TokenKeyScheme"):
        _namespace(32).shared_prefix("vllm-block-hash.v1/sha256/16")
    desc = _namespace(32).describe()
    with pytest.raises(ValueError, match="key_scheme"):
        StoreNamespace.from_description({**desc, "key_scheme": ""})
