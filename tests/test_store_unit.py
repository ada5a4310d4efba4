"""The unit encoding: its exact layout, round trips, and every corruption refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
from helpers.store import row, small_namespace
from hypothesis import given, settings
from hypothesis import strategies as st

from canonical_ops.units import unit as enc
from canonical_ops.units.unit import (
    CorruptUnit,
    PayloadVerifier,
    begin_unit_check,
    decode_and_verify,
    decode_header,
    encode_header,
    encode_unit,
    header_length,
    normalize_key,
    verify_payload,
)

NS = small_namespace(8)
OTHER = small_namespace(8, name="other-model")


def unit(key=b"block-0", first=2, end=6, position=3, namespace=NS) -> bytes:
    return encode_unit(namespace, key, first, end, position, row(namespace, 1, first, end))


def test_layout_matches_the_documented_table() -> None:
    payload = row(NS, 1, 2, 6)
    raw = encode_unit(NS, b"abc", 2, 6, 3, payload)
    length = 96 + 8  # 3 key bytes padded to 8
    assert len(raw) == length + len(payload) == header_length(b"abc") + len(payload)
    assert raw[0:8] == b"CKVUNIT\x00"
    assert struct.unpack_from("<HHHH", raw, 8) == (1, length, 1, 3)
    assert struct.unpack_from("<IIII", raw, 16) == (0, 2, 6, 8)
    assert struct.unpack_from("<QQ", raw, 32) == (3, NS.layer_bytes(2, 6))
    assert raw[48:80] == NS.digest
    assert raw[96:99] == b"abc" and raw[99:104] == bytes(5)
    assert raw[length:] == payload.tobytes()
    # the checksum: XXH3-128 (seed 0) of the header with its 16 bytes zeroed, then the payload
    zeroed = raw[:80] + bytes(16) + raw[96:length]
    assert raw[80:96] == xxhash.xxh3_128(zeroed + payload.tobytes()).digest()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.binary(min_size=1, max_size=40),
            st.integers(0, 7),
            st.integers(1, 8),
            st.sampled_from([0, 1, 3, 2**32, enc.MAX_POSITION]),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_headers_packed_per_shape_equal_the_documented_layout(headers) -> None:
    """pack_header builds what a header shares with others of its shape once; every header,
    of any key length, range, position and algorithm, in any order, is still the table's."""
    from canonical_ops.units import StoreSecret

    authenticated = NS.authenticated(StoreSecret(b"a key of 32 bytes for this test."))
    for key, first, span, position, mac in headers:
        ns, end = (authenticated if mac else NS), min(8, first + span)
        length = 96 + (len(key) + 7) // 8 * 8
        expected = (
            b"CKVUNIT\x00"
            + struct.pack("<HHHH", 1, length, 2 if mac else 1, len(key))
            + struct.pack("<IIII", 0, first, end, 8)
            + struct.pack("<QQ", position, ns.layer_bytes(first, end))
            + ns.digest
            + bytes(16)
            + key.ljust(length - 96, b"\x00")
        )
        assert enc.pack_header(ns, key, first, end, position) == expected


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (b"\x00\xff", b"\x00\xff"),
        (bytearray(b"ab"), b"ab"),
        ("ab", b"ab"),
        ("é", "é".encode()),
        (0, bytes(8)),
        (-1, b"\xff" * 8),
        (np.int64(258), (258).to_bytes(8, "big")),
        (2**63 - 1, (2**63 - 1).to_bytes(8, "big")),
        (2**63, (2**63).to_bytes(16, "big")),  # needs a sign bit: 16 bytes
        (-(2**63), (-(2**63)).to_bytes(8, "big", signed=True)),
    ],
)
def test_key_normalisation(key, expected) -> None:
    assert normalize_key(key) == expected


@pytest.mark.parametrize(
    ("key", "error"),
    [(b"", ValueError), (b"x" * 1025, ValueError), (True, TypeError), (1.0, TypeError),
     (None, TypeError), ("\ud800", ValueError), (1 << 9000, ValueError)],
)  # fmt: skip
def test_bad_keys(key, error) -> None:
    with pytest.raises(error, match="key"):
        normalize_key(key)


