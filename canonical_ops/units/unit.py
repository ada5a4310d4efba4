"""THE persisted unit, on disk and on the wire (no I/O here).

A unit is one block's canonical pages of the layers ``[first_layer, end_layer)`` (a
region row of the stage owning them): a header, then the payload, nothing else. All
integers little-endian, unsigned:

======  ====  ==================  =======================================================
offset  size  field               meaning
======  ====  ==================  =======================================================
0       8     magic               ``b"CKVUNIT\\0"``
8       2     version             1
10      2     header_length       ``96 + key_length`` rounded up to 8 (<= 1120)
12      2     checksum_algorithm  1 = XXH3-128 (seed 0); 2 = HMAC-SHA256-128 with the
                                  store's secret (:mod:`.auth`)
14      2     key_length          1 .. 1024
16      4     flags               0 (anything else is refused)
20      4     first_layer, 24 end_layer (> first), 28 total_layers (the namespace's)
32      8     position            the block's index in its sequence, < 2**63
40      8     payload_length      the namespace's bytes of layers [first, end)
48      32    namespace_digest    ``StoreNamespace.digest``
80      16    checksum            over the header with these 16 bytes zeroed, then the
                                  payload (XXH3: its canonical big-endian digest)
96      K     key, then zero padding up to header_length
======  ====  ==================  =======================================================

Nothing read is trusted: every length is bounded against the buffer and the namespace
before use, the checksum covers every header byte, and a unit of another namespace, key
or range is refused by field comparison before any payload byte is hashed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..checks import check_int, check_type
from .namespace import StoreNamespace

__all__ = [
    "CHECKSUM_HMAC_SHA256",
    "CHECKSUM_XXH3_128",
    "FIXED_HEADER_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_KEY_BYTES",
    "MAX_POSITION",
    "CorruptUnit",
    "PayloadVerifier",
    "UnitHeader",
    "as_byte_view",
    "begin_unit_check",
    "decode_and_verify",
    "decode_header",
    "encode_header",
    "encode_unit",
    "header_length",
    "key_digest",
    "normalize_key",
    "pack_header",
    "peek_header",
    "start_unit",
    "verify_payload",
]

MAGIC = b"CKVUNIT\x00"
FORMAT_VERSION = 1
CHECKSUM_XXH3_128 = 1
CHECKSUM_HMAC_SHA256 = 2
MAX_KEY_BYTES = 1024
_FIXED = struct.Struct("<8sHHHHIIIIQQ32s16s")
FIXED_HEADER_BYTES = _FIXED.size
MAX_HEADER_BYTES = FIXED_HEADER_BYTES + MAX_KEY_BYTES
_SUM = slice(80, 96)  # the checksum field
_ZERO_SUM = bytes(16)
MAX_POSITION = (1 << 63) - 1  # positions travel as u64 in headers; int64 elsewhere


class CorruptUnit(Exception):
    """A unit that must not be used (damaged, forged, truncated, someone else's);
    ``reason`` says what did not match."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def normalize_key(key: Any) -> bytes:
    """A block key as the bytes stored in the header.

    bytes-like as is; ``str`` as UTF-8; ``int`` as big-endian two's complement in the
    fewest multiple of 8 bytes that holds it (an int64 block hash is 8 bytes). Keys
    carry no type tag: ``"ab"`` and ``b"ab"`` are one key. 1 to 1024 bytes.
    """
    if type(key) is bytes and 1 <= len(key) <= MAX_KEY_BYTES:
        return key  # the common case (vLLM block hashes), without a copy
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
    elif isinstance(key, str):
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"key: expected a str encodable as UTF-8, got {key!r}") from None
    elif isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        value = int(key)
        magnitude = value if value >= 0 else ~value  # two's complement: -2**63 fits 8 bytes
        words = max(1, (magnitude.bit_length() + 1 + 63) // 64)  # +1: room for the sign bit
        if 8 * words > MAX_KEY_BYTES:
            raise ValueError(f"key: expected an int of at most {MAX_KEY_BYTES} bytes, got {key!r}")
        raw = value.to_bytes(8 * words, "big", signed=True)
    else:
        raise TypeError(f"key: expected bytes, str or int, got {type(key).__name__}")
    if not 1 <= len(raw) <= MAX_KEY_BYTES:
        raise ValueError(f"key: expected 1 to {MAX_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def key_digest(key: Any) -> str:
    """A key's name in stores: 32 hex chars of sha256 of its bytes (:func:`normalize_key`)."""
    return hashlib.sha256(normalize_key(key)).hexdigest()[:32]


def header_length(key: Any) -> int:
    """Header bytes of a unit with ``key`` (where its payload starts)."""
    return FIXED_HEADER_BYTES + _pad8(len(normalize_key(key)))


def as_byte_view(obj: Any, *, writable: bool = False, name: str = "buffer") -> memoryview:
    """A flat uint8 memoryview over ``obj`` (bytes-like, C-contiguous numpy array or CPU
    torch tensor) without a copy; ``name`` is the argument named in errors."""
    view = obj  # flat bytes already (the stores pass views along), or made so:
    if not (type(obj) is memoryview and obj.format == "B" and obj.ndim == 1 and obj.c_contiguous):
        if type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "untyped_storage"):
            if obj.device.type != "cpu":
                raise ValueError(f"{name}: expected a CPU tensor, got one on {obj.device}")
            if not obj.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor")
            obj = obj.detach().reshape(-1).view(sys.modules["torch"].uint8).numpy()
        if isinstance(obj, np.ndarray):
            if not obj.flags.c_contiguous:
                raise ValueError(f"{name}: expected a C-contiguous array")
            obj = obj.reshape(-1).view(np.uint8)
        try:
            view = memoryview(obj)
        except TypeError:
            raise TypeError(
                f"{name}: expected a bytes-like object, numpy array or CPU torch tensor, "
                f"got {type(obj).__name__}"
            ) from None
        if not view.c_contiguous:
            raise ValueError(f"{name}: expected contiguous memory")
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    if writable and view.readonly:
        raise ValueError(f"{name}: expected writable memory, got a read-only buffer")
    return view


def payload_view(
    namespace: StoreNamespace, obj: Any, first: int, end: int, name: str, writable: bool = False
) -> memoryview:
    """:func:`as_byte_view` of ``obj``, ``ValueError`` unless it holds layers ``[first, end)``."""
    view = as_byte_view(obj, writable=writable, name=name)
    if len(view) != (expected := namespace.layer_bytes(first, end)):
        raise ValueError(
            f"{name}: expected {expected} bytes (layers [{first}, {end})), got {len(view)}"
        )
    return view


@dataclass(frozen=True)
class UnitHeader:
    """A decoded header (fields as in the module docstring; ``raw`` as stored)."""

    version: int
    header_length: int
    checksum_algorithm: int
    flags: int
    key: bytes
    first_layer: int
    end_layer: int
    total_layers: int
    position: int
    payload_length: int
    namespace_digest: bytes
    checksum: bytes
    raw: bytes
    namespace: StoreNamespace | None = field(default=None, repr=False, compare=False)

    @property
    def total_length(self) -> int:
        """Bytes of the whole unit (header and payload)."""
        return self.header_length + self.payload_length


def _algorithm(namespace: StoreNamespace) -> int:
    return CHECKSUM_HMAC_SHA256 if namespace.key_id else CHECKSUM_XXH3_128


def new_hasher(namespace: StoreNamespace | None, algorithm: int = 0) -> Any:
    """A fresh checksum (or MAC) of a namespace's units (namespace unknown: of ``algorithm``)."""
    if namespace is not None:
        algorithm = _algorithm(namespace)
    if algorithm == CHECKSUM_XXH3_128:
        return xxhash.xxh3_128()
    if namespace is None or namespace.secret is None:
        raise CorruptUnit("authenticated unit: no secret to verify it with")
    return namespace.secret.mac()


def _hashing(namespace: StoreNamespace | None, head: bytes, algorithm: int = 0) -> Any:
    """:func:`new_hasher` having taken the header ``head`` with its checksum field zeroed."""
    hasher = new_hasher(namespace, algorithm)
    hasher.update(head[:80] + _ZERO_SUM + head[96:])
    return hasher


_POSITION_AT = struct.calcsize("<8sHHHHIIII")  # the position's offset (a little-endian u64)
# (namespace digest, key id, key length, first, end) -> (the fixed header at position 0, the
# bytes before and after the position, the key's zero padding): built once, not per unit.
_SHAPES: dict[tuple[bytes, str, int, int, int], tuple[bytes, bytes, bytes, bytes]] = {}


def packed_header(ns: StoreNamespace, raw_key: bytes, first: int, end: int, position: int) -> bytes:
    """:func:`pack_header` of arguments a store has checked (a request's normalized key, its
    range and position): a unit's header, checksum zeroed (what the checksum covers). The
    digest names the namespace's geometry and the key id its algorithm, so what a header
    shares with others of its shape is packed once per shape (a load's: two concatenations)."""
    shape = (ns.digest, ns.key_id, len(raw_key), first, end)
    parts = _SHAPES.get(shape)
    if parts is None:
        length = FIXED_HEADER_BYTES + _pad8(len(raw_key))
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            length,
            _algorithm(ns),
            len(raw_key),
            0,
            first,
            end,
            ns.num_layers,
            0,
            ns.layer_bytes(first, end),
            ns.digest,
            _ZERO_SUM,
        )
        pad = bytes(length - FIXED_HEADER_BYTES - len(raw_key))
        parts = (fixed, fixed[:_POSITION_AT], fixed[_POSITION_AT + 8 :], pad)
        if len(_SHAPES) >= 4096:  # bounded: shapes are few, but keys of any length exist
            _SHAPES.clear()
        _SHAPES[shape] = parts
    if position:
        return parts[1] + position.to_bytes(8, "little") + parts[2] + raw_key + parts[3]
    return parts[0] + raw_key + parts[3]


