"""The Redis tier on the wire: commands, a packer, and a reader of replies.

Stores, loads and lookups on connections the store made (standalone servers:
not a cluster, whose client makes its own) take *direct* round trips
(:func:`direct_exchange`): the commands are packed one after the other as they
are sent (a unit's header, with its checksum, just before the unit: that work
overlaps the server reading the previous one), a unit goes out as header +
payload without being joined (:class:`_Parts`), and replies are read by
:class:`_Reader`: a unit's value once, from the kernel into a reused buffer,
handed to its load (:class:`_Into`) to be verified and only then copied into
the destination. redis-py's own pipeline copies every value three times, into
fresh memory (measured: most of a load's time). Connections, retries,
timeouts and error classes stay redis-py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis._parsers.base import BaseParser


class _Op:
    """One command of a pipeline: redis-py method, arguments, and value bytes it moves.

    ``into``: where a GET's value may land directly (:class:`_Into`, direct
    round trips only).
    """

    __slots__ = ("args", "into", "kwargs", "name", "size")

    def __init__(
        self, name: str, *args: Any, size: int = 0, into: _Into | None = None, **kwargs: Any
    ) -> None:
        self.name, self.args, self.kwargs, self.size, self.into = name, args, kwargs, size, into


def _get(key: str, size: int, into: _Into | None = None) -> _Op:
    # execute_command: the hot commands skip redis-py's per-method argument handling.
    return _Op("execute_command", "GET", key, size=size, into=into)


def _set(
    key: str, value: Any, *, size: int, px: int | None = None, nx: bool = False, get: bool = False
) -> _Op:
    """``SET key value [PX px] [NX] [GET]`` as a raw command (direct round trips take it)."""
    args: list[Any] = ["SET", key, value]
    if px is not None:
        args += ["PX", px]
    if nx:
        args.append("NX")
    if get:
        args.append("GET")
    return _Op("execute_command", *args, size=size)


def _deletes(keys: Sequence[str]) -> list[_Op]:
    """One DEL per key: a cluster pipeline refuses multi-key DEL (even within one slot)."""
    return [_Op("delete", key) for key in keys]


class _Parts:
    """One bulk-string argument given as consecutive buffers (a unit's header, then its
    payload), sent one after the other: the value is never joined into one copy.

    A part may be a callable with a length (``len(part)`` bytes, made by
    ``part()`` when the command is packed): a unit's header, whose checksum is
    then computed just before it is sent (on a direct round trip, while the
    server still reads the previous unit).
    """

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: Any) -> None:
        self.parts = parts
        self.nbytes = sum(len(part) for part in parts)

    def __len__(self) -> int:
        return self.nbytes


class _PartsPacker:
    """A redis-py command packer (its ``command_packer=`` option) that knows :class:`_Parts`.

    RESP frames a bulk string by its length, so its bytes may leave in several
    ``sendall`` calls; redis-py's own packer only takes one buffer per argument,
    which would cost a copy of every unit (measured: a third of a SET's time on a
    busy host). Commands without :class:`_Parts` go to redis-py's packer unchanged.
    """

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
                out.extend(part() if callable(part) else part for part in arg.parts)
                out.append(b"\r\n")
            else:
                data = self._encode(arg)
                out.append(b"$%d\r\n" % len(data))
                out.append(data)
                out.append(b"\r\n")
        return out


_PACKER = _PartsPacker()


# ---------------------------------------------------------------------- direct replies


class _Landed:
    """A GET reply handed to its :class:`_Into` on arrival: ``nbytes`` read, and
    ``problem`` (None: verified and placed; else why the value is corrupt)."""

    __slots__ = ("nbytes", "problem")

    def __init__(self, nbytes: int, problem: str | None) -> None:
        self.nbytes, self.problem = nbytes, problem


class _Into:
    """What to do with a GET's value of exactly ``head`` + ``size`` bytes as it arrives.

    The reader reads it into a reused buffer (no fresh memory, one copy from the
    kernel) and calls ``land(header, payload)``, which returns the reply
    (a :class:`_Landed`). Values of any other size are replied as usual.
    """

    __slots__ = ("head", "land", "size")

    def __init__(self, head: int, size: int, land: Callable[[bytes, memoryview], _Landed]):
        self.head, self.size, self.land = head, size, land


# Bulk replies under this size are returned as bytes (hashable: index members);
# larger ones as the bytearray they were read into (no second copy).
_SMALL_BULK = 1 << 16
_READ_BUFFER = 1 << 20


class _Reader:
    """RESP2/RESP3 replies read from a socket, big bulk strings straight into their target.

    redis-py reads a value into its own buffer, then copies it into a bytes
    object (three copies of every unit, and fresh memory each time: measured,
    most of a load's time). Here the bytes already buffered go to the target,
    then ``recv_into`` fills the rest of it: one copy, from the kernel.
    """

    def __init__(self, sock: Any, buffer: bytearray, scratch: Callable[[int], memoryview]) -> None:
        self._sock, self._raw, self._buf = sock, buffer, memoryview(buffer)
        self._scratch = scratch
        self._start = self._end = 0

    def _recv(self, view: memoryview) -> int:
        try:
            n = self._sock.recv_into(view)
        except TimeoutError as error:  # socket.timeout
            raise redis.exceptions.TimeoutError("Timeout reading from socket") from error
        except OSError as error:
            raise redis.exceptions.ConnectionError(
                f"Error while reading from socket: {error}"
            ) from error
        if n == 0:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return n

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # a line longer than the rest: move it to the front
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
        buffered = min(self._end - self._start, len(target))
        target[:buffered] = self._buf[self._start : self._start + buffered]
        self._start += buffered
        done = buffered
        while done < len(target):
            done += self._recv(target[done:])

    def crlf(self) -> None:
        tail = bytearray(2)
        self.into(memoryview(tail))
        if tail != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk string not followed by CRLF")

    @property
    def idle(self) -> bool:
        return self._start == self._end

    def reply(self, into: _Into | None = None) -> Any:
        """The next reply: bytes, int, list, None, a ResponseError, or ``into.land``'s."""
        while True:
            line = self.line()
            kind, rest = line[:1], line[1:]
            if kind != b">":  # RESP3 push messages are not replies: skipped
                break
            for _ in range(int(rest)):
                self.reply()
        if kind in (b"$", b"="):
            size = int(rest)
            if size < 0:
                return None
            if into is not None and size == into.head + into.size:
                header = bytearray(into.head)
                self.into(memoryview(header))
                payload = self._scratch(into.size)
                self.into(payload)
                self.crlf()
                return into.land(bytes(header), payload)
            data = bytearray(size)
            self.into(memoryview(data))
            self.crlf()
            if kind == b"=":  # verbatim string: "txt:" + text
                data = data[4:]
            return bytes(data) if size < _SMALL_BULK else data
        if kind in (b"*", b"~", b"%"):
            count = int(rest)
            if count < 0:
                return None
            if kind == b"%":
                return {self.reply(): self.reply() for _ in range(count)}
            return [self.reply() for _ in range(count)]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"-":
            return _parse_error(rest.decode("utf-8", "replace"))
        if kind == b"_":
            return None
        if kind == b"#":
            return rest == b"t"
        if kind == b",":
            return float(rest)
        raise redis.exceptions.InvalidResponse(f"unexpected reply type {kind!r}")


# Pieces of a packed command at least this big are sent on their own (no join).
_SEND_ALONE = 1 << 16


def _send(conn: Any, ops: Sequence[_Op]) -> None:
    """Pack and send ``ops`` one after the other (small pieces joined per send).

    Packing a command just before sending it lets the work it needs (a unit's
    checksum) overlap the server reading the previous, still in the socket buffers.
    """
    pending: list[Any] = []
    check_health = True

    def flush(big: Any = None) -> None:
        nonlocal pending, check_health
        pieces = [b"".join(pending)] if pending else []
        if big is not None:
            pieces.append(big)
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


# redis-py's mapping of error replies to exception classes (NOPERM, OOM, ...).
_parse_error = BaseParser.parse_error


def direct_exchange(
    conn: Any, ops: Sequence[_Op], buffer: bytearray, scratch: Callable[[int], memoryview]
) -> list[Any]:
    """Send ``ops`` (raw commands: ``execute_command`` arguments) on ``conn`` and read
    their replies with :class:`_Reader` (``buffer``: its read buffer; ``scratch(n)``:
    where a value with an ``into`` lands).

    The socket must hold nothing unread (checked); on any failure the connection
    is dropped, so a half-read stream never serves the next command.
    """
    try:
        _send(conn, ops)
        parser_buffer = getattr(getattr(conn, "_parser", None), "_buffer", None)
        if parser_buffer is not None and parser_buffer.unread_bytes():
            raise redis.exceptions.ConnectionError("unread bytes before a pipeline")
        reader = _Reader(conn._sock, buffer, scratch)
        replies = [reader.reply(op.into) for op in ops]
        if not reader.idle:
            raise redis.exceptions.InvalidResponse("more replies than commands")
        return replies
    except BaseException:
        conn.disconnect()
        raise