@pytest.mark.parametrize("key", [b"k", "a str key", 12345, -7, b"x" * 1024])
def test_round_trip(key) -> None:
    payload = row(NS, 9, 0, 8)
    raw = encode_unit(NS, key, 0, 8, 17, payload)
    header, view = decode_and_verify(raw, namespace=NS, key=key, first=0, end=8)
    assert header.key == normalize_key(key) and header.position == 17
    assert (header.first_layer, header.end_layer, header.total_layers) == (0, 8, 8)
    assert view.readonly and view.tobytes() == payload.tobytes()
    assert len(raw) <= enc.MAX_HEADER_BYTES + len(payload)


def test_payload_is_hashed_in_place_from_any_buffer() -> None:
    payload = row(NS, 2, 1, 3)
    expected = encode_header(NS, b"k", 1, 3, 0, payload.tobytes())
    assert encode_header(NS, b"k", 1, 3, 0, payload) == expected
    assert encode_header(NS, b"k", 1, 3, 0, torch.from_numpy(payload)) == expected
    region = torch.from_numpy(np.stack([row(NS, 5, 1, 3), payload]))
    assert encode_header(NS, b"k", 1, 3, 0, region[1]) == expected  # a region row, no copy
    as_bf16 = torch.from_numpy(payload).view(torch.bfloat16)
    assert encode_header(NS, b"k", 1, 3, 0, as_bf16) == expected
    with pytest.raises(ValueError, match="contiguous"):
        encode_header(NS, b"k", 1, 3, 0, torch.from_numpy(np.stack([payload] * 2)).T[0])


def test_encode_arguments() -> None:
    payload = row(NS, 1, 2, 6)
    with pytest.raises(ValueError, match="payload: expected"):
        encode_header(NS, b"k", 2, 5, 0, payload)
    with pytest.raises(ValueError, match="position"):
        encode_header(NS, b"k", 2, 6, -1, payload)
    with pytest.raises(TypeError, match="position"):
        encode_header(NS, b"k", 2, 6, 1.0, payload)
    with pytest.raises(ValueError, match="end"):
        encode_header(NS, b"k", 2, 9, 0, payload)
    with pytest.raises(TypeError, match="namespace"):
        encode_header(NS.digest, b"k", 2, 6, 0, payload)
    with pytest.raises(TypeError, match="payload"):
        encode_header(NS, b"k", 2, 6, 0, [1, 2, 3])


def test_every_single_bit_flip_in_the_header_is_refused() -> None:
    raw = unit()
    length = header_length(b"block-0")
    for byte in range(length):
        for bit in range(8):
            damaged = bytearray(raw)
            damaged[byte] ^= 1 << bit
            with pytest.raises(CorruptUnit):
                decode_and_verify(damaged, namespace=NS)


def test_bit_flips_in_the_payload_are_refused() -> None:
    raw = unit()
    length = header_length(b"block-0")
    rng = np.random.default_rng(0)
    positions = [length, length + 1, len(raw) - 1, *rng.integers(length, len(raw), 300)]
    for pos in positions:
        damaged = bytearray(raw)
        damaged[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CorruptUnit, match="checksum"):
            decode_and_verify(damaged, namespace=NS)


def test_truncation_and_extension_are_refused() -> None:
    raw = unit()
    length = header_length(b"block-0")
    for size in (0, 1, 8, 95, 96, length - 1, length, length + 1, len(raw) - 1):
        with pytest.raises(CorruptUnit, match="truncated"):
            decode_and_verify(raw[:size], namespace=NS)
    for extra in (b"\x00", b"x" * 4096):
        with pytest.raises(CorruptUnit, match="extra bytes"):
            decode_and_verify(raw + extra, namespace=NS)


def test_other_namespace_key_or_range_is_refused() -> None:
    with pytest.raises(CorruptUnit, match="namespace"):
        decode_and_verify(unit(namespace=OTHER), namespace=NS)
    raw = unit()
    with pytest.raises(CorruptUnit, match="another key"):
        decode_and_verify(raw, namespace=NS, key=b"block-1")
    with pytest.raises(CorruptUnit, match="starts at layer 2"):
        decode_and_verify(raw, namespace=NS, first=0)
    with pytest.raises(CorruptUnit, match="ends at layer 6"):
        decode_and_verify(raw, namespace=NS, end=8)
    # same geometry, other model: a different digest, so refused as well
    twin = small_namespace(8, name="twin")
    assert twin.layer_bytes(0, 8) == NS.layer_bytes(0, 8)
    with pytest.raises(CorruptUnit, match="namespace"):
        decode_and_verify(unit(namespace=twin), namespace=NS)