def pack_header(namespace: StoreNamespace, key: Any, first: int, end: int, position: int) -> bytes:
    """A unit's header with its checksum zeroed (what the native I/O writes and expects)."""
    first, end = check_type("namespace", namespace, StoreNamespace).layer_range(first, end)
    if type(position) is not int or not 0 <= position <= MAX_POSITION:
        position = check_int("position", position, minimum=0, maximum=MAX_POSITION)
    return packed_header(namespace, normalize_key(key), first, end, position)


def start_unit(
    namespace: StoreNamespace, key: Any, first: int, end: int, position: int
) -> tuple[bytes, Any]:
    """A unit's header with its checksum zeroed, and a hasher that has taken it: feed it
    the payload, then the header is ``head[:80] + hasher.digest() + head[96:]``."""
    head = pack_header(namespace, key, first, end, position)
    return head, _hashing(namespace, head)


def encode_header(
    namespace: StoreNamespace, key: Any, first: int, end: int, position: int, payload: Any
) -> bytes:
    """The header of a unit of ``key``, layers ``[first, end)`` and prefix ``position``,
    whose payload (``namespace.layer_bytes(first, end)`` bytes: a region row, array,
    tensor...) is hashed in place; write it, then the payload."""
    head, hasher = start_unit(namespace, key, first, end, position)
    hasher.update(payload_view(namespace, payload, first, end, "payload"))
    return head[:80] + hasher.digest() + head[96:]


