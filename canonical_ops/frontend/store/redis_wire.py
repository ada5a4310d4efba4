"""The Redis tier on the wire: pipeline commands, and a packer that sends a unit unjoined."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis


class _Op:
    """One command of a pipeline: redis-py method, arguments, and value bytes it moves."""

    __slots__ = ("args", "kwargs", "name", "size")

    def __init__(self, name: str, *args: Any, size: int = 0, **kwargs: Any) -> None:
        self.name, self.args, self.kwargs, self.size = name, args, kwargs, size


def _get(key: str, size: int) -> _Op:
    # execute_command: the hot commands skip redis-py's per-method argument handling.
    return _Op("execute_command", "GET", key, size=size)


def _deletes(keys: Sequence[str]) -> list[_Op]:
    """One DEL per key: a cluster pipeline refuses multi-key DEL (even within one slot)."""
    return [_Op("delete", key) for key in keys]


class _Parts:
    """One bulk-string argument given as consecutive buffers (a unit's header, then its
    payload), sent one after the other: the value is never joined into one copy."""

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
                out.extend(arg.parts)
                out.append(b"\r\n")
            else:
                data = self._encode(arg)
                out.append(b"$%d\r\n" % len(data))
                out.append(data)
                out.append(b"\r\n")
        return out


_PACKER = _PartsPacker()
