"""Redis tier URLs: parsed so that no password character can move the host, printed redacted.

The user:password part ends at the one ``@`` followed by a well-formed address; an ambiguous
URL is refused by a message naming no part of it. No redis-py needed (demo and CLI use it).
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REDIS_SCHEMES", "RedisURL", "parse_url", "redact_url"]

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
# What may follow the credentials: host[:port][/db][?query][#fragment], or a socket path.
_HOST = r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)"
_AFTER_HOST = r"(?::\d{1,5})?(?:/\d*)?(?:[?#].*)?"
_TCP = re.compile(_HOST + _AFTER_HOST, re.S)
_UNIX = re.compile(r"/[^?#]*(?:[?#].*)?", re.S)
# A URL without credentials (its host may be left out); anything else may hold a password:
# ``redis://user:password`` (no host) reads as host ``user``, port ``password``.
# Its host is redis-py's to check (unicode names, IPv6 zones): only a port must be digits.
_TCP_ALONE = re.compile(r"(?:\[[^\]/?#@]*\]|[^\[\]:/?#@]*)" + _AFTER_HOST, re.S)
_ENCODE_HINT = (
    "percent-encode '@', '/', '?' and '#' in the password (urllib.parse.quote(password, "
    "safe='')) or pass password=... instead"
)


@dataclass(frozen=True)
class RedisURL:
    """A checked Redis tier URL: ``address`` is the URL without its credentials."""

    scheme: str
    username: str | None
    password: str | None = field(repr=False)
    address: str

    @property
    def cluster(self) -> bool:
        return self.scheme.endswith("+cluster")

    def __repr__(self) -> str:  # the address may carry ?password=
        shown = _redact_query(self.address)
        return f"RedisURL(scheme={self.scheme!r}, username={self.username!r}, address={shown!r})"


def _split(url: str) -> tuple[str, str | None, str] | None:
    """(scheme, user:password part or None, rest), or None when the ``@`` is ambiguous."""
    scheme, _, rest = url.partition("://")
    shape = _UNIX if scheme.lower() == "unix" else _TCP
    ends = [i for i, c in enumerate(rest) if c == "@" and shape.fullmatch(rest, i + 1)]
    if len(ends) == 1:
        return scheme, rest[: ends[0]], rest[ends[0] + 1 :]
    alone = _UNIX if shape is _UNIX else _TCP_ALONE
    return (scheme, None, rest) if not ends and "@" not in rest and alone.fullmatch(rest) else None


def _redact_query(rest: str) -> str:
    """``rest`` with the value of every ``password`` argument (its name as redis-py reads it:
    percent-decoded, any case) replaced by ``***``."""

    def hide(arg: re.Match) -> str:
        name = urllib.parse.unquote_plus(arg[2]).lower()
        return arg[1] + "***" if name == "password" else arg[0]

    return re.sub(r"([?&]([^=&#]*)=)[^&#]*", hide, rest)


def redact_url(url: Any) -> str:
    """``url`` safe to print: credentials and ``password=`` values replaced by ``***``; a
    string without ``://`` (a directory) unchanged unless it starts like a Redis URL; if the
    credentials cannot be told apart, all before the last ``@`` hidden (all, without one)."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    if "://" not in url:  # a directory, or a mistyped URL ('redis:/u:pw@h'): all hidden
        typo = re.match(r"(?i)(?:rediss?|unix)(?:\+cluster)?(?::|//)", url)
        return f"{typo[0]}***" if typo else url
    split = _split(url)
    if split is None:
        scheme, _, rest = url.partition("://")
        if "@" not in rest:  # no address to show: all of it may be credentials
            return f"{scheme}://***"
        return f"{scheme}://***@{_redact_query(rest.rpartition('@')[2])}"
    scheme, auth, rest = split
    if auth is None:
        return f"{scheme}://{_redact_query(rest)}"
    user, colon, _ = auth.partition(":")
    shown = f"{user}:***" if colon and user else "***"
    return f"{scheme}://{shown}@{_redact_query(rest)}"


def parse_url(url: Any) -> RedisURL:
    """Check a Redis tier URL and take its credentials out (percent-decoded). TypeError /
    ValueError (naming ``url``, never its password): not a str, an unknown scheme, or
    credentials that cannot be told apart from the address."""
    if not isinstance(url, str):
        raise TypeError(
            f"url: expected a redis://, rediss:// or unix:// URL str, got {type(url).__name__}"
        )
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        got = repr(redact_url(url)) if scheme else "a str without '://'"  # 'redis:/u:pw@h'
        raise ValueError(
            f"url: expected a URL with scheme {', '.join(s + '://' for s in REDIS_SCHEMES)}; "
            f"got {got}"
        )
    split = _split(url)
    if split is None and "@" not in url.partition("://")[2]:
        raise ValueError(
            f"url: expected host[:port][/db] (a port of 1 to 5 digits) or a socket path after "
            f"{scheme}:// (a password goes before an '@': {scheme}://[user]:password@host)"
        )
    if split is None:
        raise ValueError(
            f"url: cannot tell where the user:password part of a {scheme}:// URL ends (an '@' "
            f"that is not followed by a host[:port][/db] or a socket path); {_ENCODE_HINT}"
        )
    _, auth, rest = split
    user, colon, secret = (auth or "").partition(":")
    username = urllib.parse.unquote(user) or None
    password = urllib.parse.unquote(secret) if colon else None
    return RedisURL(scheme, username, password, f"{scheme}://{rest}")
