"""The Redis tier on the wire: commands, a packer that never joins a unit, a reply reader.

A unit's header (hence its checksum) is made just before it is sent; on the store's own
connections (not a cluster's) a *direct* round trip reads each value once from the kernel
into scratch memory, where it is verified (redis-py would copy it three times).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis._parsers.base import BaseParser


class Command:
    """One raw command of a pipeline: its arguments, the value bytes it moves, and where a
    GET's value may land (``into``, direct round trips only)."""

    __slots__ = ("args", "into", "size")

    def __init__(self, *args: Any, size: int = 0, into: _Into | None = None) -> None:
        self.args, self.size, self.into = args, size, into


class _Parts:
    """One bulk-string argument sent as consecutive buffers (never joined). A part may be
    ``(length, make)``: ``make()`` runs when the command is packed (a unit's header, whose
    checksum is then computed just before it is sent)."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: Any) -> None:
        self.parts = parts
        self.nbytes = sum(part[0] if isinstance(part, tuple) else len(part) for part in parts)

    def __len__(self) -> int:
        return self.nbytes


def _made(part: Any) -> Any:
    """A part of :class:`_Parts`, made now if it is ``(length, make)``."""
    if not isinstance(part, tuple):
        return part
    data = part[1]()
    if len(data) != part[0]:  # the bulk string's length is already on the wire
        raise RuntimeError(f"a part of {len(data)} bytes, expected {part[0]}")
    return data


class _PartsPacker:
    """redis-py's ``command_packer`` that knows :class:`_Parts` (RESP frames a bulk string
    by its length, so its pieces may leave in several sends); other commands unchanged."""

    def __init__(self) -> None:
        encoder = redis.connection.Encoder("utf-8", "strict", False)
        self._encode = encoder.encode
        self._plain = redis.connection.PythonRespSerializer(6000, encoder.encode)

    def pack(self, *args: Any) -> list[Any]:
        if not any(isinstance(arg, _Parts) for arg in args):
            return self._plain.pack(*args)
        out: list[Any] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, _Parts):
                out.append(b"$%d\r\n" % arg.nbytes)
                out.extend(_made(part) for part in arg.parts)
            else:
                data = self._encode(arg)
                out += [b"$%d\r\n" % len(data), data]
            out.append(b"\r\n")
        return out


PACKER = _PartsPacker()


class _Into:
    """A GET whose value, if exactly ``head`` + ``size`` bytes, is read into scratch memory
    and handed to ``land(header, payload)``; whatever that returns is the reply. A longer
    value is read through, never held (:class:`TooLong`)."""

    __slots__ = ("head", "land", "size")

    def __init__(self, head: int, size: int, land: Callable[[bytes, memoryview], Any]) -> None:
        self.head, self.size, self.land = head, size, land


class TooLong(int):
    """The reply of a GET with an ``into`` whose value is longer than the unit it expects:
    the value's size (its bytes were read through a buffer at a time and dropped: a value
    at a unit's name is not trusted, and Redis allows 512 MiB)."""


# Bulk replies under this size are bytes (hashable: index members); larger ones the
# bytearray they were read into.
_SMALL_BULK = 1 << 16
READ_BUFFER = 1 << 20
_parse_error = BaseParser.parse_error  # redis-py's error classes (NOPERM, OOM, ...)