def forge(raw: bytes, fmt: str, offset: int, value, *, rehash: bool = True) -> bytes:
    """``raw`` with one field rewritten and (by default) a valid checksum over the result."""
    out = bytearray(raw)
    struct.pack_into(fmt, out, offset, value)
    if rehash:
        length = struct.unpack_from("<H", out, 10)[0]
        length = min(length, len(out))
        out[80:96] = bytes(16)
        out[80:96] = xxhash.xxh3_128(bytes(out)).digest()
    return bytes(out)


@pytest.mark.parametrize(
    ("fmt", "offset", "value", "reason"),
    [
        ("<H", 8, 2, "unsupported format version"),
        ("<H", 10, 65535, "header length"),
        ("<H", 10, 96, "header length"),
        ("<H", 12, 2, "checksum algorithm"),
        ("<H", 14, 0, "key length"),
        ("<H", 14, 2000, "key length"),
        ("<I", 16, 1, "flags"),
        ("<I", 20, 6, "layer range"),  # first == end
        ("<I", 20, 1, "payload length"),  # [1, 6) is more bytes than the payload
        ("<I", 24, 9, "layer range"),  # end > total
        ("<I", 24, 5, "payload length"),
        ("<I", 28, 9, "total layers"),
        ("<Q", 32, 1 << 63, "position"),
        ("<Q", 40, 1 << 62, "payload length"),
        ("<Q", 40, 10, "payload length"),
    ],
)
def test_forged_fields_are_refused_even_with_a_valid_checksum(fmt, offset, value, reason) -> None:
    raw = unit()
    with pytest.raises(CorruptUnit, match=reason):
        decode_and_verify(forge(raw, fmt, offset, value), namespace=NS)
    with pytest.raises(CorruptUnit):
        decode_and_verify(forge(raw, fmt, offset, value, rehash=False), namespace=NS)


def test_forged_padding_and_key_with_valid_checksum() -> None:
    raw = bytearray(unit(key=b"abc"))
    raw[100] = 1  # padding byte
    raw[80:96] = bytes(16)
    raw[80:96] = xxhash.xxh3_128(bytes(raw)).digest()
    with pytest.raises(CorruptUnit, match="padding"):
        decode_and_verify(raw, namespace=NS)
    # Claiming one more key byte (a padding zero) is another key, refused by key comparison.
    longer = forge(unit(key=b"block-0"), "<H", 14, 8)
    assert decode_and_verify(longer, namespace=NS)[0].key == b"block-0\x00"
    with pytest.raises(CorruptUnit, match="another key"):
        decode_and_verify(longer, namespace=NS, key=b"block-0")


def test_streaming_verification_into_separate_buffers() -> None:
    key = b"block-0"
    raw = unit(key=key)
    length = header_length(key)
    # As a reader with readv: the header into its own buffer, the payload into a region row.
    head = bytearray(raw[:length])
    dest = np.frombuffer(raw[length:], np.uint8).copy()
    header = decode_header(head, namespace=NS, key=key, first=2, end=6)
    verify_payload(header, [dest])
    verifier = PayloadVerifier(header)  # in chunks, as from Redis
    for start in range(0, len(dest), 1000):
        verifier.update(dest[start : start + 1000])
    verifier.finish()
    # a header buffer longer than the header (a fixed-size first read) is fine
    decode_header(raw[: enc.MAX_HEADER_BYTES], namespace=NS)
    dest[5] ^= 1
    with pytest.raises(CorruptUnit, match="checksum"):
        verify_payload(header, [dest])
    with pytest.raises(CorruptUnit, match="truncated payload"):
        verify_payload(header, [dest[:-1]])
    with pytest.raises(CorruptUnit, match="longer"):
        verify_payload(header, [dest, b"x"])


def test_decode_takes_the_namespace_object() -> None:
    with pytest.raises(TypeError, match="namespace"):
        decode_and_verify(unit(), namespace=NS.digest)


# ---------------------------------------------------------------------- a reader's fast path