def encode_unit(
    namespace: StoreNamespace, key: Any, first: int, end: int, position: int, payload: Any
) -> bytes:
    """A whole unit (header + a copy of the payload) as one bytes object, e.g. a Redis value."""
    header = encode_header(namespace, key, first, end, position, payload)
    return header + as_byte_view(payload, name="payload").tobytes()


def peek_header(buffer: Any) -> UnitHeader:
    """Parse a header's structure WITHOUT checking namespace or checksum (tools only):
    safe to look at, never to trust. ``CorruptUnit`` on any structural fault."""
    view = as_byte_view(buffer)
    if len(view) < FIXED_HEADER_BYTES:
        raise CorruptUnit(f"truncated header: {len(view)} of {FIXED_HEADER_BYTES} bytes")
    fields = _FIXED.unpack_from(view, 0)  # ... payload length, namespace digest, checksum
    magic, version, length, algorithm, key_length, flags, first, end, total, position = fields[:10]
    if magic != MAGIC:
        raise CorruptUnit(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptUnit(f"unsupported format version {version} (expected {FORMAT_VERSION})")
    if algorithm not in (CHECKSUM_XXH3_128, CHECKSUM_HMAC_SHA256):
        raise CorruptUnit(f"unknown checksum algorithm {algorithm}")
    if flags:
        raise CorruptUnit(f"unknown flags {flags:#x}")
    if not 1 <= key_length <= MAX_KEY_BYTES:
        raise CorruptUnit(f"key length {key_length} outside [1, {MAX_KEY_BYTES}]")
    if length != FIXED_HEADER_BYTES + _pad8(key_length):
        raise CorruptUnit(f"header length {length} does not match key length {key_length}")
    if len(view) < length:
        raise CorruptUnit(f"truncated header: {len(view)} of {length} bytes")
    raw = bytes(view[:length])
    if any(raw[FIXED_HEADER_BYTES + key_length :]):
        raise CorruptUnit("non-zero header padding")
    if not first < end <= total:
        raise CorruptUnit(f"layer range [{first}, {end}) invalid for {total} layers")
    if position > MAX_POSITION:
        raise CorruptUnit(f"position {position} out of range")
    key = raw[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + key_length]
    head = (version, length, algorithm, flags, key, first, end, total, position)
    return UnitHeader(*head, *fields[10:], raw)


def decode_header(
    buffer: Any,
    *,
    namespace: StoreNamespace,
    key: Any = None,
    first: int | None = None,
    end: int | None = None,
) -> UnitHeader:
    """Parse and check a header at the start of ``buffer`` (the header alone or the whole
    unit) against the reader's ``namespace`` and, when given, ``key``/``first``/``end``.
    The payload is NOT verified: use :class:`PayloadVerifier` before trusting a byte."""
    check_type("namespace", namespace, StoreNamespace)
    header = peek_header(buffer)
    if header.namespace_digest != namespace.digest:
        raise CorruptUnit(
            f"namespace {header.namespace_digest.hex()[:16]}... is not the reader's "
            f"{namespace.hex[:16]}..."
        )
    if header.total_layers != namespace.num_layers:
        raise CorruptUnit(
            f"total layers {header.total_layers} != the namespace's {namespace.num_layers}"
        )
    if header.checksum_algorithm != _algorithm(namespace):
        raise CorruptUnit(f"checksum algorithm {header.checksum_algorithm} in this namespace")
    expected = namespace.layer_bytes(header.first_layer, header.end_layer)
    if header.payload_length != expected:
        raise CorruptUnit(
            f"payload length {header.payload_length} != {expected} bytes of layers "
            f"[{header.first_layer}, {header.end_layer})"
        )
    if key is not None and header.key != normalize_key(key):
        raise CorruptUnit("unit is for another key")
    if first is not None and header.first_layer != first:
        raise CorruptUnit(f"unit starts at layer {header.first_layer}, expected {first}")
    if end is not None and header.end_layer != end:
        raise CorruptUnit(f"unit ends at layer {header.end_layer}, expected {end}")
    object.__setattr__(header, "namespace", namespace)
    return header


class PayloadVerifier:
    """Checksum a unit's payload as it arrives, in pieces: ``update`` each, then ``finish``
    (``CorruptUnit`` unless all of it came and the checksum or MAC matches)."""

    __slots__ = ("_expected", "_hasher", "_length", "_remaining")

    def __init__(self, header: UnitHeader) -> None:
        check_type("header", header, UnitHeader)
        self._hasher = _hashing(header.namespace, header.raw, header.checksum_algorithm)
        self._expected, self._length = header.checksum, header.payload_length
        self._remaining = header.payload_length

    def update(self, piece: Any) -> None:
        """Hash the next ``piece`` of payload (any buffer; not copied)."""
        view = as_byte_view(piece, name="piece")
        if len(view) > self._remaining:
            raise CorruptUnit(f"payload longer than its header's {self._length} bytes")
        self._hasher.update(view)
        self._remaining -= len(view)

    def finish(self) -> None:
        if self._remaining:
            raise CorruptUnit(
                f"truncated payload: {self._length - self._remaining} of {self._length} bytes"
            )
        if not hmac.compare_digest(self._hasher.digest(), self._expected):  # a MAC's too
            raise CorruptUnit("checksum mismatch")


def begin_unit_check(
    buffer: Any, *, namespace: StoreNamespace, key: Any, first: int, end: int
) -> tuple[Any, bytes]:
    """A reader's fast path: the header of one expected unit compared with the bytes it
    must have (accepting exactly what :func:`decode_header` does, which names a mismatch),
    and a hasher that has taken it: feed it the payload, compare ``digest()`` with item 2."""
    check_type("namespace", namespace, StoreNamespace)
    raw_key = normalize_key(key)
    want = packed_header(namespace, raw_key, first, end, 0)
    view = as_byte_view(buffer)
    if len(view) < len(want):
        raise CorruptUnit(f"truncated header: {len(view)} of {len(want)} bytes")
    head = bytes(view[: len(want)])
    if (
        head[:32] != want[:32]  # magic .. total layers
        or head[39] >= 0x80  # position < 2**63 (its top byte, little-endian)
        or head[40:80] != want[40:80]  # payload length, namespace digest
        or head[96:] != want[96:]  # key and padding
    ):
        decode_header(head, namespace=namespace, key=raw_key, first=first, end=end)
        raise CorruptUnit("header does not match the unit's")  # pragma: no cover - defensive
    return _hashing(namespace, head), head[_SUM]


def verify_payload(header: UnitHeader, parts: Iterable[Any]) -> None:
    """Verify a payload given as consecutive ``parts`` (e.g. ``[row]`` or chunk list)."""
    verifier = PayloadVerifier(header)
    for part in parts:
        verifier.update(part)
    verifier.finish()


def decode_and_verify(
    buffer: Any, *, namespace: StoreNamespace, **expected: Any
) -> tuple[UnitHeader, memoryview]:
    """Decode and fully verify a whole unit held in one buffer (``expected``: ``key``,
    ``first``, ``end``, as :func:`decode_header`); the header and a read-only view of the
    payload in ``buffer``. ``CorruptUnit`` on anything wrong."""
    view = as_byte_view(buffer)
    header = decode_header(view, namespace=namespace, **expected)
    if len(view) != header.total_length:
        what = "truncated" if len(view) < header.total_length else "extra bytes after"
        raise CorruptUnit(f"{what} unit: {len(view)} bytes, header says {header.total_length}")
    payload = view[header.header_length :].toreadonly()
    verify_payload(header, [payload])
    return header, payload