class _Reader:
    """RESP2/RESP3 replies from a socket; big bulk strings go straight into their target
    (the bytes already buffered, then ``recv_into`` for the rest: one copy)."""

    def __init__(self, sock: Any, buffer: bytearray, scratch: Callable[[int], memoryview]) -> None:
        self._sock, self._raw, self._buf = sock, buffer, memoryview(buffer)
        self._scratch = scratch
        self._start = self._end = 0

    def _recv(self, view: memoryview) -> int:
        try:
            n = self._sock.recv_into(view)
        except TimeoutError as error:
            raise redis.exceptions.TimeoutError("Timeout reading from socket") from error
        except OSError as error:
            raise redis.exceptions.ConnectionError(f"Error reading from socket: {error}") from error
        if n == 0:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return n

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # a partial line at the end: move it to the front
            size = self._end - self._start
            if size == len(self._buf):
                raise redis.exceptions.InvalidResponse("reply line longer than the read buffer")
            self._buf[:size] = self._buf[self._start : self._end]
            self._start, self._end = 0, size
        self._end += self._recv(self._buf[self._end :])

    def line(self) -> bytes:
        while True:
            at = self._raw.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._raw[self._start : at])
                self._start = at + 2
                return out
            self._fill()

    def into(self, target: memoryview) -> None:
        """Fill ``target`` with the next ``len(target)`` bytes of the stream."""
        done = min(self._end - self._start, len(target))
        target[:done] = self._buf[self._start : self._start + done]
        self._start += done
        while done < len(target):
            done += self._recv(target[done:])

    def skip(self, n: int) -> None:
        """Read past the next ``n`` bytes of the stream, a read buffer at a time."""
        done = min(self._end - self._start, n)
        self._start += done
        n -= done
        while n:
            self._end = self._recv(self._buf)
            self._start = min(n, self._end)
            n -= self._start

    def bulk(self, size: int, into: _Into | None) -> Any:
        if into is not None and size == into.head + into.size:
            header = bytearray(into.head)
            self.into(memoryview(header))
            payload = self._scratch(into.size)
            self.into(payload)
            reply = into.land(bytes(header), payload)
        elif into is not None and size > into.head + into.size:
            self.skip(size)
            reply = TooLong(size)
        else:
            data = bytearray(size)
            self.into(memoryview(data))
            reply = bytes(data) if size < _SMALL_BULK else data
        tail = bytearray(2)
        self.into(memoryview(tail))
        if tail != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk string not followed by CRLF")
        return reply

    def reply(self, into: _Into | None = None) -> Any:
        """The next reply: bytes, int, list, None, a ResponseError, or ``into.land``'s.
        Only the reply types of the tier's commands are known; any other drops the
        connection (``InvalidResponse``)."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind in (b"$", b"*") and int(rest) < 0:  # RESP2 null
            return None
        if kind == b"$":
            return self.bulk(int(rest), into)
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"-":
            return _parse_error(rest.decode("utf-8", "replace"))
        if kind == b"_":  # RESP3 null
            return None
        raise redis.exceptions.InvalidResponse(f"unexpected reply type {kind!r}")


_SEND_ALONE = 1 << 16  # packed pieces at least this big are sent on their own (no join)


def _send(conn: Any, ops: Sequence[Command]) -> None:
    """Pack and send ``ops`` one after the other, small pieces joined per send."""
    pending: list[Any] = []
    check_health = True

    def flush(big: Any = None) -> None:
        nonlocal pending, check_health
        pieces = ([b"".join(pending)] if pending else []) + ([big] if big is not None else [])
        conn.send_packed_command(pieces, check_health=check_health)
        pending, check_health = [], False

    for op in ops:
        for piece in conn.pack_command(*op.args):
            if len(piece) >= _SEND_ALONE:
                flush(piece)
            else:
                pending.append(piece)
    if pending:
        flush()


def direct_exchange(
    conn: Any, ops: Sequence[Command], buffer: bytearray, scratch: Callable, guard: Callable
) -> list[Any]:
    """Send ``ops`` on ``conn`` (inside ``guard()``) and read their replies (``buffer``: the
    read buffer; ``scratch(n)``: where values with an ``into`` land). Any failure drops
    the connection, so a half-read stream never serves the next command."""
    try:
        with guard():
            _send(conn, ops)
        parser_buffer = getattr(getattr(conn, "_parser", None), "_buffer", None)
        if parser_buffer is not None and parser_buffer.unread_bytes():
            raise redis.exceptions.ConnectionError("unread bytes before a pipeline")
        reader = _Reader(conn._sock, buffer, scratch)
        replies = [reader.reply(op.into) for op in ops]
        if reader._start != reader._end:
            raise redis.exceptions.InvalidResponse("more replies than commands")
        return replies
    except BaseException:
        conn.disconnect()
        raise