def fast_check(raw, key=b"block-0", first=2, end=6) -> None:
    """begin_unit_check on ``raw``'s header, then its payload: CorruptUnit unless intact."""
    length = header_length(key)
    hasher, checksum = begin_unit_check(raw, namespace=NS, key=key, first=first, end=end)
    hasher.update(raw[length:])
    if hasher.digest() != checksum:
        raise CorruptUnit("checksum mismatch")


def reason_of(check) -> str | None:
    try:
        check()
    except CorruptUnit as error:
        return error.reason
    return None


def test_begin_unit_check_accepts_the_unit_and_hashes_like_the_writer() -> None:
    raw = unit(position=(1 << 63) - 1)
    fast_check(raw)
    # pieces of any size, as a chunked read feeds them
    length = header_length(b"block-0")
    hasher, checksum = begin_unit_check(raw[:length], namespace=NS, key=b"block-0", first=2, end=6)
    for start in range(length, len(raw), 1000):
        hasher.update(raw[start : start + 1000])
    assert hasher.digest() == checksum == raw[80:96]


def test_every_single_bit_flip_in_the_header_is_refused_by_the_fast_path() -> None:
    raw = unit()
    for byte in range(header_length(b"block-0")):
        for bit in range(8):
            damaged = bytearray(raw)
            damaged[byte] ^= 1 << bit
            assert reason_of(lambda d=damaged: fast_check(bytes(d))) is not None, (byte, bit)


@settings(max_examples=300, deadline=None)
@given(
    key=st.binary(min_size=1, max_size=20),
    offset=st.integers(0, 96 + 24 - 1),
    value=st.integers(0, 255),
    rehash=st.booleans(),
)
def test_the_fast_header_check_agrees_with_decode_header(key, offset, value, rehash) -> None:
    """Any one header byte forged (with or without a valid checksum): the fast path
    refuses exactly what decode_header + the checksum refuse, with the same reason."""
    raw = bytearray(unit(key=key))
    length = header_length(key)
    offset %= length
    raw[offset] = value
    if rehash:
        raw[80:96] = bytes(16)
        raw[80:96] = xxhash.xxh3_128(bytes(raw)).digest()
    raw = bytes(raw)
    expected = reason_of(lambda: decode_and_verify(raw, namespace=NS, key=key, first=2, end=6))
    assert reason_of(lambda: fast_check(raw, key=key)) == expected


def test_begin_unit_check_refuses_another_unit_and_checks_its_arguments() -> None:
    raw = unit()
    with pytest.raises(CorruptUnit, match="another key"):
        begin_unit_check(raw, namespace=NS, key=b"block-1", first=2, end=6)
    with pytest.raises(CorruptUnit, match="starts at layer 2"):
        begin_unit_check(raw, namespace=NS, key=b"block-0", first=1, end=6)
    with pytest.raises(CorruptUnit, match="namespace"):
        begin_unit_check(unit(namespace=OTHER), namespace=NS, key=b"block-0", first=2, end=6)
    with pytest.raises(CorruptUnit, match="truncated header"):
        begin_unit_check(raw[:100], namespace=NS, key=b"block-0", first=2, end=6)
    with pytest.raises(TypeError, match="namespace"):
        begin_unit_check(raw, namespace=NS.digest, key=b"block-0", first=2, end=6)
    with pytest.raises(ValueError, match="end"):
        begin_unit_check(raw, namespace=NS, key=b"block-0", first=2, end=9)


def test_every_forged_header_byte_is_judged_as_decode_header_judges_it() -> None:
    """Each header byte set to other values, checksum recomputed: the same verdicts."""
    key = b"abc"  # 3 key bytes and 5 padding bytes
    raw = unit(key=key)
    for offset in range(header_length(key)):
        for value in {0, 1, 0x7F, 0x80, 0xFF, raw[offset] ^ 1, raw[offset] ^ 0x80}:
            forged = bytearray(raw)
            forged[offset] = value
            forged[80:96] = bytes(16)
            forged[80:96] = xxhash.xxh3_128(bytes(forged)).digest()
            forged = bytes(forged)
            expected = reason_of(
                lambda f=forged: decode_and_verify(f, namespace=NS, key=key, first=2, end=6)
            )
            assert reason_of(lambda f=forged: fast_check(f, key=key)) == expected, (offset, value)
